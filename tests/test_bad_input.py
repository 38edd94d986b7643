"""Bad input: one line naming the culprit, a non-zero exit, nothing written (issue 2, proof 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.tiny import build_char_tokenizer, new_tiny_llama, save_model, tiny_llama_config


def _recipe(scenario, tmp_path, mutate) -> tuple:
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    mutate(recipe, tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, tmp_path / "out"


def _drop_data(recipe, _):
    recipe["featcal"]["data"].pop(recipe["models"][1]["model"])


def _unknown_key(recipe, _):
    recipe["featcal"]["lamda"] = 0.1


def _missing_file(recipe, tmp_path):
    first = recipe["models"][0]["model"]
    recipe["featcal"]["data"][first]["path"] = str(tmp_path / "nowhere.jsonl")


def _mismatched_expert(recipe, tmp_path):
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer), num_hidden_layers=3, intermediate_size=96)
    odd = save_model(new_tiny_llama(config, seed=5), tokenizer, tmp_path / "odd-expert")
    old = recipe["models"][2]["model"]
    recipe["models"][2]["model"] = str(odd)
    recipe["featcal"]["data"][str(odd)] = recipe["featcal"]["data"].pop(old)


CASES = {
    "missing data entry": (_drop_data, ["bad.yaml: featcal.data", "no calibration data for expert", "expert1"]),
    "unknown key": (_unknown_key, ["bad.yaml: featcal.lamda: unknown key"]),
    "missing calibration file": (_missing_file, ["bad.yaml: featcal.data.", "nowhere.jsonl", "not found"]),
    "mismatched expert shapes": (_mismatched_expert, ["odd-expert/config.json", "intermediate_size = 96"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line(scenario, tmp_path, case):
    mutate, expected = CASES[case]
    recipe, output = _recipe(scenario, tmp_path, mutate)
    result = CliRunner().invoke(main, ["run", str(recipe)])
    message = result.stderr.strip() if hasattr(result, "stderr") else result.output.strip()
    assert result.exit_code != 0
    assert len(message.splitlines()) == 1, message
    assert message.startswith("featcal-llm: error: ")
    for fragment in expected:
        assert fragment in message, (fragment, message)
    assert not output.exists()
    assert not any(p.name.endswith("featcal-partial") for p in tmp_path.iterdir())


def test_existing_output_is_refused_without_force(scenario, tmp_path):
    recipe, output = _recipe(scenario, tmp_path, lambda r, _: None)
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    result = subprocess.run([sys.executable, "-m", "featcal_llm", "run", str(recipe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("already exists (pass --force to replace it)")
    assert (output / "keep.txt").read_text() == "mine"
