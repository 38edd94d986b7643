"""What `run` found only once torch started, the records were read or the merge was checked, `validate` says first.

Each case: `validate` and `run` print the same line and exit 2; then, with validate's check switched off, `run`'s own
refusal (the merge check, the held-out split after tokenising, torch's device check) says the same words, so the two
cannot drift apart.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import featcal_llm.io.merge as merge_module
import featcal_llm.io.merge_identity as merge_identity
import featcal_llm.io.validate as validate_module
from featcal_llm.cli import main
from featcal_llm.errors import FeatCalError
from featcal_llm.io.merge_identity import MARKER, MERGEKIT_CONFIG
from featcal_llm.io.validate import check_recipe


def _write(scenario, tmp_path: Path, name: str = "r.yaml", **featcal) -> Path:
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"].update(output=str(tmp_path / "out"), merged=str(tmp_path / "merged"), **featcal)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _errors(result) -> list[str]:
    return [line.removeprefix("featcal-llm: error: ") for line in result.stderr.splitlines() if line.startswith("featcal-llm: error: ")]


def _both_refuse(path: Path, *run_arguments: str) -> list[str]:
    validated = CliRunner().invoke(main, ["validate", str(path)])
    ran = CliRunner().invoke(main, ["run", str(path), *run_arguments])
    assert validated.exit_code == 2 and ran.exit_code == 2, (validated.output, ran.output, ran.exception)
    assert _errors(ran) == _errors(validated)
    return _errors(validated)


def _supplied_merge(merged_scenario, tmp_path: Path, configuration: str) -> Path:
    """The scenario's merge as if mergekit-yaml had made it (no featcal-llm marker), its configuration file replaced."""
    supplied = tmp_path / "merged"
    shutil.copytree(merged_scenario.root / "merged", supplied, copy_function=os.symlink)
    (supplied / MARKER).unlink()
    (supplied / MERGEKIT_CONFIG).unlink()
    (supplied / MERGEKIT_CONFIG).write_text(configuration)
    merge_module._settled.clear()  # a new process
    return supplied


def _merge_part(scenario, **changes) -> dict:
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe.pop("featcal")
    recipe.update(changes)
    return recipe


def test_a_supplied_merge_of_another_configuration(merged_scenario, tmp_path, monkeypatch):
    other = _merge_part(merged_scenario)
    other["models"][0]["parameters"]["weight"] = 0.3
    supplied = _supplied_merge(merged_scenario, tmp_path, yaml.safe_dump(other))
    path = _write(merged_scenario, tmp_path)
    errors = _both_refuse(path)
    assert errors == [f"{path}: featcal.merged: {supplied} was merged from another configuration (its {MERGEKIT_CONFIG} differs in "
                      "models[0].parameters.weight); remove it to merge again, or point featcal.merged elsewhere"]
    monkeypatch.setattr(merge_identity, "check_supplied_merge", lambda *args: None)  # run's own check, after the data
    assert check_recipe(path, plan=False).problems == []
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert ran.exit_code == 2 and _errors(ran) == errors, ran.output


def test_a_supplied_merge_whose_configuration_file_is_not_mergekits(merged_scenario, tmp_path, monkeypatch):
    _supplied_merge(merged_scenario, tmp_path, "merge_method: 3\nmodels: nothing\n")
    path = _write(merged_scenario, tmp_path)
    errors = _both_refuse(path)
    assert len(errors) == 1 and errors[0].startswith(f"{path}: featcal.merged: {tmp_path / 'merged' / MERGEKIT_CONFIG}: not a mergekit configuration (")
    monkeypatch.setattr(merge_identity, "check_supplied_merge", lambda *args: None)
    assert _errors(CliRunner().invoke(main, ["run", str(path)])) == errors


