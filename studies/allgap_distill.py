"""The all-gap study's gradient-based reference: the merge distilled toward the experts on their calibration records.

``python -m studies.allgap distill`` (studies.allgap's CLI) runs it: KL(expert ‖ model) on each record's tokens, each
record's teacher being its own expert, the learning rate chosen on held-out cal records; ``--start`` refines a FeatCal
output instead of the merge. Each run writes ``W/distill/<serve>-lr<lr>.json``.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from studies.common import log
from studies.common import save_json as _save_json
from studies.quality_eval import workdir_evaluator as _evaluator
from studies.real_data import KINDS, read_jsonl


def _records(work: Path, tokenizer, kind: str, start: int, count: int, split: str = "cal") -> list[list[int]]:
    """BOS + tokens of the kind's `split` records [start, start + count) (the product's `samples` takes the first cal ones)."""
    from studies.real_models import encode

    texts = [r["text"] for r in read_jsonl(work / "data" / kind / f"{split}.jsonl")][start:start + count]
    return encode(tokenizer, texts)


def _pad(rows: list[list[int]], pad: int):
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def per_record_outputs(work: Path, tokenizer, records: dict[str, list[list[int]]], keep, *, batch: int = 8,
                       bf16: bool = False, hidden_states: bool = False) -> dict:
    """Each record's ``keep(outputs, row, record)`` under its own expert (one expert loaded at a time)."""
    import torch

    from studies.quality_eval import load

    out = {}
    with torch.no_grad():
        for kind, rows in records.items():
            model = load(work / "experts" / kind, "cpu")
            out[kind] = []
            for start in range(0, len(rows), batch):
                chunk = rows[start:start + batch]
                ids, mask = _pad(chunk, tokenizer.pad_token_id)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    outputs = model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden_states)
                out[kind] += [keep(outputs, i, r) for i, r in enumerate(chunk)]
            del model
    return out


def teacher_logprobs(work: Path, tokenizer, records: dict[str, list[list[int]]], batch: int = 8, bf16: bool = False) -> dict:
    """Each record's next-token log-probabilities under its own expert (float16, positions 0 .. len-2)."""
    import torch

    return per_record_outputs(work, tokenizer, records, batch=batch, bf16=bf16, keep=lambda outputs, i, r: torch.log_softmax(
        outputs.logits[i, :len(r) - 1].float(), -1).half())


def _kl(student_logits, teacher_logp, lengths) -> tuple:
    """Sum over tokens of KL(teacher ‖ student) and the token count (rows right-padded)."""
    import torch

    total, count = 0.0, 0
    logp = torch.log_softmax(student_logits.float(), -1)
    for i, (t, n) in enumerate(zip(teacher_logp, lengths)):
        t = t.float()
        total = total + (t.exp() * (t - logp[i, :n - 1])).sum()
        count += n - 1
    return total, count


def val_kl(model, tokenizer, records: dict, teachers: dict, batch: int = 8) -> dict[str, float]:
    import torch

    model.eval()
    out = {}
    with torch.no_grad():
        for kind, rows in records.items():
            total, count = 0.0, 0
            for start in range(0, len(rows), batch):
                chunk = rows[start:start + batch]
                ids, mask = _pad(chunk, tokenizer.pad_token_id)
                kl, n = _kl(model(input_ids=ids, attention_mask=mask).logits, teachers[kind][start:start + batch],
                            [len(r) for r in chunk])
                total, count = total + float(kl), count + n
            out[kind] = total / count
    return out


