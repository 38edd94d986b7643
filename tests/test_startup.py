"""Start-up (issue 11): the run reaches its progress bar without the `datasets` stack for local JSON-lines data,
and the plain-JSONL reader that makes this possible returns exactly the records `datasets` returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from featcal_llm.io import data
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.tiny import build_char_tokenizer

# Read by the plain-JSONL path: flat string records, same keys in the same order on every line.
PLAIN = {
    "ascii": ['{"text": "the merge of experts"}', '{"text": "loses skill"}'],
    "escapes and unicode": [
        r'{"text": "h\u00e9llo \u2028 tab\there\r\nnul\u0000 quote\" slash\\ \ud83d\ude42", "b": ""}',
        '{"text": "日本語 🙂 ", "b": "2024-1-1 is no date for Arrow"}',
    ],
    "crlf and spaces": ['  {"text": "a", "other": "1"}  \r', '{"text":"b","other":"2"}\r'],
    "looks like other JSON": ['{"text": "1"}', '{"text": "1e5"}', '{"text": "true"}', '{"text": "null"}', '{"text": "[1]"}'],
    "alpaca": [
        '{"instruction": "add", "input": "1 2", "response": "3"}',
        '{"instruction": "greet", "input": "", "response": "hi"}',
    ],
}
# Left to `datasets`: it types, fills, nests or rejects these, and the reader must not guess how.
LEFT_TO_DATASETS = {
    "numbers": ['{"text": "a", "n": 1}', '{"text": "b", "n": 2.5}'],
    "null": ['{"text": "a", "input": null}'],
    "nested": ['{"messages": [{"role": "user", "content": "x"}]}'],
    "object value": ['{"text": "a", "meta": {"k": "v"}}'],
    "ragged keys": ['{"text": "a"}', '{"text": "b", "input": "c"}'],
    "key order": ['{"a": "1", "text": "x"}', '{"text": "y", "a": "2"}'],
    "date-like strings": ['{"text": "2024-01-01"}', '{"text": "2024-01-02 10:00:00"}'],
    "date-time string": ['{"text": "not a date"}', '{"text": "2024-01-01T10:00"}'],
    "blank line": ['{"text": "a"}', "", '{"text": "b"}'],
    "lone surrogate": [r'{"text": "\ud800"}'],
    "duplicate key": ['{"text": "1", "text": "2"}'],
    "array line": ['["a", "b"]'],
    "no keys": ["{}"],
}


def _write(tmp_path: Path, name: str, lines: list[str], suffix: str = ".jsonl") -> Path:
    path = tmp_path / (name.replace(" ", "_") + suffix)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _datasets_records(path: Path) -> list[dict] | str:
    import datasets

    datasets.disable_progress_bars()
    try:
        return [dict(record) for record in datasets.load_dataset("json", data_files=str(path), split="train")]
    except Exception as error:  # some inputs are errors for datasets too; the reader must then not accept them
        return f"error: {type(error).__name__}"


@pytest.mark.parametrize("name", [*PLAIN, *LEFT_TO_DATASETS])
def test_plain_jsonl_records_equal_datasets_or_defer(tmp_path, name):
    lines = PLAIN.get(name) or LEFT_TO_DATASETS[name]
    path = _write(tmp_path, name, lines)
    records = data.plain_jsonl_records(path)
    if name in PLAIN:
        assert records is not None, name
        assert records == _datasets_records(path)
        assert [list(record) for record in records] == [list(record) for record in _datasets_records(path)]  # key order too
    else:
        assert records is None, (name, records)


def test_plain_jsonl_reader_ignores_other_files(tmp_path):
    assert data.plain_jsonl_records(_write(tmp_path, "array", ['[{"text": "a"}]'], ".json")) is None
    assert data.plain_jsonl_records(tmp_path / "missing.jsonl") is None
    (tmp_path / "empty.jsonl").write_text("")
    assert data.plain_jsonl_records(tmp_path / "empty.jsonl") is None
    (tmp_path / "bom.jsonl").write_text('\ufeff{"text": "a"}\n', encoding="utf-8")
    assert data.plain_jsonl_records(tmp_path / "bom.jsonl") is None


@pytest.mark.parametrize("shuffle", [False, True])
def test_calibration_tokens_identical_to_the_datasets_path(tmp_path, monkeypatch, shuffle):
    """Text and alpaca formats, samples cut and relative paths: the same token ids with and without the reader."""
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": f"record {i} é ✓ {'ab' * i}"}) + "\n" for i in range(9)))
    _write(tmp_path, "alpaca", PLAIN["alpaca"] * 3)
    specs = {
        "a": DataSpec(path="texts.jsonl", samples=5),  # relative to the recipe's directory
        "b": DataSpec(path=str(tmp_path / "alpaca.jsonl"), format="alpaca"),
    }
    tokenizer = build_char_tokenizer()
    arguments = (specs, ["a", "b"], tokenizer, 4, 512, shuffle, 3, tmp_path / "recipe.yaml")  # room for the alpaca responses
    loaded = []
    original = data.load_records
    monkeypatch.setattr(data, "load_records", lambda *a, **k: loaded.append(a[1]) or original(*a, **k))
    fast = data.calibration_sequences(*arguments)
    assert len(loaded) == (2 if shuffle else 0)  # shuffling is datasets' (its permutation), never re-implemented
    monkeypatch.setattr(data, "plain_jsonl_records", lambda path: None)
    slow = data.calibration_sequences(*arguments)
    assert slow == fast and [r.response_from for r in slow["b"]] == [r.response_from for r in fast["b"]]  # alpaca: judged from there
    assert [len(fast["a"]), len(fast["b"])] == [5, 4] and all(0 < r.response_from < len(r) for r in fast["b"])


# Runs `featcal-llm run RECIPE --force` in-process and reports the state at the moment the progress bar is created.
PROBE = textwrap.dedent(
    """
    import gc, json, os, sys
    import tqdm.auto

    full = []
    gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))

    class ProgressBar(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            heavy = ("datasets", "pyarrow", "pandas", "matplotlib", "lm_eval", "featcal_llm.demo", "featcal_llm.benchmark")
            state = {"heavy": [m for m in heavy if m in sys.modules], "full_collections": len(full),
                     "gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
            print(json.dumps(state), flush=True)
            os._exit(0)

    tqdm.auto.tqdm = ProgressBar
    from featcal_llm.cli import main

    main(["run", sys.argv[1], "--force"])
    """
)


def test_run_reaches_the_progress_bar_without_heavy_imports_or_full_collections(merged_scenario, tmp_path):
    """The whole path to the first layer (recipe, configs, tokenizer, local JSONL data, checkpoints, runner):
    no `datasets` stack, and the collector never traverses the imported libraries (issue 11, start-up)."""
    recipe = merged_scenario.write_recipe(tmp_path / "recipe.yaml", output=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-c", PROBE, str(recipe)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    state = json.loads(result.stdout)
    assert state["heavy"] == []
    assert state["full_collections"] == 0  # 6-7 before (≈ 1 s of the start-up)
    assert state["gc_enabled"] and state["frozen"] > 100_000  # torch, transformers and mergekit are frozen, the loop collects


def test_heavy_import_pauses_the_collector_and_restores_it():
    """A library caller keeps its collector: paused during a first import, re-enabled, nothing frozen outside the CLI's block."""
    code = textwrap.dedent(
        """
        import gc, json, sys
        from featcal_llm.startup import freezing_imports, heavy_import

        runs = []
        gc.callbacks.append(lambda phase, info: phase == "start" and runs.append(info["generation"]))
        module = heavy_import("torch")
        state = {"during": len(runs), "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
        state["same"] = heavy_import("torch") is module
        fresh = ["safetensors.torch", "tqdm.auto", "yaml"]
        state["fresh"] = [name in sys.modules for name in fresh]
        with freezing_imports():
            heavy_import(fresh[0])
        state["frozen_in_block"] = gc.get_freeze_count() > 100_000
        gc.unfreeze()
        heavy_import(fresh[1])
        state["frozen_after_block"] = gc.get_freeze_count()
        gc.disable()
        heavy_import(fresh[2])
        state["left_disabled"] = not gc.isenabled()
        print(json.dumps(state))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == {
        "during": 0, "enabled": True, "frozen": 0, "same": True, "fresh": [False, False, False],
        "frozen_in_block": True, "frozen_after_block": 0, "left_disabled": True,
    }


def test_a_child_python_finds_a_checkout_through_pythonpath_but_an_install_through_its_site(monkeypatch):
    """From a checkout its folder goes first on the child's PYTHONPATH; installed, site-packages is not put there, where
    it would come before the standard library."""
    import site
    from pathlib import Path

    from featcal_llm import startup

    root = str(Path(startup.__file__).resolve().parents[1])
    monkeypatch.setattr(site, "getsitepackages", lambda: ["/nowhere/site-packages"])
    monkeypatch.setattr(site, "getusersitepackages", lambda: "/nowhere/user")
    assert startup.child_environment({"PYTHONPATH": "/x"})["PYTHONPATH"] == f"{root}{os.pathsep}/x"
    assert startup.child_environment({})["PYTHONPATH"] == root
    monkeypatch.setattr(site, "getsitepackages", lambda: ["/nowhere/site-packages", root])  # the package installed there
    assert startup.child_environment({"PYTHONPATH": "/x", "A": "1"}) == {"PYTHONPATH": "/x", "A": "1"}
    assert "PYTHONPATH" not in startup.child_environment({})
