"""Quality study: does calibration beat shipping the best single expert? Two real settings, label-free.

    python -m studies.quality prepare --gguf G --data D [--prose-dir /usr/share/doc/python3.11/html/_sources]
    python -m studies.quality run --gguf G --data D --workdir W [--device cuda] [--budget-s 420] [--quick]

``prepare`` writes the already-split text (``D/<kind>/{train,cal,test,prompts}.jsonl`` for code, prose and c,
and ``D/mix/{train,cal,prompts}.jsonl`` for the broad expert; a few MB) so that ``run`` needs no Debian package.
``run`` builds in W (each phase skipped when its output exists): the float32 base from the GGUF file, four experts
fully fine-tuned (code, prose, c, and a broad one on the mix), then per setting (``narrow``: code/prose/c;
``broad``: broad/code/c) the rows of ``quality_setup.rows`` through the product's own recipe path, most important
first: the Task Arithmetic merge, FeatCal with the product's defaults and with ``auto``; RegMean++ on a linear
merge and the stacks; ``auto`` choosing by the output criterion; a global sweep; 64 vs 256 generated samples; the data-free
default (``generate:`` with no prompts) and two ways of sampling it. Every model is scored on every
domain (held-out NLL, KL to the domain's expert) as soon as it exists, and ``results.md``/``results.json`` are
rewritten after each. ``--budget-s`` skips the rows that would start after that many seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

from studies import real_data as rd
from studies.common import log
from studies.quality_data import prepare, records_as_trained
from studies.quality_report import write_report
from studies.quality_setup import MIX, PHASES, SETTINGS, SWEEP, expert_dir, expert_label, recipe_text, rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.quality", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the split text records into --data")
    run = sub.add_parser("run", help="the whole study into --workdir")
    for q in (prep, run):
        source = q.add_mutually_exclusive_group(required=True)
        source.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct GGUF file (dequantised to float32)")
        source.add_argument("--base", type=Path, help="a float32 Hugging Face checkpoint instead")
        q.add_argument("--data", type=Path, required=True, help="the prepared data folder")
        q.add_argument("--seed", type=int, default=0)
    prep.add_argument("--prose-dir", type=Path, default=Path(rd.DEBIAN_DOC_SOURCES))
    prep.add_argument("--record-tokens", type=int, default=160)
    prep.add_argument("--prompt-tokens", type=int, default=32)
    prep.add_argument("--train-records", type=int, default=768)
    prep.add_argument("--cal-records", type=int, default=256, help="cal records per kind (rows use the first 64)")
    prep.add_argument("--test-records", type=int, default=48)
    prep.add_argument("--train-per-document", type=int, default=16)
    run.add_argument("--workdir", type=Path, required=True)
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--settings", default="narrow,broad")
    run.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)} (experts always)")
    run.add_argument("--steps", type=int, default=96, help="fine-tuning steps of each narrow expert (one pass)")
    run.add_argument("--broad-steps", type=int, default=288,
                     help="of the broad expert: one pass over every kind's train records (three times a narrow expert's)")
    run.add_argument("--generate-samples", default="64,256", help="samples per expert of the generate rows")
    run.add_argument("--max-records", type=int, default=None, help="skip the rows that calibrate on more records (a CPU run)")
    run.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                     help="fine-tune under bfloat16 autocast (auto: on a GPU; on: also on a CPU with bf16 units)")
    run.add_argument("--batch-size", type=int, default=8)
    run.add_argument("--lr", type=float, default=5e-4)
    run.add_argument("--cal-records", type=int, default=64, help="calibration records per expert (cal split)")
    run.add_argument("--test-records", type=int, default=48)
    run.add_argument("--kl-records", type=int, default=16)
    run.add_argument("--merge-weight", type=float, default=round(1 / 3, 6))
    run.add_argument("--calibration-dtype", default="float32", help="featcal.dtype of every row (auto: the product's)")
    run.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    run.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    run.add_argument("--results-dir", type=Path, default=None,
                     help="also copy results.md, results.json and state.json here after every row (e.g. $OUT)")
    run.add_argument("--keep", action="store_true", help="keep every calibrated checkpoint (default: merges only)")
    run.add_argument("--no-expert-scores", action="store_true",
                     help="score the rows only (the base and experts are scored elsewhere, e.g. by studies.allgap gaps)")
    run.add_argument("--rows", default=None,
                     help="run only the rows of the phases with these names (separated by ';', as row names hold commas; e.g. to run rows side by side in "
                          "workdirs that share the experts and the merge)")
    run.add_argument("--quick", action="store_true",
                     help="smoke test: 1 fine-tuning step on 2 short records, 8 calibration records of 32 tokens, "
                          "2 short test records, one sweep point, 2 generated samples of 8 tokens")
    run.add_argument("--until", choices=("experts",), default=None, help="stop after this phase")
    return p


class State:
    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {}
        for key in ("timings", "training", "nll", "kl", "rows"):
            self.data.setdefault(key, {})
        self.data.setdefault("skipped", [])

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


class Study:
    def __init__(self, args, work: Path, tokenizer, state: State):
        from studies.quality_eval import Evaluator

        self.args, self.work, self.tokenizer, self.state = args, work, tokenizer, state
        self.started = time.time()
        quick = args.quick
        self.record_tokens = 32 if quick else json.loads((work / "data" / "meta.json").read_text())["record_tokens"]
        self.prompt_tokens = 32
        self.evaluator = Evaluator(work / "data", tokenizer, args.device, 2 if quick else args.test_records,
                                   2 if quick else args.kl_records, 120 if quick else None)
        self.options = {**{k: v for k, v in vars(args).items() if k != "command"},
                        "settings": [s.strip() for s in args.settings.split(",") if s.strip()]}
        if quick:  # what the smoke test really used
            self.options.update(steps=1, cal_records=8, test_records=2, kl_records=2)

    def kinds(self) -> list[str]:
        """The experts the chosen settings use, in training order."""
        used = {kind for name in self.options["settings"] for kind in SETTINGS[name].experts}
        return [kind for kind in (*rd.KINDS, MIX) if kind in used]

    def timed(self, phase: str, seconds: float) -> None:
        self.state.data["timings"][phase] = round(self.state.data["timings"].get(phase, 0.0) + seconds, 2)

    def report(self) -> None:
        self.state.save()
        write_report(self.state.data, self.options, self.work)
        if self.args.results_dir is not None:
            self.args.results_dir.mkdir(parents=True, exist_ok=True)
            for name in ("results.md", "results.json", "state.json"):
                shutil.copyfile(self.work / name, self.args.results_dir / name)

    # --- experts -------------------------------------------------------------------------------------------
    def experts(self) -> None:
        from studies.real_models import finetune

        args = self.args
        for kind in self.kinds():
            out = self.work / expert_dir(kind)
            if out.exists():
                continue
            if kind == MIX:  # every kind's train records interleaved: three times a narrow expert's text, one pass
                texts = rd.interleave([[r["text"] for r in rd.read_jsonl(self.work / "data" / k / "train.jsonl")] for k in rd.KINDS])
            else:
                texts = [r["text"] for r in rd.read_jsonl(self.work / "data" / kind / "train.jsonl")]
            steps = args.broad_steps if kind == MIX else args.steps
            steps, texts = (1, [t[:120] for t in texts[:2]]) if args.quick else (steps, texts)
            log(f"fine-tuning {out.name}: {steps} steps × {args.batch_size} records, lr {args.lr} on {args.device}")
            started = time.time()
            self.state.data["training"][out.name] = finetune(
                self.work / "base", self.tokenizer, texts, out, steps=steps, batch_size=args.batch_size, lr=args.lr,
                seed=args.seed, log=lambda m: None, device=args.device,
                bf16=args.bf16 == "on" or (args.bf16 == "auto" and args.device.startswith("cuda")))
            self.timed(f"finetune {out.name}", time.time() - started)
            log(f"  {out.name}: loss {self.state.data['training'][out.name]['first_loss']:.3f} → "
                f"{self.state.data['training'][out.name]['last_loss']:.3f} in {time.time() - started:.0f} s")
            self.state.save()

    # --- scoring -------------------------------------------------------------------------------------------
    def score(self, name: str, path: Path, settings: list[str]) -> None:
        """NLL on every domain, and KL to each domain's expert of every setting listed."""
        from studies.quality_eval import load, nlls

        started = time.time()
        model = None
        if name not in self.state.data["nll"]:
            model = load(path, self.args.device)
            records = self.evaluator.records(model)  # kept: the report's intervals resample them
            self.state.data["nll"][name] = nlls(records)
            self.state.data.setdefault("records", {})[name] = records
        for setting_name in settings if self.args.kl_records > 0 else ():  # --kl-records 0: NLL only
            setting = SETTINGS[setting_name]
            kl = self.state.data["kl"].setdefault(setting_name, {}).setdefault(name, {})
            for domain, owner in setting.owners.items():
                if domain in kl:
                    continue
                model = model if model is not None else load(path, self.args.device)
                reference = self.evaluator.reference(owner, self.work / expert_dir(owner), domain)
                kl[domain] = self.evaluator.kl(model, reference, domain)
        del model
        self.timed("scoring", time.time() - started)
        nll = self.state.data["nll"][name]
        log(f"  {name}: NLL " + " ".join(f"{k} {v:.4f}" for k, v in nll.items())
            + f" avg {sum(nll.values()) / len(nll):.4f}")

    # --- rows ----------------------------------------------------------------------------------------------
    def merged_dir(self, setting: str, row) -> str:
        return f"merged/{setting}-{row.merged}"

    @staticmethod
    def output_dir(setting: str, row_name: str) -> str:
        slug = "".join(c if c.isalnum() or c in ".-" else "-" for c in row_name).strip("-")
        return f"runs/{setting}/{slug}"

    def run_row(self, setting_name: str, row) -> bool:
        """Write the row's recipe, run it through the product, score it; a failure is recorded, not raised."""
        from featcal_llm import runlog
        from featcal_llm.pipeline import run_recipe
        from studies.provenance import run_record

        setting, args = SETTINGS[setting_name], self.args
        name = f"{setting_name}:{row.name}"
        record = self.state.data["rows"].setdefault(setting_name, {})
        if name in self.state.data["nll"]:
            return True
        if args.budget_s is not None and time.time() - self.started > args.budget_s:
            if name not in self.state.data["skipped"]:
                self.state.data["skipped"].append(name)
            return False
        if row.settings and setting_name not in row.settings:
            return True
        merged, output = self.merged_dir(setting_name, row), self.output_dir(setting_name, row.name)
        quick_row = row
        if args.quick and row.generates:
            quick_row = replace(row, samples=min(row.samples, 2))
        if args.quick and row.records:
            quick_row = replace(row, records=8)
        elif args.max_records and row.records and row.records > args.max_records:
            return True
        text = recipe_text(setting, quick_row, output, merged, record_tokens=self.record_tokens,
                           prompt_tokens=self.prompt_tokens if not args.quick else self.record_tokens - 8,
                           cal_records=8 if args.quick else args.cal_records, seed=args.seed, device=args.device,
                           dtype=args.calibration_dtype, merge_weight=args.merge_weight)
        recipe = self.work / "recipes" / setting_name / f"{Path(output).name}.yaml"
        recipe.parent.mkdir(parents=True, exist_ok=True)
        recipe.write_text(text)
        merging = not (self.work / merged).exists()
        log(f"{name}: running {recipe.relative_to(self.work)}" + (" (merging first)" if merging else ""))
        started = time.time()
        logfile = self.work / "logs" / setting_name / f"{Path(output).name}.log"  # the run's own log: its experts' leads
        logfile.parent.mkdir(parents=True, exist_ok=True)
        logfile.unlink(missing_ok=True)
        try:
            with contextlib.chdir(self.work), runlog.session(logfile, runlog.NORMAL):
                run_recipe(recipe.relative_to(self.work), force=True, device=args.device, progress=False)
        except Exception as error:  # one failed row must not stop a one-shot GPU run
            record[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
            traceback.print_exc()
            log(f"{name}: FAILED: {record[name]['error']}")
            self.report()
            return False
        finally:
            self._free()
        seconds = time.time() - started
        generated = self.work / Path(output).parent / "featcal_generated"
        generation = sum(json.loads(p.read_text()).get("seconds", 0) for p in generated.glob("*.json")) \
            if row.generates and generated.exists() else 0.0
        record[name] = {"seconds": round(seconds, 1), "generation_s": round(generation, 1), "merged_first": merging,
                        "recipe": str(recipe.relative_to(self.work)), "featcal": _featcal_block(text)}
        resolved = run_record(self.work / output, logfile)  # what the run resolved (its card) and logged, before the output goes
        record[name].update({k: resolved[k] for k in ("featcal_effective", "record_leads") if k in resolved})
        drift = self.work / output / "featcal_drift.json"
        if drift.exists():  # the per-layer drift to each expert outlives the checkpoint (removed after the phase)
            kept = self.work / "drift" / setting_name / f"{Path(output).name}.json"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(drift, kept)
            record[name]["drift"] = str(kept.relative_to(self.work))
        self.timed(f"{setting_name}: {row.name}", seconds)
        if merging:
            merge_row = f"{setting_name}:merged" if row.merged == "ta" else f"{setting_name}:{row.merged} merge"
            self.score(merge_row, self.work / merged, [setting_name])
            record.setdefault(merge_row, {})
        self.score(name, self.work / output, [setting_name])
        if generated.exists() and row.generates:
            shutil.rmtree(generated, ignore_errors=True)  # the next generate row writes its own
        self.report()
        return True

    def _free(self) -> None:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def main(self) -> None:
        args, settings = self.args, self.options["settings"]
        records_as_trained(self.work / "data", self.tokenizer)
        self.experts()
        if args.until == "experts":
            return
        started = time.time()
        if not args.no_expert_scores:
            self.score("base", self.work / "base", settings)
            for kind in self.kinds():
                self.score(expert_label(kind), self.work / expert_dir(kind), settings)
            self.report()
            log(f"base and experts scored in {time.time() - started:.0f} s")
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        sweep = SWEEP[:1] if args.quick else SWEEP
        samples = (2,) if args.quick else tuple(int(n) for n in args.generate_samples.split(","))
        for phase in phases:
            phase_started = time.time()
            only = None if args.rows is None else {r.strip() for r in args.rows.split(";")}
            for row in rows(phase, sweep, samples):  # row by row across settings: a budget cut leaves both alike
                if only is not None and row.name not in only:
                    continue
                for setting in settings:
                    self.run_row(setting, row)
            if not args.keep:
                for setting in settings:
                    for row in rows(phase, sweep, samples):
                        shutil.rmtree(self.work / self.output_dir(setting, row.name), ignore_errors=True)
            log(f"phase {phase} done in {time.time() - phase_started:.0f} s (total {time.time() - self.started:.0f} s)")
        self.report()


def _featcal_block(recipe: str) -> dict:
    """The recipe's ``featcal:`` keys as the product read them (the settings a row really used)."""
    import yaml

    return yaml.safe_load(recipe)["featcal"]


def _base(args, work: Path | None) -> Path:
    if args.base is not None:
        if not (args.base / "config.json").is_file():
            sys.exit(f"--base {args.base}: expected a Hugging Face checkpoint directory (config.json)")
        return args.base.resolve()
    if not args.gguf.is_file():
        sys.exit(f"--gguf {args.gguf}: expected a GGUF file")
    target = (work or args.data) / "base"
    if not target.exists():
        from studies.real_models import build_base_from_gguf

        log(f"dequantising {args.gguf} into {target}")
        build_base_from_gguf(args.gguf.resolve(), target)
    return target


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch
    import transformers
    from transformers import AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    if args.command == "prepare":
        if args.gguf is not None:
            tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(args.base)
        prepare(args, tokenizer)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    if not (args.data / "meta.json").is_file():
        sys.exit(f"--data {args.data}: no meta.json; write it with `python -m studies.quality prepare`")
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not data.exists():
        data.symlink_to(args.data.resolve(), target_is_directory=True)
    state = State(work / "state.json")
    started = time.time()
    base = _base(args, work)
    if base != work / "base" and not (work / "base").exists():
        (work / "base").symlink_to(base, target_is_directory=True)
    state.data["timings"].setdefault("base", round(time.time() - started, 1))
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    study = Study(args, work, tokenizer, state)
    study.main()
    log(f"done in {time.time() - study.started:.0f} s; results in {work / 'results.md'}")
    if not args.until:
        print((work / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
