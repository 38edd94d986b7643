"""Real-model study: does `generate: {}` (nothing else) calibrate as well as real text, for raw-text and chat-tuned experts?

``python -m studies.data_free_start --workdir W --gguf FILE [--device cuda]`` (each phase skipped when its output
exists):

1. ``base`` from the GGUF file; ``data/<kind>/{train,cal,test}.jsonl`` as in ``studies.real_text`` (made beforehand
   with ``--prepare-only --prose-dir DIR`` where the prose sources are installed);
2. two families of three experts fine-tuned from the base: ``raw/<kind>`` on the records as raw text (domain
   adaptation), ``chat/<kind>`` on the records as the answer to a request through the tokenizer's chat template
   (instruction tuning; the loss on the answer only);
3. per family, one Task Arithmetic merge and a FeatCal run per calibration setting: ``real`` (the cal split, as the
   expert saw its text), ``auto`` (``generate: {}``: the start measured per expert), ``bos``
   (``chat_template: off``), ``chat`` (``chat_template: on``: the shipped seed prompts), ``auto_x4`` (``generate:
   {samples: 4 × cal}``);
4. held-out NLL of every model on its family's test texts and the share of the merge→expert gap each setting
   recovered, the start each expert chose, and generation and choice times, to ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from studies import real_data as rd

FAMILIES = ("raw", "chat")
SETTINGS = ("real", "auto", "bos", "chat", "auto_x4")
GENERATE = {"auto": "{}", "bos": "{chat_template: \"off\"}", "chat": "{chat_template: \"on\"}"}


def request(kind: str) -> str:
    return f"Write a passage of {dict(c='C source code', code='Python code', prose='technical prose').get(kind, kind)}."


def as_family(family: str, tokenizer, text: str, kind: str) -> tuple[list[int], int]:
    """(token ids, index of the first scored token): raw text after BOS, or a chat answer after its request."""
    if family == "raw":
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [bos, *tokenizer.encode(text, add_special_tokens=False)], 1
    messages = [{"role": "user", "content": request(kind)}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    answer = tokenizer.encode(text, add_special_tokens=False)
    return [*prompt, *answer, tokenizer.eos_token_id], len(prompt)


def _batch(rows: list[tuple[list[int], int]], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (sequence, first) in enumerate(rows):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
        labels[row, first : len(sequence)] = torch.tensor(sequence[first:])
    return ids.to(device), mask.to(device), labels.to(device)


def finetune(base: Path, tokenizer, rows: list, out: Path, steps: int, batch_size: int, lr: float, seed: int, device: str) -> dict:
    """Full fine-tune (tied embeddings frozen), AdamW, warmup then cosine, as ``studies.real_models.finetune``."""
    import math
    import random

    from transformers import AutoModelForCausalLM

    from featcal_llm.demo.models import save_atomically

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    model.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, order, losses, warmup = random.Random(seed), [], [], max(1, steps // 10)
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(rows)))
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:batch_size], order[batch_size:]
        ids, mask, labels = _batch([rows[i] for i in picked], device)
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval().to("cpu")
    save_atomically(model, tokenizer, out)
    return {"steps": steps, "first_loss": losses[0], "last_loss": losses[-1]}


@torch.no_grad()
def mean_nll(path: Path, rows: list, device: str) -> float:
    """Token-weighted NLL (nats) of the scored tokens (the text; for chat, the answer and its end token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), 16):
        ids, mask, labels = _batch(rows[start : start + 16], device)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum").item()
        count += int((labels[:, 1:] != -100).sum())
    return total / count