def test_a_supplied_merge_naming_moved_experts_is_judged_by_their_files(merged_scenario, tmp_path):
    """Experts named by other paths holding the same files are the same merge (as run judges it); a changed file is not."""
    moved = {}
    for index, expert in enumerate(merged_scenario.experts.values()):
        moved[str(expert)] = tmp_path / f"moved{index}"
        shutil.copytree(expert, moved[str(expert)], copy_function=os.symlink)
    other = _merge_part(merged_scenario)
    for entry in other["models"]:
        entry["model"] = str(moved[entry["model"]])
    _supplied_merge(merged_scenario, tmp_path, yaml.safe_dump(other))
    path = _write(merged_scenario, tmp_path)
    assert check_recipe(path, plan=False).problems == []
    changed = Path(other["models"][1]["model"])
    for shard in changed.glob("*.safetensors"):
        shard.unlink()
        shutil.copy(next(Path(other["models"][0]["model"]).glob(shard.name)), shard)  # another expert's weights
    merge_module._settled.clear()
    problems = check_recipe(path, plan=False).problems
    assert [problem.key for problem in problems] == ["featcal.merged"] and "differs in models[1].model)" in str(problems[0])


@pytest.mark.parametrize("count, short", [(16, False), (15, True), (17, False)])
def test_a_data_file_is_short_only_below_the_records_asked(scenario, tmp_path, count, short):
    """The note counts as run does: a file holding exactly `samples` records gives every one asked for."""
    path_of = tmp_path / "exact.jsonl"
    path_of.write_text("".join(json.dumps({"text": f"record number {i}"}) + "\n" for i in range(count)))
    recipe = yaml.safe_load(scenario.recipe.read_text())
    first = recipe["models"][0]["model"]
    data = {**recipe["featcal"]["data"], first: {"path": str(path_of), "format": "text", "text": "text"}}
    path = _write(scenario, tmp_path, data=data)
    notes = [note for note in check_recipe(path, plan=False).notes if f"featcal.data.{first}:" in note]
    assert notes == ([f"{path}: featcal.data.{first}: 15 records, fewer than the 16 requested; using all of them"] if short else [])


def test_a_data_file_too_short_for_the_held_out_split(scenario, tmp_path, monkeypatch):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": f"record number {i}"}) + "\n" for i in range(3)))
    recipe = yaml.safe_load(scenario.recipe.read_text())
    first = recipe["models"][0]["model"]
    data = {**recipe["featcal"]["data"], first: {"path": str(short), "format": "text", "text": "text"}}
    path = _write(scenario, tmp_path, data=data, refine=True)
    report = check_recipe(path, plan=False)
    assert f"{path}: featcal.data.{first}: 3 records, fewer than the 16 requested; using all of them" in report.notes
    errors = _both_refuse(path)
    assert errors == [f"{path}: featcal.tune.holdout: 0.25 of expert {first}'s 3 records leaves 1 held out and 2 for calibration "
                      "(need at least 2 on each side)"]
    monkeypatch.setattr(validate_module, "short_file_findings", lambda *args: None)  # run's own split, after tokenising
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert ran.exit_code == 2 and _errors(ran) == errors, ran.output
    short.write_text(short.read_text() * 2)  # 6 records: 2 held out, 4 fitted
    monkeypatch.undo()
    assert check_recipe(path, plan=False).problems == []


def _short_file(tmp_path: Path, suffix: str, count: int) -> Path:
    rows = [{"text": f"record number {i}"} for i in range(count)]
    path = tmp_path / f"short{suffix}"
    if suffix == ".csv":
        path.write_text("text\n\n" + "".join(f"{row['text']}\n" for row in rows))  # a blank line, skipped as pandas skips it
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("text", pa.string())])), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n\n" for row in rows))
    return path


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".jsonl"])
def test_the_records_of_csv_parquet_and_large_json_lines_files_are_counted(scenario, tmp_path, monkeypatch, suffix):
    """validate reads only the head of these; the count comes from a pass over the lines or the parquet footer, and is
    the one run gets from `datasets` (the same refusal, the same words)."""
    import featcal_llm.io.validate_data as validate_data

    monkeypatch.setattr(validate_data, "PLAIN_JSONL_MAX_BYTES", 16)  # the JSON-lines file counts as large: its head is read
    short = _short_file(tmp_path, suffix, 3)
    recipe = yaml.safe_load(scenario.recipe.read_text())
    first = recipe["models"][0]["model"]
    data = {**recipe["featcal"]["data"], first: {"path": str(short), "format": "text", "text": "text"}}
    path = _write(scenario, tmp_path, data=data, refine=True)
    assert f"{path}: featcal.data.{first}: 3 records, fewer than the 16 requested; using all of them" in check_recipe(path, plan=False).notes
    assert _both_refuse(path) == [f"{path}: featcal.tune.holdout: 0.25 of expert {first}'s 3 records leaves 1 held out and 2 "
                                  "for calibration (need at least 2 on each side)"]
    _short_file(tmp_path, suffix, 0)  # a header, a footer, or nothing at all
    assert _both_refuse(path) == [f"{path}: featcal.data.{first}.path: {short}: " + ("file is empty" if suffix == ".jsonl" else "no records")]
    monkeypatch.setattr(validate_data, "COUNT_MAX_BYTES", 8)  # too large to count: run counts it
    assert validate_data.record_count(_short_file(tmp_path, suffix, 3)) == (3 if suffix == ".parquet" else None)


