"""Real-model study: does calibrating on text the experts write themselves work as real text?

``python -m studies.real_text --workdir W [--base DIR | --gguf FILE]`` builds, in W (each phase skipped
when its output exists, so a rerun only does what is missing):

1. ``base``: the float32 base (``--gguf``: dequantised from a GGUF file; ``--base``: an existing checkpoint);
2. ``data/<kind>/{train,cal,test}.jsonl``: three kinds of real text (``real_data.KINDS``), records of
   ``--record-tokens`` tokens, and ``prompts.jsonl``, the first ``--prompt-tokens`` tokens of every cal record;
3. ``experts/<kind>``: the base fully fine-tuned on each kind's train split;
4. ``recipe_<setting>.yaml`` → ``runs/<setting>/featcal`` through ``python -m featcal_llm run`` (the first run merges
   ``merged`` with mergekit Task Arithmetic), one recipe per calibration data setting:
   ``real`` (the cal split), ``bos`` (``generate`` from BOS), ``prompts`` (``generate`` from the cal records'
   beginnings);
5. held-out NLL of every model on the test splits, and the share of the merge→expert gap each setting recovered,
   to ``results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from studies import real_data as rd
from studies.real_report import report
from featcal_llm.errors import FeatCalError

SETTINGS = ("real", "bos", "prompts")
LABELS = {"real": "(a) real calibration text", "bos": "(b) generate from BOS",
          "prompts": "(c) generate from the cal records' beginnings"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.real_text", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--base", type=Path, help="a float32 Hugging Face checkpoint to fine-tune and merge")
    source.add_argument("--gguf", type=Path, help="a GGUF file, dequantised into WORKDIR/base")
    p.add_argument("--prose-dir", type=Path, default=None,
                   help="prose from the reStructuredText sources under this folder (e.g. Debian's python3.11-doc: "
                        f"{rd.DEBIAN_DOC_SOURCES}) instead of pydoc_data.topics")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {','.join(SETTINGS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record-tokens", type=int, default=160)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--train-records", type=int, default=768)
    p.add_argument("--cal-records", type=int, default=64)
    p.add_argument("--test-records", type=int, default=48)
    p.add_argument("--train-per-document", type=int, default=16,
                   help="cap on train records from one document (0: none, all its windows)")
    p.add_argument("--steps", type=int, default=96, help="fine-tuning steps per expert (96 x 8: one pass over 768)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--merge-weight", type=float, default=round(1 / 3, 6), help="Task Arithmetic weight of every expert")
    p.add_argument("--generate-seed", type=int, default=None,
                   help="generate: seed of settings bos and prompts (default --seed); another draw of the same "
                        "experts' samples, e.g. in a second workdir linking base, data, experts and merged")
    p.add_argument("--temperature", type=float, default=1.0, help="generate: temperature of settings bos and prompts")
    p.add_argument("--lambda", dest="lam", type=float, default=1e-3)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--rho", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kl-records", type=int, default=16,
                   help="test records per kind on which KL(expert ‖ model) is measured (0: skip)")
    return p


def recipe_text(base: str, setting: str, args: argparse.Namespace) -> str:
    """A mergekit Task Arithmetic recipe with a ``featcal:`` block; paths relative to the workdir."""
    tokens = args.record_tokens
    lines = [f"# written by studies.real_text: setting {setting}, {LABELS[setting]}",
             "merge_method: task_arithmetic", f"base_model: {base}", "models:"]
    for kind in rd.KINDS:
        lines += [f"  - model: experts/{kind}", f"    parameters: {{weight: {args.merge_weight}}}"]
    lines += ["dtype: float32", "featcal:", "  merged: merged", f"  output: runs/{setting}/featcal", "  data:"]
    seed = args.seed if args.generate_seed is None else args.generate_seed
    sampling = f"chat_template: \"off\", seed: {seed}, temperature: {args.temperature}"
    for kind in rd.KINDS:
        if setting == "real":
            spec = f"{{path: data/{kind}/cal.jsonl, format: text}}"
        elif setting == "bos":
            spec = f"{{generate: {{samples: {args.cal_records}, max_new_tokens: {tokens}, {sampling}}}}}"
        else:
            spec = (f"{{generate: {{prompts: data/{kind}/prompts.jsonl, samples: {args.cal_records}, "
                    f"max_new_tokens: {tokens - args.prompt_tokens}, {sampling}}}}}")
        lines.append(f"    experts/{kind}: {spec}")
    lines += [f"  samples: {args.cal_records}", f"  max_length: {tokens}", f"  lambda: {args.lam}",
              f"  alpha: {args.alpha}", f"  rho: {args.rho}", "  device: cpu", ""]
    return "\n".join(lines)


class State:
    """``state.json``: what each phase produced and how long it took, kept across reruns.

    Saving merges into the file under a lock, so that runs of different settings can share a workdir at once.
    """

    def __init__(self, path: Path):
        self.path = path
        self.data = {"timings": {}, "training": {}, "nll": {}}
        self.data.update(json.loads(path.read_text()) if path.exists() else {})

    def save(self) -> None:
        import fcntl

        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
            for section, values in self.data.items():
                merged = on_disk.setdefault(section, {})
                for key, value in values.items():
                    merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
            self.data = on_disk
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(on_disk, indent=2) + "\n")
            tmp.replace(self.path)


def _data(work: Path, tokenizer, args, log) -> None:
    sizes = rd.SplitSizes(train=args.train_records, cal=args.cal_records, test=args.test_records,
                          train_per_document=args.train_per_document or None)
    for kind in rd.KINDS:
        folder = work / "data" / kind
        if (folder / "prompts.jsonl").exists():
            continue
        docs = rd.documents(kind, prose_dir=args.prose_dir)
        try:
            splits = rd.split_records(docs, tokenizer, sizes, args.record_tokens, args.seed)
        except FeatCalError as error:
            hint = (" (pydoc_data.topics has 79 short documents: pass --prose-dir, e.g. "
                    f"{rd.DEBIAN_DOC_SOURCES} after apt-get install python3.11-doc, or fewer --train-records)")
            raise FeatCalError(f"data/{kind}: {error}" + (hint if kind == "prose" and args.prose_dir is None else ""))
        for split, records in splits.items():
            rd.write_jsonl(records, folder / f"{split}.jsonl")
        rd.write_jsonl(rd.prompt_records(splits["cal"], tokenizer, args.prompt_tokens), folder / "prompts.jsonl")
        log(f"data/{kind}: " + ", ".join(f"{s} {len(r)}" for s, r in splits.items()))


def _experts(work: Path, base: Path, tokenizer, args, state: State, log) -> None:
    from studies.real_models import finetune

    for kind in rd.KINDS:
        out = work / "experts" / kind
        if out.exists():
            continue
        log(f"fine-tuning experts/{kind}: {args.steps} steps × {args.batch_size} records, lr {args.lr}")
        texts = [r["text"] for r in rd.read_jsonl(work / "data" / kind / "train.jsonl")]
        started, cpu = time.time(), time.process_time()
        state.data["training"][kind] = finetune(base, tokenizer, texts, out, steps=args.steps,
                                                batch_size=args.batch_size, lr=args.lr, seed=args.seed, log=log)
        state.data["training"][kind]["cpu_seconds"] = time.process_time() - cpu
        state.data["timings"][f"finetune:{kind}"] = time.time() - started
        state.save()


def _generation_records(folder: Path) -> dict[str, dict]:
    """The records ``featcal-llm run`` wrote beside a setting's output for each expert's generated set."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((folder / "featcal_generated").glob("*.json"))}


