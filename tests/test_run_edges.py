"""A run at its edges: records longer than the model's positions, the evaluation after the run (started once the run's
models are released; failed, then run alone by --eval-only), and an expert of another vocabulary beside an existing
merge."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.io.run_record import read_run_record
from test_outputs import TABLE


def test_records_longer_than_the_models_positions_are_warned_of(small, tmp_path):
    """A max_length above max_position_embeddings (512 here) lets records calibrate at positions the model never had."""
    import json

    import featcal_llm

    raw = yaml.safe_load(small.recipe.read_text())
    first = raw["models"][0]["model"]
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "a b " * 200}) + "\n" + json.dumps({"text": "c d"}) + "\n")
    raw["featcal"]["data"][first] = {"path": str(tmp_path / "long.jsonl")}
    raw["featcal"].update(output=str(tmp_path / "out"), merged=str(small.root / "merged"), modules=["q_proj"], max_length=1024)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    warnings = featcal_llm.calibrate(tmp_path / "r.yaml", progress=False).warnings
    assert any("featcal.max_length: records of up to 800 tokens are longer than the base model's max_position_embeddings "
               "512; set max_length to 512 or less" in warning for warning in warnings), warnings


@pytest.mark.parametrize("text, longest", [("a b " * 128, 512), ("a b " * 128 + "a", 513)])
def test_records_as_long_as_the_models_positions_are_not_warned_of_and_one_more_token_is(small, tmp_path, text, longest):
    """The bound is max_position_embeddings itself (512 here): a record of 512 tokens uses positions 0-511, all trained;
    one of 513 does not."""
    import json

    import featcal_llm

    raw = yaml.safe_load(small.recipe.read_text())
    first = raw["models"][0]["model"]
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "c d"}) + "\n")
    raw["featcal"]["data"][first] = {"path": str(tmp_path / "long.jsonl")}
    raw["featcal"].update(output=str(tmp_path / "out"), merged=str(small.root / "merged"), modules=["q_proj"], max_length=1024)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    warnings = featcal_llm.calibrate(tmp_path / "r.yaml", progress=False).warnings
    said = [warning for warning in warnings if "max_position_embeddings" in warning]
    if longest == 512:
        assert said == [], said
    else:
        assert len(said) == 1 and "records of up to 513 tokens are longer than the base model's max_position_embeddings 512" in said[0]


def test_the_evaluation_starts_after_the_runs_models_and_streams_are_released(small, tmp_path, monkeypatch):
    """vLLM asks for a share of the GPU's free memory: by the time `eval:` starts, the run's context (its readers, the
    hidden-state streams, the statistics workspace, the layer runner on the device) is no longer referenced and the
    caching allocator has been emptied, with the checkpoint already in place."""
    import gc
    import weakref

    import featcal_llm
    import featcal_llm.evaluation
    import featcal_llm.pipeline as pipeline

    contexts, released, seen = [], [], []
    build = pipeline.run_context
    monkeypatch.setattr(pipeline, "run_context", lambda *a, **k: contexts.append(weakref.ref(context := build(*a, **k))) or context)
    release = pipeline.release_memory
    monkeypatch.setattr(pipeline, "release_memory", lambda: released.append(True) or release())

    def evaluated(section, merged_dir, calibrated_dir, recipe_dir, echo=None):
        gc.collect()  # what is left is held by a reference, not waiting for a collection
        locked = (Path(calibrated_dir).parent / f".{Path(calibrated_dir).name}.featcal-lock").is_file()  # a --force run waits
        seen.append((len(released), [ref() is None for ref in contexts], (Path(calibrated_dir) / "config.json").is_file(), locked))
        from featcal_llm.evaluation.compare import AfterCalibration

        return AfterCalibration(TABLE, {})

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration", evaluated)
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"),
                                eval={"tasks": ["arc_challenge"], "backend": {"name": "hf"}})
    assert featcal_llm.calibrate(recipe, progress=False).evaluation == TABLE
    assert seen == [(1, [True], True, True)]


def test_an_evaluation_that_failed_after_the_run_is_run_alone_by_eval_only(small, tmp_path, monkeypatch):
    """The run's checkpoint is complete when its `eval:` fails (a missing package, a bad engine argument): the error says
    so and names `run --eval-only`, which scores the output beside the merge and adds the table to its card without
    calibrating again; refused in one line without an `eval:` block or a finished output."""
    from click.testing import CliRunner

    import featcal_llm.evaluation
    import featcal_llm.pipeline as pipeline
    from featcal_llm.cli import main
    from featcal_llm.errors import RunFailure
    from featcal_llm.evaluation.compare import AfterCalibration

    def failing(section, merged_dir, calibrated_dir, recipe_dir, echo=lambda line: print(line, file=sys.stderr)):
        echo("[featcal-eval] loading merged with lm-eval backend hf")  # the worker's log: not on the terminal under -q
        raise RunFailure("merged: the evaluation worker failed (exit 1): ModuleNotFoundError: No module named 'x'")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration", failing)
    output = tmp_path / "out"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output), eval={"tasks": ["arc_challenge"], "backend": {"name": "hf"}})
    failed = CliRunner().invoke(main, ["run", "-q", str(recipe)])
    assert failed.exit_code == 1 and failed.stderr.strip().splitlines() == [
        "featcal-llm: error: merged: the evaluation worker failed (exit 1): ModuleNotFoundError: No module named 'x'; the "
        f"calibrated checkpoint is complete in {output} (its card without the evaluation): once that is mended, "
        f"`featcal-llm run {recipe} {output} --eval-only` (calibrate(..., eval_only=True) in Python) scores it and the "
        "merge and adds the table to its card"]
    weights = (output / "model.safetensors").read_bytes()
    assert "## Evaluation" not in (output / "README.md").read_text()

    scored = []
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration",
                        lambda section, merged_dir, calibrated_dir, recipe_dir, echo=None:
                        scored.append((Path(merged_dir), Path(calibrated_dir))) or AfterCalibration(TABLE, {}))
    monkeypatch.setattr(pipeline, "calibrate", None)  # not called: no layer is calibrated again
    again = CliRunner().invoke(main, ["run", str(recipe), "--eval-only"])
    assert again.exit_code == 0, again.output
    assert again.stdout.strip().splitlines()[-1] == f"{output}: evaluated; the table is in its card"
    assert scored == [(small.root / "merged", output)] and (output / "model.safetensors").read_bytes() == weights
    card = (output / "README.md").read_text()
    assert card.index("## Evaluation") < card.index("## Recipe") and TABLE.rstrip() in card
    assert CliRunner().invoke(main, ["run", str(recipe), "--eval-only"]).exit_code == 0  # scored again: one table, replaced
    assert (output / "README.md").read_text() == card

    # Scored only under the settings it was made from: an edit outside `eval:` is named, by run and validate alike.
    assert {"featcal.lambda", "featcal.refine", "merge_method", "models"} <= read_run_record(output)["made_from"].keys()
    edited = yaml.safe_load(recipe.read_text())
    edited["featcal"]["eval"]["limit"] = 3  # the eval: block may change between the two runs
    edited["featcal"]["output"] = str(output)
    (tmp_path / "eval_edit.yaml").write_text(yaml.safe_dump(edited))
    assert CliRunner().invoke(main, ["validate", str(tmp_path / "eval_edit.yaml"), "--eval-only"]).exit_code == 0
    edited["featcal"]["lambda"] = 0.5
    edited["featcal"]["seed"] = 7
    edited["parameters"] = {"weight": 0.25}
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    for command in ("run", "validate"):
        stale = CliRunner().invoke(main, [command, str(tmp_path / "edited.yaml"), "--eval-only"])
        assert stale.exit_code == 2 and "featcal-llm: error: " + (
            f"{tmp_path / 'edited.yaml'}: --eval-only (eval_only=True): {output} was made from other settings than the "
            "recipe's now (featcal.lambda, featcal.seed, parameters); run the recipe without --eval-only to calibrate "
            "with them, or put them back") in stale.stderr.splitlines(), stale.output
    assert (output / "README.md").read_text() == card and len(scored) == 2
    for command in ("validate", "run"):  # the output's own recipe, which pins what the run chose, scores it (it was refused)
        assert CliRunner().invoke(main, [command, str(output / "featcal_recipe.yml"), "--eval-only"]).exit_code == 0
    assert (output / "README.md").read_text() == card and len(scored) == 3

    for flags, refusal in ((["--keep-layers"], "--eval-only (eval_only=True): calibrates nothing, so --keep-layers "
                                               "(keep_layers=True) does not apply"),
                           (["--force"], "--force (force=True): --eval-only (eval_only=True) replaces nothing")):
        refused = CliRunner().invoke(main, ["run", str(recipe), "--eval-only", *flags])
        assert refused.exit_code == 2 and refusal in refused.stderr and "\n" not in refused.stderr.strip(), refused.stderr

    bare = small.write_recipe(tmp_path / "bare.yaml", output=str(output))
    for command in ("run", "validate"):  # validate refuses what run refuses
        refused = CliRunner().invoke(main, [command, str(bare), "--eval-only"])
        assert refused.exit_code == 2 and f"{bare}: --eval-only (eval_only=True): featcal has no eval: block to run" in refused.output
        elsewhere = CliRunner().invoke(main, [command, str(recipe), str(tmp_path / "none"), "--eval-only"])
        assert elsewhere.exit_code == 2 and (
            f"{recipe}: --eval-only (eval_only=True): {tmp_path / 'none'} is no finished run's output (no featcal_recipe.yml); "
            "run the recipe without --eval-only") in elsewhere.output
    assert CliRunner().invoke(main, ["validate", str(recipe), "--eval-only"]).exit_code == 0
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun every rank would score and take the lock
    ranked = CliRunner().invoke(main, ["run", str(recipe), "--eval-only"])
    assert ranked.exit_code == 2 and "--eval-only (eval_only=True): scores in one process; run it without torchrun" in ranked.stderr
    monkeypatch.delenv("WORLD_SIZE")
    elsewhere_merged = small.write_recipe(tmp_path / "gone.yaml", output=str(output), merged=str(tmp_path / "gone"),
                                          eval={"tasks": ["arc_challenge"], "backend": {"name": "hf"}})
    for command in ("run", "validate"):  # the merge to score beside it is not there
        gone = CliRunner().invoke(main, [command, str(elsewhere_merged), "--eval-only"])
        assert gone.exit_code == 2 and (f"--eval-only (eval_only=True): {tmp_path / 'gone'}, the merged model, is not there "
                                        "to score beside the output") in gone.output, gone.output


@pytest.mark.parametrize("made_by_us", [True, False])
def test_an_expert_of_another_vocabulary_beside_an_existing_merge_is_refused_by_validate_as_run_refuses_it(small, tmp_path, made_by_us):
    """An expert resized for added tokens (8 more embedding rows) beside an existing merge. A merge featcal-llm made from
    the previous expert is stale, so run merges again, and mergekit failed on the rows (exit 1, after validate had
    passed the recipe): both refuse it before merging. A merge the user supplied (no marker, no mergekit_config.yml)
    is used as it is, and run refused the expert's rows against the merge's once it opened them, where validate had
    passed it: validate compares them too. One line each, exit 2, nothing merged."""
    import shutil

    from transformers import AutoModelForCausalLM

    import featcal_llm
    from featcal_llm.io.merge_identity import MARKER, MERGEKIT_CONFIG

    raw = yaml.safe_load(small.recipe.read_text())
    first = raw["models"][0]["model"]
    wider = AutoModelForCausalLM.from_pretrained(first)
    wider.resize_token_embeddings(wider.config.vocab_size + 8)
    wider.save_pretrained(tmp_path / "wider")
    for name in Path(first).iterdir():  # its tokenizer files: the records are read as before
        if "token" in name.name and not (tmp_path / "wider" / name.name).exists():
            shutil.copy(name, tmp_path / "wider" / name.name)
    shutil.copytree(small.root / "merged", tmp_path / "merged")
    assert (tmp_path / "merged" / MARKER).is_file()
    if not made_by_us:
        (tmp_path / "merged" / MARKER).unlink()
        (tmp_path / "merged" / MERGEKIT_CONFIG).unlink()
    weights = {path.name: path.stat().st_mtime_ns for path in (tmp_path / "merged").iterdir()}
    raw["models"][0]["model"] = str(tmp_path / "wider")
    raw["featcal"]["data"][str(tmp_path / "wider")] = raw["featcal"]["data"].pop(first)
    raw["featcal"].update(output=str(tmp_path / "out"), merged=str(tmp_path / "merged"), modules=["q_proj"])
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    against = "the base model" if made_by_us else "the merged model"
    wider_config = f"{tmp_path / 'wider'}: {tmp_path / 'wider' / 'config.json'}"
    assert [str(problem) for problem in featcal_llm.validate(tmp_path / "r.yaml")] == [
        f"{tmp_path / 'r.yaml'}: models: {wider_config}: vocabulary of 108 rows, {against} has 100: experts whose vocabulary "
        "differs from the merge (added tokens, union tokenizers) are not supported; give every expert the base's vocabulary"]
    result = CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if "error" in line]
    assert len(lines) == 1 and "vocabulary of 108 rows" in lines[0], result.output
    assert "merging" not in result.output and not (tmp_path / "out").exists()
    assert {path.name: path.stat().st_mtime_ns for path in (tmp_path / "merged").iterdir()} == weights
