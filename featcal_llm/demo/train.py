"""Plain-torch training loops: generic pre-training, then full fine-tuning per task until a skill target.

Training to a measured skill rather than to a step count keeps the demo's experts
equally good on every CPU: float kernels differ between CPUs (AVX-512, AVX2, none),
and a fixed budget that sits near the edge of learning a task turns those tiny
differences into experts that did or did not learn it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

Progress = Callable[[int, int, float], None]
Check = Callable[[int], bool]  # called with the step count; True stops the training


@dataclass
class SkillResult:
    """How a fine-tuning run ended: its steps, its dev checks (step, accuracy %), and whether it reached the target."""

    steps: int
    loss: float
    target: float | None
    checks: list[tuple[int, float]] = field(default_factory=list)

    @property
    def accuracy(self) -> float | None:
        return self.checks[-1][1] if self.checks else None

    @property
    def reached(self) -> bool:
        return self.target is None or (self.accuracy is not None and self.accuracy >= self.target)


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(model, next_batch, steps: int, lr: float, progress: Progress | None, every: int,
           vocab_lr_scale: float = 1.0, check: Check | None = None, check_every: int = 0) -> tuple[int, float]:
    """``steps`` optimiser steps (the schedule's length), or fewer when ``check`` says stop; returns (steps, loss)."""
    model.train()
    vocab = [p for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n]
    ids = {id(p) for p in vocab}
    groups = [{"params": [p for p in model.parameters() if id(p) not in ids], "scale": 1.0},
              {"params": vocab, "scale": vocab_lr_scale}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    smoothed = float("nan")
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup) * group["scale"]
        input_ids, labels = next_batch()
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
        if progress is not None and ((step + 1) % every == 0 or step + 1 == steps):
            progress(step + 1, steps, smoothed)
        if check is not None and ((step + 1) % check_every == 0 or step + 1 == steps):
            model.eval()
            done = check(step + 1)
            model.train()
            if done:
                model.eval()
                return step + 1, smoothed
    model.eval()
    return steps, smoothed


def pretrain(model, token_ids: list[int], *, steps: int, batch_size: int, seq_len: int, lr: float,
             seed: int, progress: Progress | None = None, every: int = 50) -> float:
    """Next-token prediction on random windows of a long token stream."""
    data = torch.tensor(token_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)

    def next_batch():
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        windows = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        return windows, windows

    return _train(model, next_batch, steps, lr, progress, every)[1]


def encode_examples(tokenizer, records: list[dict]) -> list[tuple[list[int], int]]:
    """(prompt + answer + eos token ids, prompt length) per record."""
    encoded = []
    for record in records:
        prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(record["answer"], add_special_tokens=False)["input_ids"]
        encoded.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return encoded


def finetune(model, tokenizer, records: list[dict], *, steps: int, batch_size: int, lr: float,
             seed: int, progress: Progress | None = None, every: int = 50, vocab_lr_scale: float = 1.0,
             skill: Callable[[], float] | None = None, target: float | None = None,
             check_every: int = 50) -> SkillResult:
    """Full fine-tuning (every weight) with the loss on the answer and its end-of-sequence token.

    With ``skill`` (the model's dev accuracy in %, measured in eval mode) and
    ``target``, the accuracy is checked every ``check_every`` steps and at the
    last one, and training stops at the first check that reaches ``target``;
    ``steps`` is then a cap (the learning-rate schedule spans the cap, so where it
    stops does not change what came before). ``vocab_lr_scale`` scales the learning
    rate of the embedding and LM head, which in a real LLM barely move during
    fine-tuning (a large vocabulary, most rows unused).
    """
    examples = encode_examples(tokenizer, records)
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id

    def next_batch():
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        # right padding under a causal mask never reaches a real token, so no attention mask is needed
        return input_ids, labels

    result = SkillResult(steps=0, loss=float("nan"), target=target)

    def check(step: int) -> bool:
        result.checks.append((step, skill()))
        return target is not None and result.checks[-1][1] >= target

    done, loss = _train(model, next_batch, steps, lr, progress, every, vocab_lr_scale,
                        check if skill is not None else None, check_every)
    result.steps, result.loss = done, loss
    return result
