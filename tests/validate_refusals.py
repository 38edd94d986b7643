"""The refusals docs/validate.md lists: each bad recipe, what `validate` says and what `run` says, and validate's CPU time.

A tiny local setup (models/, data/, recipes with relative paths, so every line reads the same on any machine).
`python tests/validate_refusals.py` (from the repository root) runs both commands on each recipe in a fresh
process and prints the doc's table with the CPU time (user + system) each `validate` took;
tests/test_validate_agrees.py checks that the doc's lines are what the code says today.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import yaml

sys.path.insert(0, str(Path(__file__).parent))

EXPERTS = ("code", "math", "chat")


def build(root: Path) -> dict:
    """models/{base,code,math,chat} and data/*.jsonl under `root`; returns the clean recipe (relative paths)."""
    from scenario import build_scenario

    scenario = build_scenario(root / "setup")
    (root / "models").mkdir()
    (root / "data").mkdir()
    os.symlink(scenario.base, root / "models" / "base")
    for name, (expert, data) in zip(EXPERTS, zip(scenario.experts.values(), scenario.data.values())):
        os.symlink(expert, root / "models" / name)
        shutil.copy(data, root / "data" / f"{name}.jsonl")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["base_model"] = "models/base"
    recipe["models"] = [{"model": f"models/{name}", "parameters": {"weight": 0.5}} for name in EXPERTS]
    recipe["featcal"].update(merged="merged", output="out",
                             data={f"models/{name}": {"path": f"data/{name}.jsonl", "format": "text", "text": "text"} for name in EXPERTS})
    return recipe


def _files_beside(folder: Path, root: Path) -> None:
    """Weights and tokenizer files, so that the config is the one problem (never read: both commands refuse first)."""
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a safetensors file of no tensors
    for item in (root / "models" / "base").iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            os.symlink(item.resolve(), folder / item.name)


def _mixtral(recipe: dict, root: Path) -> None:
    base = root / "models" / "mixtral"
    base.mkdir(exist_ok=True)
    config = json.loads((root / "models" / "base" / "config.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    (base / "config.json").write_text(json.dumps(config))
    _files_beside(base, root)
    for name in EXPERTS:
        (root / "models" / f"{name}-mixtral").mkdir(exist_ok=True)
        (root / "models" / f"{name}-mixtral" / "config.json").write_text(json.dumps(config))
        _files_beside(root / "models" / f"{name}-mixtral", root)
    recipe["base_model"] = "models/mixtral"
    for entry in recipe["models"]:
        entry["model"] += "-mixtral"
    recipe["featcal"]["data"] = {f"{key}-mixtral": spec for key, spec in recipe["featcal"]["data"].items()}


def _wider(recipe: dict, root: Path) -> None:
    wide = root / "models" / "math-wide"
    wide.mkdir(exist_ok=True)
    config = json.loads((root / "models" / "math" / "config.json").read_text())
    config["hidden_size"] += 8
    (wide / "config.json").write_text(json.dumps(config))
    _files_beside(wide, root)
    recipe["models"][1]["model"] = "models/math-wide"
    recipe["featcal"]["data"]["models/math-wide"] = recipe["featcal"]["data"].pop("models/math")


def _fields(recipe: dict, root: Path) -> None:
    (root / "data" / "qa.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    recipe["featcal"]["data"]["models/math"].update(path="data/qa.jsonl", format="alpaca")


def _conversational(recipe: dict, root: Path) -> None:
    row = {"prompt": [{"role": "user", "content": "1+1"}], "completion": [{"role": "assistant", "content": "2"}]}
    (root / "data" / "trl.jsonl").write_text(json.dumps(row) + "\n")
    recipe["featcal"]["data"]["models/math"].update(path="data/trl.jsonl", format="completion")


def _short_for_refine(recipe: dict, root: Path) -> None:
    (root / "data" / "short.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(3)))
    recipe["featcal"]["data"]["models/math"].update(path="data/short.jsonl")
    recipe["featcal"]["refine"] = True


def _tied_phi3(recipe: dict, root: Path) -> None:
    """Phi-4-mini's layout: Phi3ForCausalLM with `tie_word_embeddings`, no `lm_head.weight` stored (mergekit's phi3
    definition requires one)."""
    from scenario import build_scenario

    scenario = build_scenario(root / "phi3-setup", experts=3, layers=1, samples=4, family="phi3", tie_word_embeddings=True)
    os.symlink(scenario.base, root / "models" / "phi3-tied", target_is_directory=True)
    recipe["base_model"] = "models/phi3-tied"
    for name, entry, expert in zip(EXPERTS, recipe["models"], scenario.experts.values()):
        os.symlink(expert, root / "models" / f"{name}-phi3-tied", target_is_directory=True)
        entry["model"] = f"models/{name}-phi3-tied"
    recipe["featcal"]["data"] = {f"{key}-phi3-tied": spec for key, spec in recipe["featcal"]["data"].items()}


def _text(edit: Callable[[str], str]) -> Callable[[dict, Path], str]:
    return lambda recipe, _root: edit(yaml.safe_dump(recipe, sort_keys=False))


def _change(edit: Callable[[dict], object]) -> Callable[[dict, Path], None]:
    def mutate(recipe: dict, _root: Path) -> None:
        edit(recipe)
    return mutate


def _hub_expert(recipe: dict, _root: Path) -> None:
    recipe["models"][2]["model"] = "someone/chat-expert"
    recipe["featcal"]["data"]["someone/chat-expert"] = recipe["featcal"]["data"].pop("models/chat")


# slug → (what is wrong, the mutation: edits the recipe dict, or returns the file's text; extra arguments of run)
CASES: dict[str, tuple[str, Callable, list[str]]] = {
    "yaml-syntax": ("YAML syntax error", _text(lambda t: t.replace("merge_method: task_arithmetic", "merge_method: [task_arithmetic")), []),
    "duplicate-key": ("a key given twice", _text(lambda t: t.replace("  samples: 16\n", "  samples: 16\n  samples: 64\n")), []),
    "featcall": ("the block's name misspelt", _change(lambda r: r.update(featcall=r.pop("featcal"))), []),
    "featcal-key": ("a `featcal:` key misspelt", _change(lambda r: r["featcal"].update(lamda=r["featcal"].pop("lambda"))), []),
    "method-typo": ("a merge method misspelt", _change(lambda r: r.update(merge_method="task_arithmatic")), []),
    "slerp": ("a merge FeatCal cannot calibrate", _change(lambda r: r.update(merge_method="slerp")), []),
    "parameter-typo": ("a mergekit parameter misspelt", _change(lambda r: r["models"][0].update(parameters={"wieght": 0.5})), []),
    "parameter-type": ("a mergekit parameter of the wrong type", _change(lambda r: r["models"][0].update(parameters={"weight": "half"})), []),
    "global-parameter": ("a global mergekit parameter given per model", _change(lambda r: r["models"][0]["parameters"].update({"lambda": 1.0})), []),
    "nuslerp-three": ("more experts than the method merges", _change(lambda r: r.update(merge_method="nuslerp")), []),
    "mixtral": ("an unsupported architecture (Mixtral)", _mixtral, []),
    "modules-typo": ("`featcal.modules` naming no projection", _change(lambda r: r["featcal"].update(modules=["q_prj"])), []),
    "per-layer-depth": ("replayed `per_layer` values for another depth", _change(lambda r: r["featcal"].update(
        {key: {"per_layer": [value] * 2} for key, value in (("lambda", 1e-3), ("alpha", 0.3), ("rho", 0.5))})), []),
    "model-typo": ("a model path misspelt", _change(lambda r: r["models"][1].update(model="models/mth")), []),
    "data-missing": ("a calibration file that is not there", _change(lambda r: r["featcal"]["data"]["models/code"].update(path="data/cod.jsonl")), []),
    "data-fields": ("records without the fields their format reads", _fields, []),
    "data-not-text": ("records whose text fields are not text (TRL's conversational prompt/completion)", _conversational, []),
    "other-shape": ("an expert of another shape", _wider, []),
    "phi3-tied": ("a model lacking a tensor mergekit's architecture requires (Phi-4-mini's tied head)", _tied_phi3, []),
    "data-short": ("a data file too short for `refine:`'s held-out split", _short_for_refine, []),
    "push-no-login": ("`--push-to-hub` without a Hugging Face login", _change(lambda r: None), ["--push-to-hub", "me/merged-featcal"]),
}
# slug → (the situation, the mutation, extra arguments of validate): validate exits 0 with a note
NOTES: dict[str, tuple[str, Callable, list[str]]] = {
    "hub-offline": ("`--online` without a network (a hub id among the experts)", _hub_expert, ["--online"]),
}


def write_cases(root: Path, recipe: dict) -> dict[str, Path]:
    """Each case's recipe file, `SLUG.yaml` under `root`, plus the clean one."""
    paths = {}
    for slug, (_, mutate, _) in {"clean": ("", _change(lambda r: None), []), **CASES, **NOTES}.items():
        copy = yaml.safe_load(yaml.safe_dump(recipe))
        text = mutate(copy, root)
        paths[slug] = root / f"{slug}.yaml"
        paths[slug].write_text(text if isinstance(text, str) else yaml.safe_dump(copy, sort_keys=False))
    return paths


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("featcal-llm: ")]


def measure(root: Path, command: list[str]) -> tuple[list[str], float, int]:
    """(featcal-llm's message lines, CPU seconds of the child, exit code) of one command in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "HF_HOME": str(root / "hf-home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "featcal_llm", *command], capture_output=True, text=True, cwd=root, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return _lines(result.stderr), cpu, result.returncode


def _code(line: str) -> str:
    text = line.removeprefix("featcal-llm: ").replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _cell(lines: list[str]) -> str:
    return "<br>".join(_code(line) for line in lines) or "—"


def table(root: Path, repeats: int = 3) -> str:
    """The doc's table: every case's lines from both commands, and validate's median CPU time over `repeats` runs."""
    recipe = build(root)
    paths = write_cases(root, recipe)

    def cpu(arguments: list[str]) -> tuple[list[str], float]:
        runs = [measure(root, arguments) for _ in range(repeats)]
        return runs[0][0], sorted(run[1] for run in runs)[repeats // 2]

    rows = ["| what is wrong | `featcal-llm validate` says | `featcal-llm run` says | validate CPU s |", "|---|---|---|---|"]
    lines, seconds = cpu(["validate", paths["clean"].name])
    rows.append(f"| nothing (a clean recipe) | `{paths['clean'].name}: ok` (exit 0) | merges and calibrates | {seconds:.2f} |")
    for slug, (what, _, extra) in CASES.items():
        lines, seconds = cpu(["validate", paths[slug].name])
        ran = measure(root, ["run", paths[slug].name, *extra])[0]
        shown = "(no `--push-to-hub` option: nothing to check)" if extra else _cell([line for line in lines if ": error: " in line])
        rows.append(f"| {what} | {shown} | {_cell([line for line in ran if ': error: ' in line])} | {seconds:.2f} |")
    for slug, (what, _, extra) in NOTES.items():
        lines, seconds = cpu(["validate", paths[slug].name, *extra])
        ran = measure(root, ["run", paths[slug].name])[0]
        rows.append(f"| {what} | {_cell(lines)} (exit 0) | {_cell([line for line in ran if ': error: ' in line])} | {seconds:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        print(table(Path(directory)))