def test_a_large_json_document_is_left_to_datasets(tmp_path, monkeypatch):
    """A JSON array of records too large to parse whole is datasets' to read (run reads it); its head is not JSON lines."""
    import featcal_llm.io.validate_data as validate_data

    monkeypatch.setattr(validate_data, "PLAIN_JSONL_MAX_BYTES", 16)
    document = tmp_path / "records.json"
    document.write_text(json.dumps([{"text": f"record number {i}"} for i in range(3)], indent=1))
    assert validate_data.file_head(document, "where") == (None, [], False)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n" * 3)
    with pytest.raises(FeatCalError, match=r"^where: cannot load calibration data \(line 1 is not JSON\)$"):
        validate_data.file_head(garbage, "where")


def test_a_cuda_device_on_a_machine_without_one(scenario, tmp_path, monkeypatch):
    import featcal_llm.hardware as hardware

    monkeypatch.setattr(hardware, "cuda_refusal", lambda: "CUDA is not available (torch is a CPU-only build)")
    path = _write(scenario, tmp_path, device="cuda")
    assert _both_refuse(path) == [f"{path}: featcal.device: cuda requested but CUDA is not available (torch is a CPU-only build)"]
    assert check_recipe(path, plan=False, device="cpu").problems == []  # `run --device cpu` overrides the key
    on_cpu = _write(scenario, tmp_path, "cpu.yaml", device="cpu")
    overridden = CliRunner().invoke(main, ["run", str(on_cpu), "--device", "cuda:1"])
    assert overridden.exit_code == 2 and _errors(overridden) == [
        f"{on_cpu}: --device: cuda:1 requested but CUDA is not available (torch is a CPU-only build)"]
    monkeypatch.setattr(validate_module, "_check_device", lambda *args: None)  # torch's own answer, when run starts
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert ran.exit_code == 2 and _errors(ran) == ["featcal.device: cuda requested but CUDA is not available"], ran.output


@pytest.mark.parametrize("version_file, driver, refusal", [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", True, "torch is a CPU-only build"),
    ("__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", False, "no NVIDIA driver is loaded"),
    ("__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n", True, None),
    ("__version__ = '2.13.0+rocm6.4'\ncuda: Optional[str] = None\nhip: Optional[str] = '6.4.1'\n", False, None),
])
def test_what_torch_was_built_for_decides_the_cuda_refusal(version_file, driver, refusal):
    from featcal_llm.hardware import cuda_refusal_for

    said = cuda_refusal_for(version_file, driver)
    assert said == (None if refusal is None else f"CUDA is not available ({refusal})")


def test_a_supplied_merge_naming_a_hub_model_is_left_to_run(merged_scenario, tmp_path):
    """run resolves hub references to their snapshots before comparing; validate, offline, cannot, so it refuses nothing."""
    other = _merge_part(merged_scenario)
    other["models"][0]["model"] = "someone/expert0"
    _supplied_merge(merged_scenario, tmp_path, yaml.safe_dump(other))
    assert check_recipe(_write(merged_scenario, tmp_path), plan=False).problems == []
