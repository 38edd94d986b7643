"""The specialised setting: experts that each lead the merge by >= 0.15 nats a token on their own text.

    python -m studies.specialised prepare --gguf G --workdir W          # base, and the split text of three kinds
    python -m studies.specialised train --workdir W [--steps 160 --lr 1e-3 --batch 8]
    python -m studies.specialised row --workdir W --row "featcal defaults"     # through `featcal-llm run`
    python -m studies.specialised score --workdir W --model merged           # per-record held-out NLLs
    python -m studies.specialised distill --workdir W --lrs 1e-4,3e-4 --steps 80
    python -m studies.specialised report --workdir W --json docs/studies/results/specialised.json

Three kinds of text that share little (``studies.specialised_data``: roff manual pages, Debian changelogs, Debian
copyright files), split by file into test / val / cal / train. Experts are fine-tuned from SmolLM2-135M-Instruct on
every parameter (the tied embeddings and head included), merged by mergekit Task Arithmetic at ½ each. Every model
is scored record by record on the test split (per-record NLL sums and token counts kept, so that the bootstrap can
be recomputed) and on the val split, which alone chooses hyper-parameters (the distillation's learning rate).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from studies.common import log, save_json
from studies.real_data import read_jsonl, write_jsonl
from studies.specialised_data import KINDS
from studies.specialised_setup import AS_TRAINED, RECORD_TOKENS, ROWS, SIZES, recipe_text, score_model, slug

# --- prepare -------------------------------------------------------------------------------------------------
def prepare(args) -> None:
    from transformers import AutoTokenizer

    from studies.real_models import build_base_from_gguf
    from studies.specialised_data import documents, split_documents

    work = args.workdir.resolve()
    if not (work / "base" / "config.json").exists():
        log(f"dequantising {args.gguf} into {work / 'base'}")
        build_base_from_gguf(args.gguf.resolve(), work / "base")
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    meta = {"record_tokens": RECORD_TOKENS, "sizes": SIZES, "seed": args.seed, "kinds": {}}
    for kind in KINDS:
        docs = documents(kind)
        splits = split_documents(docs, tokenizer, SIZES, RECORD_TOKENS, args.seed)
        for split, records in splits.items():
            write_jsonl(records, work / "data" / kind / f"{split}.jsonl")
        # the records as the experts are trained and scored: BOS first (this tokenizer adds none of its own)
        write_jsonl([{**r, "text": tokenizer.bos_token + r["text"]} for r in splits["cal"]],
                    work / "data" / kind / f"cal{AS_TRAINED}.jsonl")
        meta["kinds"][kind] = {"documents": len(docs), **{s: len({r["source"] for r in splits[s]}) for s in splits}}
        log(f"{kind}: {len(docs)} documents; " + ", ".join(f"{s} {len(r)} records from {meta['kinds'][kind][s]} files"
                                                          for s, r in splits.items()))
    save_json(work / "data" / "meta.json", meta)


# --- train ---------------------------------------------------------------------------------------------------
def train(args) -> None:
    from transformers import AutoTokenizer

    from studies.real_models import finetune

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = args.workdir.resolve()
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    for kind in args.kinds.split(","):
        out = work / "experts" / kind
        if out.exists():
            log(f"{out} exists: kept")
            continue
        texts = [r["text"] for r in read_jsonl(work / "data" / kind / "train.jsonl")]
        started = time.time()
        info = finetune(work / "base", tokenizer, texts, out, steps=args.steps, batch_size=args.batch, lr=args.lr,
                        seed=args.seed, log=log, device="cpu", bf16=args.bf16, train_embeddings=True)
        info.update(seconds=round(time.time() - started, 1), records=len(texts))
        save_json(work / f"training-{kind}.json", info)
        log(f"{kind}: loss {info['first_loss']:.3f} → {info['last_loss']:.3f} in {info['seconds']:.0f} s")


# --- rows: FeatCal through the product's own CLI --------------------------------------------------------------
def run_row(args) -> None:
    """One row: its recipe through `featcal-llm run` (log kept), timed, scored record by record, its card read."""
    work = args.workdir.resolve()
    name = args.row
    if name not in ROWS:
        sys.exit(f"--row {name!r}: expected one of {', '.join(ROWS)}")
    path = work / "rows" / f"{slug(name)}.json"
    if path.exists():
        log(f"{path} exists: kept")
        return
    output = f"runs/{slug(name)}"
    recipe = work / "recipes" / f"{slug(name)}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    logfile = work / "logs" / f"{slug(name)}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    if args.adopt:  # the run finished without this wrapper (killed meanwhile): its wall time from the files' times
        written = max(p.stat().st_mtime for p in (work / output).iterdir())
        seconds, merging = written - recipe.stat().st_mtime, "merged in" in logfile.read_text()
        log(f"{name}: adopting {output} ({seconds:.0f} s from its recipe's write to its last file)")
    else:
        recipe.write_text(recipe_text(ROWS[name], output, experts=tuple(args.experts.split(","))))
        merging = not (work / "merged" / "ta" / "config.json").exists()
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        command = [sys.executable, "-m", "featcal_llm", "run", str(recipe.relative_to(work)), "--force"]
        log(f"{name}: {' '.join(command[2:])}" + (" (merging first)" if merging else "") + f"; log {logfile}")
        started = time.time()
        with open(logfile, "w") as out:
            done = subprocess.run(command, cwd=work, stdout=out, stderr=subprocess.STDOUT, env=env)
        seconds = time.time() - started
        if done.returncode != 0:
            sys.exit(f"{name}: featcal-llm run exited {done.returncode}; see {logfile}")
    from studies.provenance import run_record

    record = {"name": name, "seconds": round(seconds, 1), "merged_first": merging, "recipe": str(recipe.relative_to(work)),
              **run_record(work / output, logfile)}
    record["scores"] = score_model(work, work / output, args.threads, ("test", "val"))  # val: what chooses a default
    save_json(path, record)
    if not args.keep:
        import shutil

        shutil.rmtree(work / output, ignore_errors=True)
    log(f"{name}: {seconds:.0f} s; " + _nll_line(record["scores"]))


# --- scoring: per-record held-out NLL ---------------------------------------------------------------------------
def _nll_line(scores: dict) -> str:
    from studies.common import mean_nll

    return "test NLL " + " ".join(f"{k} {mean_nll(v):.4f}" for k, v in scores["test"].items())


def score(args) -> None:
    """The base, the experts and the merge: per-record NLLs in W/scores/<name>.json."""
    work = args.workdir.resolve()
    models = {"base": work / "base", "merged": work / "merged" / "ta",
              **{f"expert:{k}": work / "experts" / k for k in args.experts.split(",")}}
    for name in (args.models.split(",") if args.models else models):
        path = work / "scores" / f"{slug(name)}.json"
        if path.exists() or not (models[name] / "config.json").exists():
            continue
        started = time.time()
        scores = score_model(work, models[name], args.threads, ("test", "val") if name != "base" else ("test",))
        save_json(path, {"name": name, "seconds": round(time.time() - started, 1), "scores": scores})
        log(f"{name}: " + _nll_line(scores))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.specialised", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="the float32 base and the split text")
    prep.add_argument("--gguf", type=Path, required=True)
    prep.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="fine-tune every expert on every parameter")
    t.add_argument("--kinds", default=",".join(KINDS))
    t.add_argument("--steps", type=int, default=160)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument("--threads", type=int, default=None, help="torch threads (one expert per process side by side)")
    r = sub.add_parser("row", help="one FeatCal row through featcal-llm run, scored")
    r.add_argument("--row", required=True, help=f"one of: {'; '.join(ROWS)}")
    r.add_argument("--keep", action="store_true", help="keep the calibrated checkpoint")
    r.add_argument("--adopt", action="store_true",
                   help="record and score an output its run already wrote (the wrapper was stopped, the run was not)")
    s = sub.add_parser("score", help="per-record held-out NLLs of the base, the experts and the merge")
    s.add_argument("--models", default=None, help="base, merged, expert:<kind> (comma-separated; default all)")
    d = sub.add_parser("distill", help="the gradient reference: KL(expert ‖ model) per token, every parameter")
    d.add_argument("--lrs", default="1e-4,3e-4")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--start", default=None, help="a row's kept output (runs/<slug>) to refine instead of the merge")
    d.add_argument("--continuations", type=int, default=0,
                   help="per calibration record, this many continuations its expert samples from the record's first "
                        "--prefix tokens, added to the records (a probe: does more text like the records lift the ceiling?)")
    d.add_argument("--prefix", type=int, default=32)
    d.add_argument("--train-records", type=int, default=0,
                   help="per kind, this many records of its expert's training file added to the records (a probe of "
                        "the ceiling: how near one model comes to the three experts with real text of each kind to spare)")
    mix = sub.add_parser("mix", help="per expert, its real calibration records followed by those it wrote (data-free rows)")
    rep = sub.add_parser("report", help="the results file")
    rep.add_argument("--json", type=Path, default=Path("docs/studies/results/specialised.json"))
    rep.add_argument("--conditions", default=None)
    rep.add_argument("--name", default="specialised", help="the setting's name in the results file (specialised-long: the longer-trained experts)")
    rep.add_argument("--resamples", type=int, default=1000)
    for q in (r, s, d):
        q.add_argument("--threads", type=int, default=None)
    for q in (r, s):
        q.add_argument("--experts", default=",".join(KINDS), help="the merged experts (experts/<name>, data/<name>); "
                       "the broad setting: broad,manpage,changelog")
    for q in (prep, t, r, s, d, rep, mix):
        q.add_argument("--workdir", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "distill":
        from studies.specialised_distill import distill

        distill(args)
    elif args.command == "mix":
        from studies.specialised_setup import write_mixed

        log(f"real and generated records per expert: {write_mixed(args.workdir)}")
    elif args.command == "report":
        from studies.specialised_report import report

        report(args)
    else:
        {"prepare": prepare, "train": train, "row": run_row, "score": score}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
