"""The all-gap setting: every expert beats the merge on its own text; FeatCal's share of that gap, and its ceiling.

    python -m studies.allgap gaps --workdir W [--weights 0.3333,0.5,1.0]
    python -m studies.allgap train --source W --workdir W2 --kinds prose,c --steps 64 --seed 1   # allgap-half's experts
    python -m studies.quality run --gguf G --data D --workdir W --settings allgap --phases allgap,single \\
        --batch-size 4 --bf16 on
    python -m studies.allgap distill --workdir W [--lrs 3e-5,1e-4,3e-4] [--steps 150] [--experts joint]
    python -m studies.allgap report --workdir W [--json docs/studies/results/allgap.json]

``gaps`` merges the narrow experts (mergekit Task Arithmetic) at each weight and scores every merge, the base and the
experts on every domain's held-out text: the weight at which every expert leads the merge by >= 0.05 nats a token on
its own text is the setting (``quality_setup.ALLGAP_WEIGHT``). ``quality`` runs the FeatCal rows through the product
(phase ``allgap``: defaults and the paper's rule; ``single``: toward one expert at a time). ``distill`` is the
gradient-based reference: the merge trained on the experts' calibration records (the FeatCal rows' 64 per expert) to
minimise KL(expert ‖ model) on each record's tokens, each record's teacher being its own expert; ``joint`` serves
every expert at once (the comparison to one FeatCal run), an expert's name serves that expert alone. Its learning rate
is chosen by the KL to the experts on cal records FeatCal does not use (``--val-records`` after the first
``--records``), then scored on the held-out test text like every row; the experts' log-probabilities are computed
once (``--teachers-only``) and memory-mapped, so that runs with different rates can go side by side, each writing
``W/distill/<serve>-lr<lr>.json``. ``report`` writes the tables and the JSON.

Shares are ratios of sums: Σ_domains (merge − model) / Σ_domains (merge − expert), never a mean over the domains
that happen to have a gap; per domain (merge − model) / (merge − expert).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from studies.common import load_json as _load_json
from studies.common import log
from studies.common import save_json as _save_json
from studies.quality_setup import ALLGAP as SETTING
from studies.quality_setup import MIX, expert_dir
from studies.real_data import KINDS, interleave, read_jsonl

MIN_GAP = 0.05  # nats a token: what "the expert beats the merge on its own text" must mean here


def _evaluator(work: Path, tokenizer, test_records: int = 48):
    from studies.quality_eval import workdir_evaluator

    return workdir_evaluator(work, tokenizer, test_records)


# --- gaps: which Task Arithmetic weight gives every expert a lead ---------------------------------------------
def merge_ta(work: Path, weight: float, out: Path) -> float:
    """Task Arithmetic of the three narrow experts at ``weight`` each: base + weight · Σ (expert − base), float32.

    mergekit's task_arithmetic without normalisation, written directly (its CLI looks a bare ``base`` up on the hub,
    offline here); the study's own merge at ``ALLGAP_WEIGHT`` (mergekit through the product) is reused when it matches.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    started = time.time()
    base = load_file(work / "base" / "model.safetensors")
    merged = {name: tensor.clone() for name, tensor in base.items()}
    for kind in KINDS:
        expert = load_file(work / "experts" / kind / "model.safetensors")
        for name, tensor in merged.items():
            tensor += weight * (expert[name] - base[name])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(work / "base", tmp, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(merged, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.replace(out)
    return time.time() - started


def gaps(args) -> None:
    from transformers import AutoTokenizer

    from studies.quality_eval import load, nlls

    work = args.workdir.resolve()
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    evaluator = _evaluator(work, tokenizer)
    path = work / "allgap_gaps.json"
    result = _load_json(path)
    nll, records = result.setdefault("nll", {}), result.setdefault("records", {})

    def score(name: str, directory: Path) -> None:
        records[name] = evaluator.records(load(directory, "cpu"))  # per test record: the report's intervals
        nll[name] = nlls(records[name])
        _save_json(path, result)

    state = _load_json(work / "state.json")  # the study's own scores of the same models, same test text
    for name in ("base", *(f"expert:{k}" for k in KINDS)):
        if name not in nll and name in state.get("nll", {}):
            nll[name] = state["nll"][name]
            if name in state.get("records", {}):
                records[name] = state["records"][name]
    for name, directory in [("base", work / "base"), *((f"expert:{k}", work / "experts" / k) for k in KINDS)]:
        if name not in nll and directory.exists():
            score(name, directory)
            log(f"{name}: {nll[name]}")
    if not all(f"expert:{k}" in nll for k in KINDS):
        log("not every expert exists yet: scored the ones that do")
        return
    for weight in (float(w) for w in args.weights.split(",")):
        name = f"ta {weight:g}"
        if name in nll:
            continue
        study = work / "merged" / f"{args.setting}-ta"
        from studies.quality_setup import SETTINGS

        reuse = weight == SETTINGS[args.setting].merge_weight and (study / "config.json").exists()
        scored = f"{args.setting}:merged"
        if reuse and scored in state.get("nll", {}):
            nll[name] = state["nll"][scored]
            if scored in state.get("records", {}):
                records[name] = state["records"][scored]
            continue
        out = study if reuse else work / "merged" / f"gaps-ta-{weight:g}"
        if not out.exists():
            seconds = merge_ta(work, weight, out)
            log(f"merged TA {weight:g} in {seconds:.0f} s")
        score(name, out)
    table = result["table"] = {}
    for name, scores in nll.items():
        if name.startswith("ta "):
            gap = {k: scores[k] - nll[f"expert:{k}"][k] for k in KINDS}
            table[name] = {"nll": scores, "average": sum(scores.values()) / 3, "gap": gap,
                           "every_expert_leads": all(g >= MIN_GAP for g in gap.values())}
            log(f"{name}: " + " ".join(f"{k} {scores[k]:.4f} (gap {gap[k]:+.4f})" for k in KINDS)
                + f" avg {table[name]['average']:.4f} every gap >= {MIN_GAP}: {table[name]['every_expert_leads']}")
    _save_json(path, result)


# --- train: experts trained further, for the harder setting ----------------------------------------------------
def train(args) -> None:
    """Continue each named expert of --source's workdir for --steps more on its kind's train records, into --workdir.

    The allgap-half experts: ``prose`` and ``c`` are allgap's 32-step experts trained 64 steps more with seed 1
    (``code`` is allgap's 96-step expert, linked); the long variant trains all three of those 192 steps more, seed 3.
    ``mix`` is the broad expert (``experts/broad``, every kind's train records interleaved).
    Each run records its steps, losses and seconds in ``W/training-<kind>.json``.
    """
    from transformers import AutoTokenizer

    from studies.real_models import finetune

    source, work = args.source.resolve(), args.workdir.resolve()
    tokenizer = AutoTokenizer.from_pretrained(source / "base")
    kinds = args.kinds.split(",")
    (work / "experts").mkdir(parents=True, exist_ok=True)
    links = {work / "base": source / "base", work / "data": source / "data",
             **{work / "experts" / k: (source / "experts" / k).resolve() for k in KINDS if k not in kinds}}
    for link, target in links.items():  # the base, the data and the experts not trained further: the source's
        if not link.exists():
            link.symlink_to(target)
    for kind in kinds:
        out = work / expert_dir(kind)
        if out.exists():
            log(f"{out} exists: kept")
            continue
        if kind == MIX:  # the broad expert: every kind's train records interleaved, as studies.quality trains it
            texts = interleave([[r["text"] for r in read_jsonl(source / "data" / k / "train.jsonl")] for k in KINDS])
        else:
            texts = [r["text"] for r in read_jsonl(source / "data" / kind / "train.jsonl")]
        started = time.time()
        start = source / "base" if args.from_base else source / expert_dir(kind)
        info = finetune(start, tokenizer, texts, out, steps=args.steps, batch_size=args.batch, lr=args.lr, seed=args.seed,
                        log=lambda m: None, device="cpu", bf16=args.bf16, train_embeddings=args.train_embeddings)
        info.update(seconds=round(time.time() - started, 1), continued_from=str(start))
        _save_json(work / f"training-{Path(expert_dir(kind)).name}.json", info)
        log(f"{kind}: loss {info['first_loss']:.3f} → {info['last_loss']:.3f} in {info['seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.allgap", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gaps", help="merge at each Task Arithmetic weight and measure every expert's lead")
    g.add_argument("--weights", default="0.333333,0.5,1.0")
    t = sub.add_parser("train", help="continue experts of --source for more steps into --workdir (the harder setting)")
    t.add_argument("--source", type=Path, required=True, help="a workdir with base/, data/ and experts/")
    t.add_argument("--kinds", default="prose,c")
    t.add_argument("--steps", type=int, default=64)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument("--from-base", action="store_true", help="train from --source's base, not from its experts")
    t.add_argument("--train-embeddings", action="store_true",
                   help="train the (tied) embeddings too, as a full fine-tune of every weight does")
    d = sub.add_parser("distill", help="the gradient-based reference")
    d.add_argument("--experts", default="joint", help="joint, or expert kinds (code,prose,c): whom a run serves")
    d.add_argument("--lrs", default="3e-5,1e-4,3e-4")
    d.add_argument("--steps", type=int, default=100)
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--records", type=int, default=64, help="cal records per expert (the FeatCal rows' samples)")
    d.add_argument("--val-records", type=int, default=8, help="cal records after them that choose the learning rate")
    d.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=None)
    d.add_argument("--quick", action="store_true", help="smoke test: 4 records, 2 steps, 2 test records")
    d.add_argument("--start", type=Path, default=None,
                   help="start from this checkpoint (relative to --workdir, e.g. a FeatCal output) instead of the merge: "
                        "the refinement of a calibrated merge")
    d.add_argument("--start-label", default="featcal defaults", help="what --start is, in the run's name")
    d.add_argument("--teachers-only", action="store_true", help="write the teachers' cache and the merge's scores, then stop")
    r = sub.add_parser("report", help="tables and the JSON")
    r.add_argument("--json", type=Path, default=Path("docs/studies/results/allgap.json"))
    r.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    r.add_argument("--conditions", default=None, help="the machine the wall times were measured on, in words")
    r.add_argument("--variant", default=None, help="what sets this workdir's experts apart from the setting's first run, in words")
    r.add_argument("--extra-workdirs", type=Path, nargs="*", default=[],
                   help="workdirs that ran other rows side by side (experts and merge linked to --workdir's)")
    for q in (g, t, d, r):
        q.add_argument("--workdir", type=Path, required=True)
    for q in (g, d, r):  # train reads no setting: it only writes experts
        q.add_argument("--setting", default=SETTING, help="allgap (Task Arithmetic 1.0) or allgap-half (½, longer-trained experts)")
    args = p.parse_args(argv)
    if args.command == "gaps":
        gaps(args)
    elif args.command == "train":
        train(args)
    elif args.command == "distill":
        from studies.allgap_distill import distill

        distill(args)
    else:
        from studies.allgap_report import report

        report(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
