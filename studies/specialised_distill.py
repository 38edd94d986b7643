"""The specialised setting's gradient reference: the merge distilled toward each record's own expert.

``studies.allgap_distill``'s method (KL(expert ‖ model) per token, AdamW, warm-up + cosine) on every parameter, the
tied embeddings included (as the experts were trained), on the FeatCal rows' calibration records (the first
``CAL_RECORDS`` of each kind's cal split). Each learning rate's model is scored on the val split (files no row
calibrated on and the table does not report); the report picks the rate with the best val share.
"""

from __future__ import annotations

import time

from studies.common import log, save_json
from studies.specialised_setup import CAL_RECORDS, KINDS, score_model, slug


def expert_continuations(work, tokenizer, records: dict[str, list[list[int]]], prefix: int, samples: int, seed: int,
                         batch: int = 16) -> dict[str, list[list[int]]]:
    """Per kind, `samples` continuations of each record's first `prefix` tokens, sampled from the record's own expert
    (temperature 1, the whole vocabulary) to the record's length: text of the kind that no file holds."""
    import torch

    from studies.quality_eval import load

    out = {}
    for kind, rows in records.items():
        model = load(work / "experts" / kind, "cpu")
        torch.manual_seed(seed)
        out[kind] = []
        for _ in range(samples):
            for start in range(0, len(rows), batch):
                chunk = rows[start:start + batch]
                length = min(len(r) for r in chunk)
                ids = torch.tensor([r[:prefix] for r in chunk])
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    made = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                          top_k=0, top_p=1.0, max_new_tokens=length - prefix, min_new_tokens=length - prefix,
                                          pad_token_id=tokenizer.pad_token_id)
                out[kind] += made.tolist()
        del model
    return out


def distill(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from studies.allgap_distill import _records, distill_one, teacher_logprobs

    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.workdir.resolve()
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    start = work / (args.start or "merged/ta")
    label = "merge" if args.start is None else args.start
    extra = args.continuations
    suffix = (f"-cont{extra}x{args.prefix}" if extra else "") + (f"-train{args.train_records}" if args.train_records else "")
    lrs = [float(x) for x in args.lrs.split(",")]
    todo = [lr for lr in lrs if not (work / "distill" / f"{slug(label)}-lr{lr:g}-s{args.steps}{suffix}.json").exists()]
    if not todo:
        return
    records = {k: _records(work, tokenizer, k, 0, CAL_RECORDS) for k in KINDS}
    if args.train_records:  # the experts saw about half of their training file (512 draws of 1,024 records)
        records = {k: records[k] + _records(work, tokenizer, k, 0, args.train_records, split="train") for k in KINDS}
    started = time.time()
    if extra:
        made = expert_continuations(work, tokenizer, records, args.prefix, extra, args.seed)
        records = {k: records[k] + made[k] for k in KINDS}
        log(f"{extra} continuation(s) of each record's first {args.prefix} tokens in {time.time() - started:.0f} s")
    teachers = teacher_logprobs(work, tokenizer, records, bf16=True)  # as the students train: under bf16 autocast
    teacher_s = time.time() - started  # the continuations' sampling included: what the records cost before training
    log(f"teachers' log-probabilities in {teacher_s:.0f} s" + (" (the sampling included)" if extra else ""))
    train = [(k, i) for k in KINDS for i in range(len(records[k]))]
    for lr in todo:
        log(f"distill from {label}, lr {lr:g}: {args.steps} steps × {args.batch} records")
        model, seconds, losses = distill_one(work, tokenizer, start, train, records, teachers, lr=lr, steps=args.steps,
                                             batch=args.batch, seed=args.seed, bf16=True, train_embeddings=True,
                                             fused=True)  # as refine: steps timed alike
        out = work / "distill" / f"{slug(label)}-lr{lr:g}-s{args.steps}{suffix}"
        model.save_pretrained(out)
        del model
        scores = score_model(work, out, args.threads, ("test", "val"))  # val: what chooses the learning rate
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        run = {"name": f"distill from {label}, lr {lr:g}, {args.steps} steps" + (f", {extra} continuations a record" if extra else "")
               + (f", {args.train_records} training records a kind added" if args.train_records else ""),
               "start": label + suffix, "lr": lr, "continuations": extra, "prefix": args.prefix if extra else None,
               "train_records": args.train_records,
               "steps": args.steps, "batch": args.batch, "records_per_expert": len(records[KINDS[0]]), "every_parameter": True,
               "train_s": round(seconds, 1), "teacher_s": round(teacher_s, 1), "first_kl": losses[0],
               "last_kl": sum(losses[-5:]) / len(losses[-5:]), "threads": torch.get_num_threads(), "fused_adamw": True, "scores": scores}
        save_json(out.parent / f"{out.name}.json", run)
        log(f"  lr {lr:g}: {seconds:.0f} s, KL {losses[0]:.4f} → {run['last_kl']:.4f}")
