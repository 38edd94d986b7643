"""What the tests of `validate` agreeing with `run` share (tests/test_validate_agrees.py and tests/test_agree_*.py): the
scenario's recipe edited, written, and asked of both commands."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml
from click.testing import CliRunner

from featcal_llm.cli import main


def recipe_of(scenario, tmp_path: Path) -> dict:
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(output=str(tmp_path / "out"), merged=str(tmp_path / "merged"))
    return recipe


def expert_of(recipe: dict, index: int) -> str:
    return recipe["models"][index]["model"]


def expert_with_a_quantization_config(r, t):
    """An expert whose config.json still declares bitsandbytes 4-bit over plain weights (a merge_and_unload leftover)."""
    expert = t / "quantized"
    shutil.copytree(r["models"][1]["model"], expert, copy_function=os.symlink)
    config = json.loads((expert / "config.json").read_text())
    (expert / "config.json").unlink()
    (expert / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}))
    r["featcal"]["data"][str(expert)] = r["featcal"]["data"].pop(r["models"][1]["model"])
    r["models"][1]["model"] = str(expert)


def first_data_file(r, t, name: str, text: str) -> None:
    (t / name).write_text(text, encoding="utf-8")
    r["featcal"]["data"][expert_of(r, 0)] = {"path": str(t / name)}


def dataset_directory(r, t, files: dict[str, str], **keys) -> None:
    """The first expert's records from a local dataset directory, whose layout datasets reads from its file names."""
    (t / "ds").mkdir()
    for name, text in files.items():
        (t / "ds" / name).write_text(text, encoding="utf-8")
    r["featcal"]["data"][expert_of(r, 0)] = {"path": str(t / "ds"), **keys}


def without_chat_template(source: str, folder: Path) -> str:
    shutil.copytree(source, folder, symlinks=True, ignore=shutil.ignore_patterns("chat_template.jinja"))
    return str(folder)


def model_path_typo(r, _t):
    r["models"][1]["model"] += "x"  # featcal.data still names the right directory


def write_edited(scenario, tmp_path: Path, mutate) -> Path:
    recipe = recipe_of(scenario, tmp_path)
    text = mutate(recipe, tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(text if isinstance(text, str) else yaml.safe_dump(recipe, sort_keys=False))
    return path


def error_lines(result) -> list[str]:
    return [line.removeprefix("featcal-llm: error: ") for line in result.stderr.splitlines() if line.startswith("featcal-llm: error: ")]


def refused_alike(recipe: dict | None, tmp_path: Path) -> list[str]:
    """Writes `recipe` to r.yaml (None: it is written already), then asks validate and run: both refuse it, exit 2,
    in the same one line and no traceback, writing no output. Returns that line, as a list."""
    path = tmp_path / "r.yaml"
    if recipe is not None:
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert isinstance(ran.exception, SystemExit), repr(ran.exception)  # a one-line refusal, not a traceback
    assert validated.exit_code == ran.exit_code == 2, (validated.output, ran.output)
    assert len(error_lines(validated)) == 1 and error_lines(ran) == error_lines(validated), (validated.output, ran.output)
    assert not (tmp_path / "out").exists()
    return error_lines(validated)


def expert_of_other_token_ids(recipe: dict, index: int, folder: Path) -> Path:
    """Expert `index` copied to `folder` with a tokenizer of the same characters at other ids (the tiny character
    tokenizer built over the reversed alphabet), named so in the recipe's models and data."""
    import featcal_llm.tiny as tiny

    expert = recipe["models"][index]["model"]
    shutil.copytree(expert, folder)
    characters = tiny.CHARACTERS
    try:
        tiny.CHARACTERS = characters[::-1]
        tiny.build_char_tokenizer().save_pretrained(folder)
    finally:
        tiny.CHARACTERS = characters
    recipe["models"][index]["model"] = str(folder)
    recipe["featcal"]["data"] = {str(folder) if key == str(expert) else key: value for key, value in recipe["featcal"]["data"].items()}
    return folder
