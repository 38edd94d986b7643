"""Probe on the specialised setting: does matching each expert's hidden states, beside its next-token distribution,
carry refinement further than the KL alone?

Refinement and a distillation given the same care tie (docs/studies/specialised.md): both stop at what 64 records of
next-token distributions teach. An expert's hidden states say more about each record (d numbers per token at every
layer, where the closed form's features come from), so this starts from a kept FeatCal output and trains every
parameter toward each record's own expert, as ``specialised distill --start`` does, on

    KL(expert ‖ model) per token  +  β · mean over layers l of  ‖h_l − h_l^expert‖² / mean ‖h_l^expert‖²

(h_l: the residual stream after decoder layer l, the last one after the final norm; every text token after BOS, whose
state is an outlier in every layer). β = 0 is the control: the same start, records, budget and order. Each model is
scored on test and val like every row of the setting; the report line gives the share of the summed gap with its
paired-bootstrap interval and the ratio to the control.

    featcal-llm run W/recipes/cf-keep.yaml   # the defaults row's recipe with `output: runs/cf-keep`
    python -m studies.feature_refine --workdir W --start runs/cf-keep --betas 0,1,10,50 \
        --json docs/studies/results/specialised-long-feature-refine.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from studies.common import bootstrap_share_ratio, bootstrap_shares, log, save_json
from studies.specialised_report import gap_ends, reference_scores, split_share
from studies.specialised_setup import CAL_RECORDS, KINDS, score_model

if TYPE_CHECKING:
    import torch


def teacher_states(work: Path, tokenizer, records: dict, batch: int = 8) -> dict:
    """Each record's hidden states under its own expert, (layers, tokens, d) float16, the embeddings' output left out."""
    import torch

    from studies.allgap_distill import per_record_outputs

    return per_record_outputs(work, tokenizer, records, batch=batch, bf16=True, hidden_states=True, keep=lambda outputs, i, r: torch.stack(
        [s[i, :len(r)].float() for s in outputs.hidden_states[1:]]).half())


def layer_scales(states: dict) -> "torch.Tensor":
    """Per layer, the experts' mean squared state norm over the text tokens (BOS left out): each layer's term is relative."""
    total, count = None, 0
    for rows in states.values():
        for s in rows:
            sq = s[:, 1:].float().pow(2).sum(-1).sum(-1)
            total = sq if total is None else total + sq
            count += s.shape[1] - 1
    return total / count


def feature_loss(student_states, teacher, lengths, scales) -> "torch.Tensor":
    """Mean over layers and text tokens of the relative squared distance to each record's expert."""
    import torch

    stacked = torch.stack(student_states, 1)  # (batch, layers, width, d)
    total, count = 0.0, 0
    for i, (t, n) in enumerate(zip(teacher, lengths)):
        diff = stacked[i, :, 1:n].float() - t[:, 1:n].float()
        total = total + (diff.pow(2).sum(-1) / scales[:, None]).mean(0).sum()
        count += n - 1
    return total / count