def recipe_text(family: str, setting: str, args) -> str:
    lines = [f"# studies.data_free_start: {family} experts, setting {setting}", "merge_method: task_arithmetic",
             "base_model: base", "models:"]
    for kind in rd.KINDS:
        lines += [f"  - model: {family}/{kind}", f"    parameters: {{weight: {round(1 / 3, 6)}}}"]
    lines += ["dtype: float32", "featcal:", f"  merged: merged_{family}", f"  output: runs/{family}_{setting}/featcal", "  data:"]
    for kind in rd.KINDS:
        if setting == "real":
            spec = f"{{path: {family}_cal/{kind}.jsonl, format: text}}"
        elif setting == "auto_x4":
            spec = f"{{generate: {{samples: {4 * args.cal_records}}}}}"
        else:
            spec = f"{{generate: {GENERATE[setting]}}}"
        lines.append(f"    {family}/{kind}: {spec}")
    lines += [f"  samples: {args.cal_records}", f"  max_length: {args.max_length}", f"  lambda: {args.lam}",
              f"  alpha: {args.alpha}", f"  rho: {args.rho}", f"  device: {args.device}", ""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.data_free_start", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--gguf", type=Path)
    p.add_argument("--prose-dir", type=Path)
    p.add_argument("--prepare-only", action="store_true", help="build base and data, then stop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--record-tokens", type=int, default=128)
    p.add_argument("--train-records", type=int, default=768)
    p.add_argument("--cal-records", type=int, default=64)
    p.add_argument("--test-records", type=int, default=48)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--lambda", dest="lam", type=float, default=1e-3)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--rho", type=float, default=1.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformers import AutoTokenizer

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"nll": {}, "training": {}, "runs": {}}

    def save() -> None:
        results_path.write_text(json.dumps(results, indent=1) + "\n")

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    if not (work / "base").exists():
        from studies.real_models import build_base_from_gguf

        build_base_from_gguf(args.gguf.resolve(), work / "base")
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    if not all((work / "data" / k / "test.jsonl").exists() for k in rd.KINDS):
        from studies.real_text import _data

        args.seed, args.prompt_tokens, args.train_per_document = 0, 32, 16
        _data(work, tokenizer, args, log)
    if args.prepare_only:
        return 0
    texts = {k: {s: [r["text"] for r in rd.read_jsonl(work / "data" / k / f"{s}.jsonl")] for s in ("train", "cal", "test")} for k in rd.KINDS}
    families = [f for f in args.families.split(",") if f]
    for family in families:
        tests = {k: [as_family(family, tokenizer, t, k) for t in texts[k]["test"]] for k in rd.KINDS}
        for kind in rd.KINDS:
            out = work / family / kind
            if not out.exists():
                started = time.time()
                rows = [as_family(family, tokenizer, t, kind) for t in texts[kind]["train"]]
                results["training"][f"{family}/{kind}"] = finetune(work / "base", tokenizer, rows, out, args.steps, args.batch_size, args.lr, 0, args.device) | {"seconds": time.time() - started}
                log(f"fine-tuned {family}/{kind}: {results['training'][f'{family}/{kind}']}")
            cal = work / f"{family}_cal" / f"{kind}.jsonl"
            if not cal.exists():  # the real calibration text, as the expert saw it
                rows = [as_family(family, tokenizer, t, kind)[0] for t in texts[kind]["cal"]]
                rd.write_jsonl([{"text": tokenizer.decode(ids[1:] if family == "raw" else ids)} for ids in rows], cal)
        def score(model: str, path: Path) -> None:
            row = results["nll"].setdefault(family, {}).setdefault(model, {})
            for kind in ([model.split(":")[1]] if model.startswith("expert:") else rd.KINDS):
                if kind not in row and path.exists():
                    row[kind] = mean_nll(path, tests[kind], args.device)
            save()

        for kind in rd.KINDS:
            score(f"expert:{kind}", work / family / kind)
        for setting in [s for s in args.settings.split(",") if s]:
            name = f"{family}_{setting}"
            recipe = work / f"recipe_{name}.yaml"
            recipe.write_text(recipe_text(family, setting, args))
            folder = work / "runs" / name
            if not (folder / "featcal").exists():
                folder.mkdir(parents=True, exist_ok=True)
                started = time.time()
                with open(folder / "run.log", "w") as handle:
                    done = subprocess.run([sys.executable, "-m", "featcal_llm", "run", recipe.name, "--force"], cwd=work,
                                          stdout=handle, stderr=subprocess.STDOUT, env={**os.environ})
                if done.returncode != 0:
                    log(f"{name}: featcal-llm run failed; see {folder / 'run.log'}")
                    continue
                generated = folder / "featcal_generated"
                records = {p.name: json.loads(p.read_text()) for p in generated.glob("*.json")} if generated.exists() else {}
                results["runs"][name] = {"seconds": time.time() - started, "generated": {
                    n: {k: r.get(k) for k in ("start", "start_mode", "start_choice", "kept", "generated_tokens", "seconds", "tokens_per_second")}
                    for n, r in records.items() if not n.endswith(".start.json")},
                    "warnings": [line for line in (folder / "run.log").read_text().splitlines() if "warning" in line],
                    "choices": [line for line in (folder / "run.log").read_text().splitlines() if ": chose " in line]}
                save()
                log(f"{name}: done in {results['runs'][name]['seconds']:.0f} s")
            score("merged", work / f"merged_{family}")
            score(f"featcal:{setting}", folder / "featcal")
            (work / "results.md").write_text(report(results))
    (work / "results.md").write_text(report(results))
    print(report(results))
    return 0


def report(results: dict) -> str:
    """The share of the merge→expert gap each setting recovered, per family and kind, and the starts chosen."""
    lines = []
    for family, nll in results["nll"].items():
        lines += [f"## {family} experts: share of the merge→expert NLL gap recovered", "",
                  "| setting | " + " | ".join(rd.KINDS) + " | mean |", "|---|" + "---|" * (len(rd.KINDS) + 1)]
        for model in [m for m in nll if m.startswith("featcal:")]:
            known = [k for k in rd.KINDS if k in nll.get(f"expert:{k}", {}) and k in nll.get("merged", {}) and k in nll[model]]
            shares = [rd.gap_recovered(nll[f"expert:{k}"][k], nll["merged"][k], nll[model][k]) if k in known else None for k in rd.KINDS]
            valid = [s for s in shares if s is not None]
            cells = [("–" if s is None else f"{s:.2f}") for s in shares]
            lines.append(f"| {model.split(':')[1]} | " + " | ".join(cells) + f" | {sum(valid) / len(valid):.2f} |" if valid else "")
        lines.append("")
        for name, run in results["runs"].items():
            if not name.startswith(family + "_"):
                continue
            for expert, record in run["generated"].items():
                choice = record.get("start_choice")
                scores = {m: round(v["score"], 3) for m, v in choice["scores"].items()} if choice else None
                lines.append(f"- {name} {expert}: {record['start']} ({record['kept']} samples, {record['seconds']:.1f} s"
                             + (f"; chosen with scores {scores} in {choice['seconds']:.1f} s" if choice else "") + ")")
            for warning in run.get("warnings", []):
                lines.append(f"- {name}: {warning}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
