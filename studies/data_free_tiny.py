"""Tiny-model study: the share of the merge→expert NLL gap that `generate: {}` recovers, against real text and forced starts.

``python -m studies.data_free_tiny --workdir W`` builds the tiny base, raw-text expert and chat-tuned expert of
``studies.tiny_kinds``, merges the two experts (Task Arithmetic, 0.5 each) and calibrates once per setting: ``real``
(held-out records of each expert's own kind: raw lines from BOS, chat pairs through the template), ``auto``
(``generate:`` with the start measured), ``bos`` (``chat_template: off``), ``chat`` (``chat_template: on``). Each
expert is scored on its own kind's test records (raw: the text; chat: the answer and its end token);
``results.json``/``results.md`` hold the NLLs, the shares, the starts chosen and the wall times.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import yaml

from studies import tiny_kinds as tk
from studies.data_free_start import mean_nll
from studies.real_data import gap_recovered

SETTINGS = ("real", "auto", "bos", "chat")


def records(tokenizer, kind: str, count: int, seed: int) -> list[tuple[list[int], int]]:
    """(ids, first scored index) of `count` records of the expert's kind, drawn with `seed` (not the training draws)."""
    rng, asks = random.Random(seed), tk.questions()
    if kind == "raw":
        return [tk._encode_raw(tokenizer, tk.line(rng, tk.CODE_WORDS)) for _ in range(count)]
    return [tk._encode_chat(tokenizer, rng.choice(asks), tk.line(rng, tk.UPPER_WORDS)) for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.data_free_tiny")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--test-records", type=int, default=64)
    args = p.parse_args(argv)
    from featcal_llm.pipeline import run_recipe
    from featcal_llm.tiny import build_char_tokenizer

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    paths = tk.build_kinds(work / "models", steps=args.steps) if not (work / "models" / "raw_twin").exists() else {
        n: work / "models" / n for n in ("base", "raw", "chat", "raw_twin")}
    tokenizer = build_char_tokenizer()
    experts = ("raw", "chat")
    tests = {k: records(tokenizer, k, args.test_records, seed=1000) for k in experts}
    cal = {}
    for kind in experts:
        cal[kind] = work / f"cal_{kind}.jsonl"
        cal[kind].write_text("".join(json.dumps({"text": tokenizer.decode(ids)}) + "\n" for ids, _ in records(tokenizer, kind, args.samples, seed=2000)))
    results = {"nll": {}, "runs": {}, "settings": vars(args) | {"workdir": str(work)}}
    for kind in experts:
        results["nll"][f"expert:{kind}"] = {kind: mean_nll(paths[kind], tests[kind], "cpu")}
    for setting in SETTINGS:
        root = work / setting
        recipe_path = tk.kinds_recipe(paths, root, experts, samples=args.samples, max_new_tokens=args.max_new_tokens)
        recipe = yaml.safe_load(recipe_path.read_text())
        recipe["featcal"]["max_length"] = 192
        for kind in experts:
            spec = recipe["featcal"]["data"][str(paths[kind])]
            if setting == "real":
                recipe["featcal"]["data"][str(paths[kind])] = {"path": str(cal[kind]), "format": "text"}
            elif setting != "auto":
                spec["generate"]["chat_template"] = "off" if setting == "bos" else "on"
        recipe["featcal"]["samples"] = args.samples
        recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        started = time.time()
        output = run_recipe(recipe_path, force=True, progress=False)
        seconds = time.time() - started
        generated = {}
        for kind in experts:
            record = root / "featcal_generated" / f"{kind}.json"
            if record.exists():
                r = json.loads(record.read_text())
                generated[kind] = {k: r.get(k) for k in ("start", "start_mode", "start_choice", "generated_tokens", "seconds")}
        results["runs"][setting] = {"seconds": seconds, "generated": generated}
        results["nll"][f"featcal:{setting}"] = {k: mean_nll(Path(output), tests[k], "cpu") for k in experts}
    merged = Path(recipe["featcal"]["merged"])
    results["nll"]["merged"] = {k: mean_nll(merged, tests[k], "cpu") for k in experts}
    nll = results["nll"]
    results["share"] = {s: {k: gap_recovered(nll[f"expert:{k}"][k], nll["merged"][k], nll[f"featcal:{s}"][k]) for k in experts} for s in SETTINGS}
    (work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| setting | raw-text expert | chat-tuned expert | starts |", "|---|---|---|---|"]
    for s in SETTINGS:
        starts = ", ".join(f"{k}: {g['start']}" for k, g in results["runs"][s]["generated"].items()) or "real text"
        cells = " | ".join("–" if results["share"][s][k] is None else f"{results['share'][s][k]:.2f}" for k in experts)
        lines.append(f"| {s} | {cells} | {starts} |")
    lines += ["", "NLL: " + json.dumps({m: {k: round(v, 4) for k, v in row.items()} for m, row in nll.items()})]
    (work / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
