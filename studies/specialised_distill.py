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
    lrs = [float(x) for x in args.lrs.split(",")]
    todo = [lr for lr in lrs if not (work / "distill" / f"{slug(label)}-lr{lr:g}-s{args.steps}.json").exists()]
    if not todo:
        return
    records = {k: _records(work, tokenizer, k, 0, CAL_RECORDS) for k in KINDS}
    started = time.time()
    teachers = teacher_logprobs(work, tokenizer, records, bf16=True)  # as the students train: under bf16 autocast
    teacher_s = time.time() - started
    log(f"teachers' log-probabilities in {teacher_s:.0f} s")
    train = [(k, i) for k in KINDS for i in range(CAL_RECORDS)]
    for lr in todo:
        log(f"distill from {label}, lr {lr:g}: {args.steps} steps × {args.batch} records")
        model, seconds, losses = distill_one(work, tokenizer, start, train, records, teachers, lr=lr, steps=args.steps,
                                             batch=args.batch, seed=args.seed, bf16=True, train_embeddings=True,
                                             fused=True)  # as refine: steps timed alike
        out = work / "distill" / f"{slug(label)}-lr{lr:g}-s{args.steps}"
        model.save_pretrained(out)
        del model
        scores = score_model(work, out, args.threads, ("test", "val"))  # val: what chooses the learning rate
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        run = {"name": f"distill from {label}, lr {lr:g}, {args.steps} steps", "start": label, "lr": lr,
               "steps": args.steps, "batch": args.batch, "records_per_expert": CAL_RECORDS, "every_parameter": True,
               "train_s": round(seconds, 1), "teacher_s": round(teacher_s, 1), "first_kl": losses[0],
               "last_kl": sum(losses[-5:]) / len(losses[-5:]), "threads": torch.get_num_threads(), "fused_adamw": True, "scores": scores}
        save_json(out.parent / f"{out.name}.json", run)
        log(f"  lr {lr:g}: {seconds:.0f} s, KL {losses[0]:.4f} → {run['last_kl']:.4f}")