def distill_one(work: Path, tokenizer, start: Path, train: list[tuple[str, int]], records: dict, teachers: dict,
                *, lr: float, steps: int, batch: int, seed: int, bf16: bool, train_embeddings: bool = False, fused: bool = False,
                extra=None):
    """`start` (the merge, or a calibrated merge to refine) trained on (kind, index) records toward each record's expert.

    Returns the model, its wall time and the per-step losses.

    Full fine-tuning of the layers and final norm (tied embeddings frozen, as the all-gap experts were trained, unless
    ``train_embeddings``: every parameter, as the specialised setting's experts were), AdamW,
    warmup + cosine (``real_models._lr``), token-mean KL(expert ‖ model) per batch. ``fused``: PyTorch's one-kernel
    AdamW, as `refine:` uses (the same update; on a CPU several times faster per step than the per-tensor loop).
    ``extra(outputs, picked)``: a term added to each step's loss (the model's outputs with their hidden states; the
    batch's (kind, index) records), as ``studies.feature_refine`` adds the distance to the experts' hidden states.
    """
    import torch

    from studies.quality_eval import load
    from studies.real_models import _lr

    torch.manual_seed(seed)
    started = time.time()
    model = load(start, "cpu").train()
    model.get_input_embeddings().weight.requires_grad_(train_embeddings)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused or None)
    rng, order, losses = random.Random(seed), [], []
    for step in range(steps):
        if len(order) < batch:
            epoch = list(train)
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:batch], order[batch:]
        rows = [records[k][i] for k, i in picked]
        ids, mask = _pad(rows, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, steps, lr, max(1, steps // 10))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outputs = model(input_ids=ids, attention_mask=mask, output_hidden_states=extra is not None)
        kl, count = _kl(outputs.logits, [teachers[k][i] for k, i in picked], [len(r) for r in rows])
        loss = kl / count if extra is None else kl / count + extra(outputs, picked)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 25 == 0:
            log(f"    step {step + 1}/{steps} KL {sum(losses[-25:]) / 25:.4f}")
    model.eval()
    return model, time.time() - started, losses


def _teachers(work: Path, tokenizer, records: dict, val: dict, quick: bool) -> tuple[dict, dict, float]:
    """The experts' log-probabilities on the train and val records, computed once and memory-mapped by every run."""
    import torch

    path = work / "distill" / ("teachers-quick.pt" if quick else "teachers.pt")
    if not path.exists():
        started = time.time()
        payload = {"train": teacher_logprobs(work, tokenizer, records), "val": teacher_logprobs(work, tokenizer, val),
                   "seconds": time.time() - started}
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        log(f"teacher log-probabilities in {payload['seconds']:.0f} s → {path}")
    payload = torch.load(path, mmap=True)
    return payload["train"], payload["val"], payload["seconds"]


def distill(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from studies.quality_eval import load, nlls

    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.workdir.resolve()
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    merged = work / "merged" / f"{args.setting}-ta"
    if not merged.exists():
        sys.exit(f"{merged}: run the allgap phase of studies.quality first (it writes the merge)")
    evaluator = _evaluator(work, tokenizer, 2 if args.quick else 48)
    folder = work / ("distill-quick" if args.quick else "distill")
    folder.mkdir(parents=True, exist_ok=True)
    n, nv = (4, 2) if args.quick else (args.records, args.val_records)
    records = {k: _records(work, tokenizer, k, 0, n) for k in KINDS}
    val = {k: _records(work, tokenizer, k, n, nv) for k in KINDS}
    teachers, val_teachers, teacher_s = _teachers(work, tokenizer, records, val, args.quick)
    if not (folder / "merged.json").exists():
        model = load(merged, "cpu")
        _save_json(folder / "merged.json", {"val_kl": val_kl(model, tokenizer, val, val_teachers),
                                            "teacher_s": round(teacher_s, 1)})  # its NLL: the study's allgap:merged
    if args.teachers_only:
        return
    steps = 2 if args.quick else args.steps
    start = merged if args.start is None else (work / args.start).resolve()
    suffix = "" if args.start is None else f" from {args.start_label}"
    for serve in args.experts.split(","):
        kinds = KINDS if serve == "joint" else (serve,)
        train = [(k, i) for k in kinds for i in range(n)]
        for lr in (float(x) for x in args.lrs.split(",")):
            name = f"{serve} lr {lr:g}{suffix}"
            path = folder / f"{serve}-lr{lr:g}{suffix.replace(' ', '-')}.json"
            if path.exists():
                continue
            log(f"distill {name}: {steps} steps × {args.batch} records of {', '.join(kinds)}")
            model, seconds, losses = distill_one(work, tokenizer, start, train, records, teachers, lr=lr,
                                                 steps=steps, batch=args.batch, seed=args.seed, bf16=args.bf16)
            run = {"name": name, "serve": serve, "start": args.start_label if args.start else None, "lr": lr, "steps": steps,
                   "batch": args.batch, "records": n,
                   "bf16": args.bf16, "threads": torch.get_num_threads(), "train_s": round(seconds, 1),
                   "first_kl": losses[0], "last_kl": sum(losses[-10:]) / len(losses[-10:]),
                   "val_kl": val_kl(model, tokenizer, val, val_teachers), "test_records": evaluator.records(model)}
            run["nll"] = nlls(run["test_records"])
            log(f"  {name}: {seconds:.0f} s; val KL " + " ".join(f"{k} {v:.4f}" for k, v in run["val_kl"].items())
                + "; NLL " + " ".join(f"{k} {v:.4f}" for k, v in run["nll"].items()))
            del model
            _save_json(path, run)