def _calibrate(work: Path, base: str, setting: str, args, state: State, log) -> None:
    """Run one setting's recipe from the workdir; its output (and generated sets) go to ``runs/<setting>/``."""
    folder = work / "runs" / setting
    folder.mkdir(parents=True, exist_ok=True)
    recipe = work / f"recipe_{setting}.yaml"
    recipe.write_text(recipe_text(base, setting, args))
    if (folder / "featcal").exists():
        return
    merging = not (work / "merged").exists()
    log(f"calibrating runs/{setting}/featcal ({LABELS[setting]})" + (", merging first" if merging else ""))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    started = time.time()
    with open(folder / "run.log", "w") as logfile:
        done = subprocess.run([sys.executable, "-m", "featcal_llm", "run", recipe.name, "--force"], cwd=work,
                              env=env, stdout=logfile, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise FeatCalError(f"{recipe}: featcal-llm run failed (exit {done.returncode}); see {folder / 'run.log'}")
    total = time.time() - started
    generated = _generation_records(folder)
    generating = sum(r["seconds"] for r in generated.values())
    timings = state.data["timings"]
    if generated:
        timings[f"generate:{setting}"] = generating
        state.data.setdefault("generation", {})[setting] = {
            k: {f: r.get(f) for f in ("kept", "dropped", "generated_tokens", "seconds", "tokens_per_second", "start")}
            for k, r in generated.items()}
    timings[f"calibrate:{setting}" + (" (incl. merge)" if merging else "")] = total - generating
    state.save()


def _score(work: Path, tokenizer, models: dict[str, Path], state: State, log) -> None:
    """NLL of each model on the test splits it is scored on (an expert: its own kind only)."""
    from studies.real_models import mean_nll

    tests = {k: [r["text"] for r in rd.read_jsonl(work / "data" / k / "test.jsonl")] for k in rd.KINDS}
    for name, path in models.items():
        state.save()  # also reads what a run of another setting scored meanwhile
        kinds = [name.split(":", 1)[1]] if name.startswith("expert:") else list(rd.KINDS)
        row = state.data["nll"].setdefault(name, {})
        missing = [k for k in kinds if k not in row]
        if not missing:
            continue
        from transformers import AutoModelForCausalLM
        import torch

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        started = time.time()
        for kind in missing:
            row[kind] = mean_nll(path, tokenizer, tests[kind], model=model)
            log(f"NLL {name} on {kind}: {row[kind]:.4f}")
        state.data["timings"][f"score:{name}"] = time.time() - started
        state.save()


def _kl(work: Path, tokenizer, models: dict[str, Path], records: int, state: State, log) -> None:
    """KL(expert ‖ model) on each kind's first test records: defined even where the merge beats the expert's NLL."""
    import torch
    from transformers import AutoModelForCausalLM

    from studies.real_models import log_probs, mean_kl

    def load(path: Path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    for kind in rd.KINDS:
        state.save()
        todo = [n for n in models if kind not in state.data.setdefault("kl", {}).get(n, {})]
        if not todo:
            continue
        texts = [r["text"] for r in rd.read_jsonl(work / "data" / kind / "test.jsonl")][:records]
        started = time.time()
        reference = log_probs(load(work / "experts" / kind), tokenizer, texts)
        for name in todo:
            state.data["kl"].setdefault(name, {})[kind] = value = mean_kl(reference, load(models[name]), tokenizer, texts)
            log(f"KL(expert:{kind} ‖ {name}) on {kind}: {value:.4f}")
        state.data["timings"][f"kl:{kind}"] = state.data["timings"].get(f"kl:{kind}", 0) + time.time() - started
        state.save()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        raise FeatCalError(f"--settings: expected a subset of {','.join(SETTINGS)}; got {','.join(bad)}")
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    state = State(work / "state.json")

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    if args.gguf is not None:
        base = work / "base"
        if not base.exists():
            from studies.real_models import build_base_from_gguf

            started = time.time()
            build_base_from_gguf(args.gguf.resolve(), base)
            state.data["timings"]["base from GGUF"] = time.time() - started
            state.save()
    else:
        base = args.base.resolve()
        if not (base / "config.json").is_file():
            raise FeatCalError(f"--base {base}: expected a Hugging Face checkpoint directory (config.json)")
    tokenizer = AutoTokenizer.from_pretrained(base)
    _data(work, tokenizer, args, log)
    _experts(work, base, tokenizer, args, state, log)
    models = {"base": base, **{f"expert:{k}": work / "experts" / k for k in rd.KINDS}}
    _score(work, tokenizer, models, state, log)
    for setting in settings:
        _calibrate(work, str(base), setting, args, state, log)
    models["merged"] = work / "merged"
    models.update({f"featcal:{s}": work / "runs" / s / "featcal" for s in settings})
    _score(work, tokenizer, models, state, log)
    if args.kl_records:
        _kl(work, tokenizer, {n: p for n, p in models.items() if not n.startswith("expert:")}, args.kl_records,
            state, log)
    text = report(state.data, settings, LABELS, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"base": str(base)}, work)
    print(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except FeatCalError as error:
        print(f"featcal-llm: error: {error}", file=sys.stderr)
        sys.exit(2)
