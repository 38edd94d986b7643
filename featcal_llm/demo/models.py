"""The demo's models: pre-train the base, fine-tune the experts (in worker processes when there are cores).

Each model is saved atomically (a ``.partial`` directory renamed into place), so an interrupted demo never leaves a
half-written checkpoint for the cache to trust.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from featcal_llm.demo.config import DemoConfig


class TimedLog:
    """Messages stamped with seconds since the demo began; worker processes share the start, so their lines line up."""

    def __init__(self, echo: Callable[[str], None]):
        self.echo = echo
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        self.echo(f"[{time.perf_counter() - self.start:6.1f}s] {message}")


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def build_base(cfg: DemoConfig, workdir: Path, device: str, log) -> None:
    from featcal_llm.demo.tasks import pretraining_corpus, read_jsonl
    from featcal_llm.demo.train import pretrain
    from featcal_llm.tiny import (
        CHARACTERS,
        build_char_tokenizer,
        new_tiny_llama,
        tiny_llama_config,
    )

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(
        len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
    )
    model = new_tiny_llama(config, cfg.seed).to(device)
    train = {task: read_jsonl(workdir / "data" / task / "train.jsonl") for task in cfg.tasks}
    text = pretraining_corpus(CHARACTERS, train, cfg.seed, cfg.skill_fraction)
    ids = tokenizer.convert_tokens_to_ids(list(text))  # one token per character
    log(f"base: pre-training a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter Llama "
        f"({cfg.num_hidden_layers} layers, GQA {cfg.num_attention_heads}/{cfg.num_key_value_heads}) "
        f"on {len(ids) / 1e3:.0f}k characters of generic text (Python's reference prose, with sums, "
        f"word games and sequences in plain sentences)")
    pretrain(model, ids, steps=cfg.pretrain_steps, batch_size=cfg.pretrain_batch, seq_len=cfg.pretrain_seq_len,
             lr=cfg.pretrain_lr, seed=cfg.seed, every=max(1, cfg.pretrain_steps // 6),
             progress=lambda s, n, loss: log(f"base: step {s}/{n}  loss {loss:.3f}"))
    save_atomically(model.cpu(), tokenizer, workdir / "base")


def save_atomically(model, tokenizer, path: Path) -> None:
    """Write to a sibling ``.partial`` directory, then swap it in: an interrupted run leaves no half-written model."""
    from featcal_llm.tiny import save_model

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def train_expert(cfg: DemoConfig, workdir: str, task: str, device: str, threads: int, started: float) -> dict:
    """Fine-tune every weight of the base on one task until its dev target; runs in a worker process when the demo has cores.

    The expert is saved only when it reached the target; either way its training record is returned.
    """
    set_threads(threads)
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    from featcal_llm.demo.score import exact_match
    from featcal_llm.demo.tasks import read_jsonl
    from featcal_llm.demo.train import finetune
    from featcal_llm.tiny import build_char_tokenizer

    root = Path(workdir)
    log = TimedLog(lambda m: print(m, flush=True))
    log.start = started
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(root / "base").to(device)
    records = read_jsonl(root / "data" / task / "train.jsonl")
    dev = read_jsonl(root / "data" / task / "dev.jsonl")
    cap = cfg.finetune_max_steps
    target = f" (target {cfg.expert_target:g}%)" if cfg.expert_target is not None else ""

    last = {"step": 0, "loss": float("nan")}

    def skill() -> float:
        accuracy = exact_match(model, tokenizer, dev)
        log(f"expert {task}: step {last['step']}/{cap} (cap)  loss {last['loss']:.3f}  "
            f"dev exact match {accuracy:.1f}%{target}")
        return accuracy

    result = finetune(model, tokenizer, records, steps=cap, batch_size=cfg.finetune_batch, lr=cfg.finetune_lr,
                      seed=cfg.seed + 1 + cfg.tasks.index(task), every=cfg.check_every,
                      progress=lambda s, n, loss: last.update(step=s, loss=loss),
                      skill=skill, target=cfg.expert_target, check_every=cfg.check_every)
    record = {"task": task, "steps": result.steps, "dev_accuracy": result.accuracy, "target": cfg.expert_target,
              "reached": result.reached, "checks": [list(c) for c in result.checks]}
    if result.reached:
        save_atomically(model.cpu(), tokenizer, root / "experts" / task)
        log(f"expert {task}: done after {result.steps} steps, dev exact match {result.accuracy:.1f}%")
    else:
        log(f"expert {task}: missed its target after {result.steps} steps (dev exact match {result.accuracy:.1f}%)")
    return record


def train_experts(cfg: DemoConfig, workdir: Path, tasks: list[str], device: str, workers: int, log) -> list[dict]:
    """Train the experts of ``tasks`` (in worker processes when there are cores) and return their training records."""
    if not tasks:
        return []
    log(f"experts: fully fine-tuning {', '.join(tasks)} from the base until each reaches "
        + (f"{cfg.expert_target:g}% exact match on its dev split" if cfg.expert_target is not None else "its step cap")
        + f" (checked every {cfg.check_every} steps, at most {cfg.finetune_max_steps})"
        + (f" in {workers} worker processes" if workers > 1 else ""))
    started = log.start
    if workers <= 1 or device != "cpu" or len(tasks) == 1:
        return [train_expert(cfg, str(workdir), task, device, max(1, _threads()), started) for task in tasks]
    import multiprocessing

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(train_expert, cfg, str(workdir), t, device, 1, started) for t in tasks]
        return [future.result() for future in futures]


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _threads() -> int:
    import torch

    return torch.get_num_threads()
