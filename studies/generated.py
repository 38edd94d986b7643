"""The demo calibrated on data the experts write themselves, against the real calibration records.

On a finished demo workdir (`python -m featcal_llm demo --workdir W`), the demo's
recipe (same merge, λ, α, ρ, samples) is calibrated once per data setting and
scored on the test split:

- real data: the cal records (what the demo itself uses);
- generate from BOS / from EOS: each expert samples from its start token (the
  demo's experts were trained on `prompt answer </s>` records without a BOS, so
  both are shown);
- generate from the cal prompts: each expert continues the cal records' own
  prompts (`12+35=`), answers not given.

    python -m studies.generated --workdir W
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import click
import yaml

from featcal_llm.demo.report import gap_recovery
from featcal_llm.demo.models import quiet_transformers
from featcal_llm.demo.run import MERGED_ROW, RECIPE_FILE, _score_model
from featcal_llm.demo.tasks import read_jsonl

MAX_NEW_TOKENS = 32  # a demo record is at most ~20 characters: prompt, answer and </s>
SETTINGS = {  # row → the generate block (None: the real records); "{task}" is filled per expert
    "real data (cal records)": None,
    "generate from BOS": {"chat_template": "off"},
    "generate from EOS": {"chat_template": "off", "start": "</s>"},
    "generate from the cal prompts": {"chat_template": "off", "prompts": "data/{task}/cal_prompts.jsonl"},
}


def _slug(row: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in row.lower()).strip("-").replace("--", "-")


def _recipe_for(base: dict, row: str, generate: dict | None, tasks: tuple[str, ...]) -> dict:
    recipe = json.loads(json.dumps(base))
    recipe["featcal"]["output"] = f"featcal-{_slug(row)}"
    if generate is not None:
        for task in tasks:
            block = {key: value.format(task=task) if isinstance(value, str) else value for key, value in generate.items()}
            recipe["featcal"]["data"][f"experts/{task}"] = {"generate": {"max_new_tokens": MAX_NEW_TOKENS, **block}}
    return recipe


def _write_prompts(workdir: Path, tasks: tuple[str, ...]) -> None:
    for task in tasks:
        records = read_jsonl(workdir / "data" / task / "cal.jsonl")
        (workdir / "data" / task / "cal_prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in records))


def compare(workdir: Path, device: str = "cpu", rows: tuple[str, ...] = tuple(SETTINGS)) -> dict:
    from featcal_llm.pipeline import run_recipe

    quiet_transformers()
    results = json.loads((workdir / "results.json").read_text())
    tasks = tuple(results["config"]["tasks"])
    scores = {row: results["test"][row] for row in (*(f"expert:{t}" for t in tasks), MERGED_ROW)}
    base = yaml.safe_load((workdir / RECIPE_FILE).read_text())
    _write_prompts(workdir, tasks)
    report = {}
    for row in rows:
        recipe = _recipe_for(base, row, SETTINGS[row], tasks)
        path = workdir / f"recipe-{_slug(row)}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        generated = workdir / "featcal_generated"
        before = {p.name: p.stat().st_mtime_ns for p in generated.glob("*.json")} if generated.exists() else {}
        started = time.perf_counter()
        with contextlib.chdir(workdir):
            run_recipe(Path(path.name), force=True, device=device)
        elapsed = time.perf_counter() - started
        fresh = [p for p in generated.glob("*.json") if before.get(p.name) != p.stat().st_mtime_ns] if generated.exists() else []
        generation = sum(json.loads(p.read_text())["seconds"] for p in fresh)
        scores[row] = _score_model(workdir / recipe["featcal"]["output"], workdir / "data", tasks, ("test",), device)["test"]
        recovery = gap_recovery(scores, list(tasks), MERGED_ROW, row)
        report[row] = {"scores": scores[row], "recovered": recovery["recovered"], "generation_s": round(generation, 1),
                       "calibration_s": round(elapsed - generation, 1), "recipe": path.name}
        print(f"{row}: {scores[row]}  recovered {recovery['recovered']:.2f}", flush=True)
    return {"tasks": tasks, "merged": scores[MERGED_ROW], "experts": {t: scores[f"expert:{t}"][t] for t in tasks}, "rows": report}


def markdown(result: dict) -> str:
    tasks = result["tasks"]
    lines = [f"| calibration data | {' | '.join(tasks)} | recovered | generation | calibration |",
             "|---|" + "---:|" * (len(tasks) + 3)]
    merged = " | ".join(f"{result['merged'][t]:.1f}" for t in tasks)
    lines.append(f"| (merged, no calibration) | {merged} | | | |")
    for row, entry in result["rows"].items():
        cells = " | ".join(f"{entry['scores'][t]:.1f}" for t in tasks)
        lines.append(f"| {row} | {cells} | {100 * entry['recovered']:.0f} % | {entry['generation_s']:.0f} s | {entry['calibration_s']:.0f} s |")
    experts = " | ".join(f"{result['experts'][t]:.1f}" for t in tasks)
    lines.append(f"| (experts, own task) | {experts} | | | |")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), default="demo-work", show_default=True,
              help="A finished demo workdir (python -m featcal_llm demo --workdir ...).")
@click.option("--device", default="cpu", show_default=True)
def main(workdir: Path, device: str) -> None:
    """Calibrate the demo's merge on real vs self-generated data and print the table."""
    if not (workdir / "results.json").is_file():
        raise click.UsageError(f"{workdir}: no results.json; run `python -m featcal_llm demo --workdir {workdir}` first")
    result = compare(workdir.resolve(), device)
    (workdir / "generated.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (workdir / "generated.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
