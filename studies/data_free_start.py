"""Real-model study: does `generate: {}` (nothing else) calibrate as well as real text, for raw-text and chat-tuned experts?

``python -m studies.data_free_start --workdir W --gguf FILE --data D [--device cuda] [--budget-s S] [--results-dir R]``
(each phase skipped when its output exists):

1. ``base`` from the GGUF file; ``data/<kind>/{train,cal,test}.jsonl`` for code, prose and c: with ``--data D`` the
   folder ``studies.quality prepare`` wrote (linked as ``W/data``), otherwise built as in ``studies.real_text``
   (beforehand, with ``--prepare-only --prose-dir DIR`` where the prose sources are installed);
2. two families of three experts fine-tuned from the base: ``raw/<kind>`` on the records as raw text after BOS
   (domain adaptation), ``chat/<kind>`` on the records as the answer to a request through the tokenizer's chat
   template (instruction tuning; the loss on the answer only);
3. per family, one Task Arithmetic merge and a FeatCal run per calibration setting, through the product's CLI:
   ``real`` (the cal split, as the expert saw its text), ``auto`` (``generate: {}``: the start measured per expert),
   ``bos`` (``chat_template: off``), ``chat`` (``chat_template: on``: the shipped seed prompts), ``auto_x4``
   (``generate: {samples: 4 × cal}``), ``temp1`` (``generate: {temperature: 1}``: the expert's own distribution),
   ``top_p90`` (``generate: {temperature: 1, top_p: 0.9}``), ``min_p10`` (``generate: {temperature: 1, min_p: 0.1}``),
   ``picked`` (each expert's ``chat_template`` from ``--picked``, e.g. the one start each would get without mixing),
   ``real_x4`` (4 × cal real records, against ``auto_x4``).
   FeatCal's lambda/alpha/rho are the product's defaults unless given. The
   settings run setting by setting across both families (``real`` and ``auto`` first), so that a ``--budget-s`` cut
   leaves the main comparison complete. Where ``auto`` chose the same start for every expert of a family, the forced
   setting with that start would draw the very same samples (same seed and settings): it is not run again but
   reported as ``auto``'s, and ``auto_x4`` reuses ``auto``'s start measurement (``--no-reuse``: run and measure both);
4. held-out NLL of every model on its family's test texts and the share of the merge→expert gap each setting
   recovered, the start each expert chose, and generation and choice times, to ``results.json`` and ``results.md``
   (copied to ``--results-dir`` after every setting).

``--quick`` is a smoke test of the whole path (numbers mean nothing): 1 fine-tuning step on 2 short records per
expert, 4 short calibration records or samples (``max_length`` 64, 16 new tokens), 2 short test records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from studies import real_data as rd
from studies.data_free_start_report import report
from studies.real_models import rows_nll, train_rows

FAMILIES = ("raw", "chat")
SETTINGS = ("real", "auto", "bos", "chat", "auto_x4", "temp1", "top_p90", "min_p10", "picked", "real_x4")  # in priority order: a budget cut drops the last
GENERATE = {"auto": {}, "bos": {"chat_template": '"off"'}, "chat": {"chat_template": '"on"'},
            "temp1": {"temperature": 1.0}, "top_p90": {"temperature": 1.0, "top_p": 0.9},
            "min_p10": {"temperature": 1.0, "min_p": 0.1}}
QUICK = {"steps": 1, "train_records": 2, "cal_records": 4, "test_records": 2, "chars": 120, "max_length": 64,
         "max_new_tokens": 16}


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


def load(path: Path, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


@torch.no_grad()
def mean_nll(path: Path, rows: list, device: str, model=None) -> float:
    """Token-weighted NLL (nats) of the scored tokens (the text; for chat, the answer and its end token)."""
    return rows_nll(load(path, device) if model is None else model, rows, 0, 16, device)


def generate_spec(setting: str, args, kind: str = "") -> str:
    """The `generate:` mapping of a setting: exactly `{}` for auto unless --max-new-tokens (or --quick) sets the length."""
    spec = dict(GENERATE.get(setting, {}))
    if setting == "picked":
        picked = dict(item.split("=") for item in args.picked.split(",") if item)
        if picked.get(kind) not in ("on", "off", "empty"):
            sys.exit(f"--picked: give {kind}=on, {kind}=off or {kind}=empty (the chat_template each expert is forced to)")
        spec["chat_template"] = f'"{picked[kind]}"'
    if setting == "auto_x4":
        spec["samples"] = 4 * args.cal_records
    elif args.quick:
        spec["samples"] = args.cal_records
    if args.max_new_tokens is not None:
        spec["max_new_tokens"] = args.max_new_tokens
    return "{" + ", ".join(f"{k}: {v}" for k, v in spec.items()) + "}"


def recipe_text(family: str, setting: str, args) -> str:
    lines = [f"# studies.data_free_start: {family} experts, setting {setting}", "merge_method: task_arithmetic",
             "base_model: base", "models:"]
    for kind in rd.KINDS:
        lines += [f"  - model: {family}/{kind}", f"    parameters: {{weight: {round(1 / 3, 6)}}}"]
    lines += ["dtype: float32", "featcal:", f"  merged: merged_{family}", f"  output: runs/{family}_{setting}/featcal", "  data:"]
    for kind in rd.KINDS:
        if setting == "real":
            spec = f"{{path: {family}_cal/{kind}.jsonl, format: text}}"
        elif setting == "real_x4":
            spec = f"{{path: {family}_cal_x4/{kind}.jsonl, format: text, samples: {4 * args.cal_records}}}"
        else:
            spec = f"{{generate: {generate_spec(setting, args, kind)}}}"
        lines.append(f"    {family}/{kind}: {spec}")
    lines += [f"  samples: {args.cal_records}", f"  max_length: {args.max_length}"]
    for key, value in (("lambda", args.lam), ("alpha", args.alpha), ("rho", args.rho)):
        if value is not None:  # otherwise the product's default, as a user writing `generate: {}` gets it
            lines.append(f"  {key}: {value}")
    lines += [f"  device: {args.device}", ""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.data_free_start", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--gguf", type=Path)
    p.add_argument("--data", type=Path, help="prepared data folder (DIR/<kind>/{train,cal,test}.jsonl), linked as WORKDIR/data")
    p.add_argument("--prose-dir", type=Path, help="without --data: where the prose sources are (to build the data)")
    p.add_argument("--prepare-only", action="store_true", help="build base and data, then stop")
    p.add_argument("--device", default="cpu", help="cpu or cuda: fine-tuning, scoring and the product's runs")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--settings", default=",".join(SETTINGS), help="run in this order, each across all families")
    p.add_argument("--record-tokens", type=int, default=128, help="without --data: tokens per built record")
    p.add_argument("--train-records", type=int, default=768)
    p.add_argument("--cal-records", type=int, default=64)
    p.add_argument("--test-records", type=int, default=48)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--max-new-tokens", type=int, default=None, help="generate.max_new_tokens (default: the product's)")
    p.add_argument("--lambda", dest="lam", type=float, default=None, help="featcal.lambda (default: the product's)")
    p.add_argument("--alpha", type=float, default=None, help="featcal.alpha (default: the product's)")
    p.add_argument("--rho", type=float, default=None, help="featcal.rho (default: the product's)")
    p.add_argument("--budget-s", type=float, default=None, help="start no FeatCal run after this many seconds")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="also copy results.md, results.json and run-logs.tar.gz here after every setting (e.g. $OUT)")
    p.add_argument("--no-reuse", action="store_true",
                   help="run bos/chat even where auto chose that start for every expert (same samples), and measure "
                        "auto_x4's start again instead of reusing auto's measurement")
    p.add_argument("--picked", default="", help="for the picked setting: KIND=on|off|empty,... (each expert's chat_template)")
    p.add_argument("--quick", action="store_true", help="smoke test of the whole path; its numbers mean nothing")
    return p


def _kind_order(path: Path) -> int:
    return rd.KINDS.index(path.stem) if path.stem in rd.KINDS else len(rd.KINDS)


def _prepare_data(args, work: Path, tokenizer, log) -> None:
    data = work / "data"
    if args.data is not None:
        source = args.data.resolve()
        missing = [f"{k}/{s}.jsonl" for k in rd.KINDS for s in ("train", "cal", "test") if not (source / k / f"{s}.jsonl").is_file()]
        if missing:
            sys.exit(f"--data {args.data}: missing {', '.join(missing)} (write them with `python -m studies.quality prepare`)")
        if data.is_symlink() and data.resolve() != source:
            data.unlink()
        if not data.exists():
            data.symlink_to(source, target_is_directory=True)
        elif data.resolve() != source:
            sys.exit(f"{data} exists and is not --data {args.data}; use another --workdir")
        return
    if not all((data / k / "test.jsonl").exists() for k in rd.KINDS):
        from studies.real_text import _data

        args.seed, args.prompt_tokens, args.train_per_document = 0, 32, 16
        _data(work, tokenizer, args, log)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import transformers
    from transformers import AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    began = time.time()
    if args.quick:
        args.steps, args.cal_records, args.test_records = QUICK["steps"], QUICK["cal_records"], QUICK["test_records"]
        args.max_length = min(args.max_length, QUICK["max_length"])
        args.max_new_tokens = args.max_new_tokens or QUICK["max_new_tokens"]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for key in ("nll", "training", "runs", "failed", "timings"):
        results.setdefault(key, {})
    results["skipped"] = []
    results["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def save() -> None:
        tmp = results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(results_path)
        (work / "results.md").write_text(report(results))
        if args.results_dir is not None:
            args.results_dir.mkdir(parents=True, exist_ok=True)
            for name in ("results.md", "results.json"):
                shutil.copyfile(work / name, args.results_dir / name)

    def timed(phase: str, seconds: float) -> None:
        results["timings"][phase] = round(results["timings"].get(phase, 0.0) + seconds, 2)

    if not (work / "base").exists():
        from studies.real_models import build_base_from_gguf

        if args.gguf is None:
            sys.exit("--gguf FILE is needed to build the base")
        started = time.time()
        log(f"dequantising {args.gguf} into {work / 'base'}")
        build_base_from_gguf(args.gguf.resolve(), work / "base")
        timed("base", time.time() - started)
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    _prepare_data(args, work, tokenizer, log)
    if args.prepare_only:
        return 0

    def read(kind: str, split: str, count: int | None) -> list[str]:
        texts = [r["text"] for r in rd.read_jsonl(work / "data" / kind / f"{split}.jsonl")][:count]
        return [t[: QUICK["chars"]] for t in texts] if args.quick else texts

    texts = {k: {"train": read(k, "train", QUICK["train_records"] if args.quick else None),
                 "test": read(k, "test", args.test_records)} for k in rd.KINDS}
    families = [f for f in args.families.split(",") if f]
    settings = [s for s in args.settings.split(",") if s]
    unknown = [n for n in families if n not in FAMILIES] + [s for s in settings if s not in SETTINGS]
    if unknown:
        sys.exit(f"unknown family or setting: {', '.join(unknown)}")
    tests = {f: {k: [as_family(f, tokenizer, t, k) for t in texts[k]["test"]] for k in rd.KINDS} for f in families}

    def score(family: str, model: str, path: Path) -> None:
        row = results["nll"].setdefault(family, {}).setdefault(model, {})
        kinds = [k for k in ([model.split(":")[1]] if model.startswith("expert:") else rd.KINDS) if k not in row]
        if not kinds or not path.exists():
            return
        started = time.time()
        loaded = load(path, args.device)  # once for every kind
        for kind in kinds:
            row[kind] = mean_nll(path, tests[family][kind], args.device, model=loaded)
        del loaded
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        timed("scoring", time.time() - started)
        save()

    # 1. the experts of every family, their real calibration text, their own NLL
    for family in families:
        for kind in rd.KINDS:
            out = work / family / kind
            if not out.exists():
                started = time.time()
                rows = [as_family(family, tokenizer, t, kind) for t in texts[kind]["train"]]
                log(f"fine-tuning {family}/{kind}: {args.steps} steps × {min(args.batch_size, len(rows))} records on {args.device}")
                results["training"][f"{family}/{kind}"] = train_rows(
                    work / "base", tokenizer, rows, out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=0,
                    log=lambda _: None, device=args.device, bf16=args.device.startswith("cuda")) | {"seconds": round(time.time() - started, 2)}
                timed("finetune", time.time() - started)
                log(f"fine-tuned {family}/{kind}: {results['training'][f'{family}/{kind}']}")
            for folder, count in ((f"{family}_cal", args.cal_records), (f"{family}_cal_x4", 4 * args.cal_records)):
                cal = work / folder / f"{kind}.jsonl"
                if not cal.exists():  # the real calibration text, as the expert saw it (BOS or chat template included)
                    rows = [as_family(family, tokenizer, t, kind)[0] for t in read(kind, "cal", count)]
                    rd.write_jsonl([{"text": tokenizer.decode(ids)} for ids in rows], cal)
            score(family, f"expert:{kind}", out)
    log(f"experts ready and scored ({time.time() - began:.0f} s)")

    def auto_chose(family: str, setting: str) -> bool:
        """Whether `auto` chose this forced setting's start for every expert: the same seed and settings then give
        the forced run auto's very samples (and result), so it is not run again (unless --no-reuse)."""
        auto = results["runs"].get(f"{family}_auto", {})
        modes = [record.get("start_mode") for record in auto.get("generated", {}).values()]
        done = all(k in results["nll"].get(family, {}).get("featcal:auto", {}) for k in rd.KINDS)
        return setting in ("bos", "chat") and not args.no_reuse and len(modes) == len(rd.KINDS) and set(modes) == {setting} and done

    # 2. one FeatCal run per setting and family, setting by setting: real and auto for both families first
    for setting in settings:
        for family in families:
            name = f"{family}_{setting}"
            folder = work / "runs" / name
            if f"featcal:{setting}" in results["nll"].get(family, {}) and (
                    (folder / "featcal").exists() or results["runs"].get(name, {}).get("same_as")):
                continue
            if auto_chose(family, setting):
                results["nll"][family][f"featcal:{setting}"] = dict(results["nll"][family]["featcal:auto"])
                results["runs"][name] = {"same_as": f"{family}_auto", "seconds": 0.0, "generated": {}, "warnings": [], "choices": []}
                log(f"{name}: not run: auto chose this start for every expert, so its samples and result are {family}_auto's")
                save()
                continue
            if args.budget_s is not None and time.time() - began > args.budget_s:
                results["skipped"].append(name)
                log(f"{name}: skipped (budget of {args.budget_s:.0f} s spent)")
                save()
                continue
            recipe = work / f"recipe_{name}.yaml"
            recipe.write_text(recipe_text(family, setting, args))
            if not (folder / "featcal").exists():
                folder.mkdir(parents=True, exist_ok=True)
                measured = sorted((work / "runs" / f"{family}_auto" / "featcal_generated").glob("*.start.json"))
                if setting == "auto_x4" and not args.no_reuse and measured:  # the start choice does not depend on samples
                    (folder / "featcal_generated").mkdir(exist_ok=True)
                    for path in measured:
                        shutil.copyfile(path, folder / "featcal_generated" / path.name)
                merging = not (work / f"merged_{family}").exists()
                log(f"{name}: featcal-llm run {recipe.name}" + (" (merging first)" if merging else ""))
                started = time.time()
                with open(folder / "run.log", "w") as handle:
                    done = subprocess.run([sys.executable, "-m", "featcal_llm", "run", recipe.name, "--force", "--device", args.device],
                                          cwd=work, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ})
                seconds = time.time() - started
                timed("featcal runs", seconds)
                lines = (folder / "run.log").read_text(errors="replace").splitlines()
                if args.results_dir is not None:  # one file for all the logs: few files come back from a GPU call
                    import tarfile

                    args.results_dir.mkdir(parents=True, exist_ok=True)
                    with tarfile.open(args.results_dir / "run-logs.tar.gz", "w:gz") as tar:
                        for log_file in sorted((work / "runs").glob("*/run.log")):
                            tar.add(log_file, arcname=f"{log_file.parent.name}.log")
                if done.returncode != 0:
                    results["failed"][name] = {"returncode": done.returncode, "seconds": round(seconds, 1), "log_tail": lines[-25:]}
                    log(f"{name}: featcal-llm run failed (exit {done.returncode}); see {folder / 'run.log'}:\n  " + "\n  ".join(lines[-8:]))
                    save()
                    continue
                results["failed"].pop(name, None)
                generated = folder / "featcal_generated"
                records = {p.stem: json.loads(p.read_text()) for p in sorted(generated.glob("*.json"), key=_kind_order)
                           if not p.name.endswith(".start.json")} if generated.exists() else {}
                results["runs"][name] = {
                    "seconds": round(seconds, 1), "merged_first": merging,
                    "generated": {n: {k: r.get(k) for k in ("start", "start_mode", "start_choice", "kept", "dropped",
                                                            "generated_tokens", "seconds", "tokens_per_second")}
                                  for n, r in records.items()},
                    "warnings": [line for line in lines if "warning" in line],
                    "choices": [line.strip() for line in lines if ": chose " in line]}
                for line in results["runs"][name]["choices"]:
                    log(f"  {line}")
                log(f"{name}: done in {seconds:.0f} s")
                save()
            score(family, "merged", work / f"merged_{family}")
            score(family, f"featcal:{setting}", folder / "featcal")
            log(f"{name}: scored ({time.time() - began:.0f} s in all)")
    results["timings"]["total (this invocation)"] = round(time.time() - began, 1)
    save()
    print(report(results, SETTINGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