def refine_one(work: Path, start: Path, tokenizer, records, teachers, states, scales, *, beta: float, lr: float,
               steps: int, batch: int, seed: int):
    """``allgap_distill.distill_one`` on every parameter with the feature term added; the trace keeps (KL, feature
    term) per step."""
    from studies.allgap_distill import distill_one

    features = []

    def feature_term(outputs, picked):
        value = feature_loss(outputs.hidden_states[1:], [states[k][i] for k, i in picked],
                             [len(records[k][i]) for k, i in picked], scales)
        features.append(float(value.detach()))
        return beta * value

    train = [(k, i) for k in KINDS for i in range(len(records[k]))]
    model, seconds, losses = distill_one(work, tokenizer, start, train, records, teachers, lr=lr, steps=steps, batch=batch,
                                         seed=seed, bf16=True, train_embeddings=True, fused=True, extra=feature_term)
    return model, seconds, [(loss - beta * feat, feat) for loss, feat in zip(losses, features)]


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from studies.allgap_distill import _records, teacher_logprobs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--start", required=True, help="a kept FeatCal output, relative to the workdir")
    p.add_argument("--betas", default="0,1")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the runs' summary here (a results file)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.workdir.resolve()
    folder = work / "feature-refine"
    folder.mkdir(exist_ok=True)
    base = reference_scores(work)[0]
    name = args.start.replace("/", "-")
    todo = [b for b in (float(x) for x in args.betas.split(","))
            if not (folder / f"{name}-beta{b:g}-lr{args.lr:g}-s{args.steps}.json").exists()]
    if todo:
        tokenizer = AutoTokenizer.from_pretrained(work / "base")
        records = {k: _records(work, tokenizer, k, 0, CAL_RECORDS) for k in KINDS}
        started = time.time()
        teachers = teacher_logprobs(work, tokenizer, records, bf16=True)
        states = teacher_states(work, tokenizer, records)
        scales = layer_scales(states)
        log(f"teachers in {time.time() - started:.0f} s; layer scales {scales[0]:.1f} … {scales[-1]:.1f}")
    for beta in todo:
        path = folder / f"{name}-beta{beta:g}-lr{args.lr:g}-s{args.steps}.json"
        model, seconds, trace = refine_one(work, work / args.start, tokenizer, records, teachers, states, scales, beta=beta,
                                           lr=args.lr, steps=args.steps, batch=args.batch, seed=args.seed)
        out = folder / path.stem
        model.save_pretrained(out)
        del model
        scores = score_model(work, out, args.threads, ("test", "val"))
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        run = {"start": args.start, "beta": beta, "lr": args.lr, "steps": args.steps, "batch": args.batch,
               "records_per_expert": CAL_RECORDS, "train_s": round(seconds, 1), "trace": trace,
               "share_test": split_share(scores, base, "test"), "share_val": split_share(scores, base, "val"),
               "scores": scores}
        save_json(path, run)
        log(f"  β {beta:g}: {seconds:.0f} s; share test {run['share_test']:.3f}, val {run['share_val']:.3f}")
    report(work, folder, args.json)


def report(work: Path, folder: Path, json_path: Path | None = None) -> None:
    """Every run's test share with its interval, and its ratio to the same start's β = 0 run and to the distillation;
    ``json_path``: the same, with each run's per-record test scores, as a results file."""
    import json

    merged, own = gap_ends(reference_scores(work)[0])
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    control = {(r["start"], r["lr"], r["steps"]): r for r in runs if r["beta"] == 0}
    distilled = work / "distill" / "merge-lr0.0001-s80.json"  # the setting's distillation reference, chosen on val
    reference = json.loads(distilled.read_text())["scores"]["test"] if distilled.exists() else None
    summary = []
    for r in runs:
        entry = {k: r[k] for k in ("start", "beta", "lr", "steps", "batch", "records_per_expert", "train_s")}
        entry.update(share=round(r["share_test"], 4), share_ci95=[round(v, 4) for v in bootstrap_shares(merged, own, r["scores"]["test"])["share"]],
                     val_share=round(r["share_val"], 4), kl_first_last=[round(r["trace"][0][0], 4), round(r["trace"][-1][0], 4)],
                     features_first_last=[round(r["trace"][0][1], 4), round(r["trace"][-1][1], 4)])
        ref = control.get((r["start"], r["lr"], r["steps"]))
        if ref is not None and ref is not r:
            entry["ratio_to_beta0_ci95"] = [round(v, 4) for v in bootstrap_share_ratio(merged, own, r["scores"]["test"], ref["scores"]["test"])]
        if reference is not None:
            entry["ratio_to_distillation_ci95"] = [round(v, 4) for v in bootstrap_share_ratio(merged, own, r["scores"]["test"], reference)]
        log(json.dumps({k: v for k, v in entry.items() if k not in ("start", "lr", "batch", "records_per_expert")}))
        summary.append({**entry, "test_records": r["scores"]["test"]})
    if json_path is not None:
        save_json(json_path, {"setting": "specialised-long", "probe": "studies/feature_refine.py", "runs": summary})


if __name__ == "__main__":
    main()
