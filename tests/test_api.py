"""The Python API (`featcal_llm.calibrate`, `featcal_llm.evaluate`) and what `featcal-llm run` shows: progress counted
in tokens, the merge as a stage with mergekit's full error, --log, --quiet/--verbose and the end-of-run summary."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.errors import EXIT_FAILED
from scenario import build_scenario


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two experts, two layers, merged once."""
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("api"), experts=2, layers=2, samples=8)
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


def test_import_stays_light_and_the_api_is_reexported():
    code = textwrap.dedent(
        """
        import json, sys
        import featcal_llm
        light = [m for m in ("torch", "transformers", "mergekit", "featcal_llm.api") if m in sys.modules]
        from featcal_llm import api
        same = featcal_llm.calibrate is api.calibrate and featcal_llm.evaluate is api.evaluate
        same = same and featcal_llm.CalibrationResult is api.CalibrationResult
        from featcal_llm.errors import FeatCalError, RunFailure
        same = same and featcal_llm.FeatCalError is FeatCalError and "FeatCalError" in featcal_llm.__all__
        same = same and featcal_llm.RunFailure is RunFailure and "RunFailure" in featcal_llm.__all__
        heavy = [m for m in ("torch", "transformers", "mergekit") if m in sys.modules]
        print(json.dumps({"light": light, "same": same, "heavy": heavy, "all": "calibrate" in featcal_llm.__all__}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == {"light": [], "same": True, "heavy": [], "all": True}


def test_calibrate_takes_a_dict_and_returns_paths_and_the_drift_summary(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    result = featcal_llm.calibrate(recipe, output="calibrated", progress=False)
    assert result.output == Path("calibrated") and (tmp_path / "calibrated" / "config.json").is_file()
    assert result.merged == small.root / "merged"
    assert not list(tmp_path.glob(".featcal-recipe-*"))  # the dict's temporary recipe file is gone
    report = json.loads((tmp_path / "calibrated" / "featcal_drift.json").read_text())
    last = report["layers"][-1]
    assert list(result.experts) == [str(path) for path in small.experts.values()]
    for name, summary in result.experts.items():
        assert summary.drift_merged == last["merged"][name] and summary.drift_calibrated == last["calibrated"][name]
        assert summary.kl_merged == report["output_divergence"]["merged"][name]
        assert summary.kl_calibrated == report["output_divergence"]["calibrated"][name]
        assert summary.drift_calibrated < summary.drift_merged and summary.kl_calibrated < summary.kl_merged
    assert result.seconds > 0 and result.peak_host_memory > 100 * 2**20 and result.peak_gpu_memory is None
    table = result.table().splitlines()
    assert table[0].split() == ["expert", "drift", "merged", "drift", "calibrated", "KL", "merged", "KL", "calibrated"]
    first = result.experts[str(small.experts["expert0"])]
    assert table[2].split() == ["expert0", *(f"{v:.4g}" for v in (first.drift_merged, first.drift_calibrated, first.kl_merged,
                                                                     first.kl_calibrated))]
    assert table[-1].startswith("time ") and "peak memory: host" in table[-1]
    text = str(result)  # readable, not a dataclass repr
    assert text.splitlines()[0] == f"calibrated checkpoint: calibrated (from the merged model {small.root / 'merged'})"
    assert result.table() in text and "CalibrationResult(" not in text


def test_calibrate_returns_its_warnings(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["base_modle"] = "x"  # mergekit ignores it: a warning, not an error
    result = featcal_llm.calibrate(recipe, output="calibrated", progress=False)
    said = [w for w in result.warnings if "base_modle: not a mergekit or featcal key" in w and "did you mean 'base_model'" in w]
    assert said == ["<recipe>: base_modle: not a mergekit or featcal key (mergekit ignores it); did you mean 'base_model'?"]  # once, as <recipe>
    assert "warning: " in str(result) and "base_modle" in str(result)


def test_calibrate_names_a_dict_recipe_as_validate_does_not_by_its_deleted_temporary_file(small, tmp_path, monkeypatch):
    import featcal_llm
    from featcal_llm.api import _name_dict_recipe

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["refine"] = {"stepz": 3}
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(recipe, output="calibrated", progress=False)
    assert str(caught.value).startswith("<recipe>: featcal.refine.stepz: unknown key"), str(caught.value)
    assert [(p.file, p.key) for p in caught.value.problems] == [("<recipe>", "featcal.refine.stepz")]
    assert ".featcal-recipe-" not in str(caught.value) and not (tmp_path / "calibrated").exists()
    temporary = tmp_path / ".featcal-recipe-x.yaml"
    failure = _name_dict_recipe(featcal_llm.RunFailure(f"{temporary}: featcal.data.a: gone mid-run"), temporary)
    assert isinstance(failure, featcal_llm.RunFailure) and str(failure) == "<recipe>: featcal.data.a: gone mid-run"


def test_a_dict_recipe_takes_paths_and_numpy_numbers_and_leaves_no_file_when_it_cannot(small, tmp_path, monkeypatch):
    """A `Path` or a numpy number in a dict recipe had been a YAML RepresenterError, leaving a half-written hidden recipe
    file in the working directory: they are written as their string and number; what YAML still cannot write is one
    FeatCalError, and nothing is left behind."""
    import numpy as np

    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"].update(output=tmp_path / "calibrated", samples=np.int64(8))
    assert featcal_llm.validate(recipe) == []
    recipe["featcal"]["samples"] = object()
    [problem] = featcal_llm.validate(recipe)  # validate returns it, as every problem
    assert str(problem).startswith("<recipe>: a value YAML cannot write (object <object object at"), str(problem)
    with pytest.raises(featcal_llm.FeatCalError, match=r"^<recipe>: a value YAML cannot write \(object <object object at"):
        featcal_llm.calibrate(recipe, progress=False)
    assert not list(tmp_path.glob(".featcal-recipe-*"))


@pytest.mark.parametrize("device, message", [("tpu", "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
                                             (0, "--device: expected a string such as 'cpu' or 'cuda:0', got 0")])
def test_calibrates_device_is_checked_before_any_work(small, tmp_path, monkeypatch, device, message):
    """calibrate(device=...) had passed the recipe's checks and failed in the pipeline with no key named (`tpu`), or been
    ignored (`0`)."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(small.recipe, output=str(tmp_path / "out"), device=device, progress=False)
    assert [str(problem) for problem in caught.value.problems] == [f"{small.recipe}: {message}"]
    assert not (tmp_path / "out").exists()


def test_model_paths_beside_the_recipe_are_no_hub_ids(small, tmp_path, monkeypatch):
    """Run reads model paths from the working directory, as mergekit does; a relative one that exists only beside the
    recipe had passed validate as an unchecked hub id, then failed at the hub after retries."""
    import shutil

    import featcal_llm

    folder = tmp_path / "project"
    shutil.copytree(small.base, folder / "models" / "base", symlinks=True)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["base_model"] = "models/base"
    (folder / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    assert [str(problem) for problem in featcal_llm.validate(folder / "r.yaml")] == [
        f"{folder / 'r.yaml'}: base_model: models/base: no such folder here, where run reads model paths (as mergekit "
        f"does), but {folder / 'models' / 'base'} is beside the recipe: run from {folder} or write the path out in full"]
    monkeypatch.chdir(folder)
    assert featcal_llm.validate(folder / "r.yaml") == []


def test_validate_takes_a_dict_and_returns_problems_notes_and_warnings(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    clean = featcal_llm.validate(recipe)
    assert clean == [] and clean.ok and str(clean).endswith("ok") and not list(tmp_path.glob(".featcal-recipe-*"))
    recipe["featcal"]["lamda"] = 1.0
    recipe["featcal"]["samples"] = 0
    recipe["base_modle"] = "x"
    result = featcal_llm.validate(recipe)
    assert [(p.file, p.key) for p in result] == [("<recipe>", "featcal.samples"), ("<recipe>", "featcal.lamda")]
    assert not result.ok and str(result).splitlines()[0] == "error: <recipe>: featcal.samples: Input should be greater than or equal to 1 (got 0)"
    assert str(result).endswith("2 problems") and not any("once the featcal: block is fixed" in n for n in result.notes)  # one round
    del recipe["featcal"]["lamda"], recipe["featcal"]["samples"]
    warned = featcal_llm.validate(recipe)
    assert warned.ok and any("base_modle" in w for w in warned.warnings), warned.warnings
    with pytest.raises(featcal_llm.FeatCalError, match="validate: recipe must be a path or a mapping, got int"):
        featcal_llm.validate(3)


def test_refine_on_generated_records_is_warned_of_and_on_real_ones_not(small, tmp_path, monkeypatch):
    """Refinement's held-out records are generated where its data is: validate says so, naming the experts; an expert at
    weight 0 (not calibrated toward) and real records are not named."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["refine"] = True
    assert not [w for w in featcal_llm.validate(recipe).warnings if "featcal.refine" in w]
    first, second = sorted(recipe["featcal"]["data"])[:2]
    recipe["featcal"]["data"][first] = {"generate": {"samples": 4}}
    recipe["featcal"]["data"][second] = {"generate": {"samples": 4}, "weight": 0}
    warned = [w for w in featcal_llm.validate(recipe).warnings if "featcal.refine" in w]
    assert len(warned) == 1 and f"featcal.refine: {first} calibrates on generated records" in warned[0], warned
    del recipe["featcal"]["refine"]
    assert not [w for w in featcal_llm.validate(recipe).warnings if "featcal.refine" in w]


def test_calibrate_refuses_what_is_not_a_recipe():
    import featcal_llm
    from featcal_llm.errors import FeatCalError

    with pytest.raises(FeatCalError, match="recipe must be a path or a mapping, got int"):
        featcal_llm.calibrate(3)


class RecordingBar:
    """Stands in for tqdm: records how the calibration bar is set up and advanced."""

    made: list["RecordingBar"] = []

    def __init__(self, *args, total=None, initial=0, unit="it", **kwargs):
        self.total, self.unit, self.n, self.updates, self.descriptions = total, unit, initial, 0, [kwargs.get("desc")]
        RecordingBar.made.append(self)

    def update(self, count=1):
        self.n += count
        self.updates += 1

    def set_description(self, text, refresh=True):
        self.descriptions.append(text)

    def close(self):
        pass

    @staticmethod
    def write(text, file=None, **kwargs):
        print(text, file=file or sys.stderr)


def test_run_shows_token_progress_stages_a_summary_and_logs(small, tmp_path, monkeypatch):
    """A fresh merge is announced; the bar counts tokens batch by batch (a rate after the first batch, not after a layer);
    --verbose adds a line per layer; the summary table ends the run; --log holds all of it without bar redraws."""
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    RecordingBar.made = []
    recipe = small.write_recipe(tmp_path / "r.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "out"))
    log = tmp_path / "logs" / "run.log"
    result = CliRunner().invoke(main, ["run", str(recipe), "--log", str(log), "--verbose"])
    assert result.exit_code == 0, result.output
    (bar,) = [b for b in RecordingBar.made if b.unit == "tok"]
    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.io.data import calibration_sequences
    from featcal_llm.tiny import build_char_tokenizer

    featcal = load_recipe(recipe).featcal
    sequences = calibration_sequences(featcal.data, list(featcal.data), build_char_tokenizer(), featcal.samples, featcal.max_length,
                                      False, 0, recipe)
    tokens = sum(len(s) for seqs in sequences.values() for s in seqs)
    assert bar.total == 2 * tokens and bar.n == bar.total  # two layers, every calibration token once per layer
    assert bar.updates > 2 * len(sequences)  # per batch (each expert has more than one), so the ETA starts early
    assert bar.descriptions[:2] == ["FeatCal layer 1/2", "FeatCal layer 2/2"]
    stderr = result.stderr
    assert f"featcal-llm: merging with mergekit (task_arithmetic) into {tmp_path / 'merged'}" in stderr
    assert "featcal-llm: layer 1/2 calibrated (" in stderr and "tokens/s, about" in stderr
    summary = json.loads((tmp_path / "out" / "featcal_drift.json").read_text())
    row = next(line for line in stderr.splitlines() if line.startswith("expert1 "))
    assert float(row.split()[1]) == pytest.approx(summary["layers"][-1]["merged"][str(small.experts["expert1"])], rel=1e-3)
    assert result.stdout == f"calibrated checkpoint written to {tmp_path / 'out'}\n"
    text = log.read_text()
    for expected in ("merging with mergekit", "merged in", "layer 1/2 calibrated", "layer 2/2 calibrated", "expert1 ",
                     "calibrated checkpoint written to"):
        assert expected in text, expected


def test_log_keeps_lines_and_drops_progress_bar_redraws(tmp_path):
    import sys

    from featcal_llm import runlog

    log = tmp_path / "run.log"
    with runlog.session(log, runlog.QUIET):
        print("a warning line", file=sys.stderr)
        sys.stderr.write("\rFeatCal layer 1/2:  40%|####      | 2.0k/5.0k")
        runlog.note("layer 1/2 calibrated")
        runlog.stage("merged in 1 s")
    lines = log.read_text().splitlines()
    assert lines[0] == "a warning line" and lines[1].endswith(" layer 1/2 calibrated") and lines[2].endswith(" merged in 1 s")
    assert len(lines) == 3 and sys.stderr is not None and not hasattr(sys.stderr, "log")  # the streams are restored


def test_a_second_run_appends_to_the_log_and_a_cause_the_error_does_not_name_is_shown(tmp_path, capsys):
    """--log FILE is appended to: a rerun with the same log keeps the first run's lines. A failure's cause whose text
    the error line does not hold is printed under it (its type and first line); one the line repeats is not."""
    from featcal_llm import runlog
    from featcal_llm.errors import FeatCalError

    log = tmp_path / "run.log"
    for line in ("first run", "second run"):
        with runlog.session(log, runlog.QUIET):
            runlog.stage(line)
    assert [line.split(" ", 1)[1] for line in log.read_text().splitlines()] == ["first run", "second run"]

    def failed(cause: Exception, said: str) -> str:
        try:
            try:
                raise cause
            except Exception as error:
                raise FeatCalError(said) from error
        except FeatCalError as error:
            runlog.failure(error)
        return capsys.readouterr().err

    assert failed(ValueError("disk quota exceeded"), "merge failed") == "featcal-llm: error: merge failed\n  ValueError: disk quota exceeded\n"
    assert failed(ValueError("disk quota exceeded"), "merge failed: disk quota exceeded") == "featcal-llm: error: merge failed: disk quota exceeded\n"


def test_eval_only_with_force_is_refused_before_any_work(small, tmp_path):
    import featcal_llm

    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    with pytest.raises(featcal_llm.FeatCalError) as error:
        featcal_llm.calibrate(recipe, eval_only=True, force=True, progress=False)
    assert str(error.value) == "--force (force=True): --eval-only (eval_only=True) replaces nothing; drop one of them"
    assert not (tmp_path / "out").exists()


def test_quiet_run_prints_only_the_result(small, tmp_path):
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    result = CliRunner().invoke(main, ["run", str(recipe), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and result.stdout == f"calibrated checkpoint written to {tmp_path / 'out'}\n"
    both = CliRunner().invoke(main, ["run", str(recipe), "--quiet", "--verbose"])
    assert both.exit_code == 2 and "--quiet and --verbose exclude each other" in both.output


def test_a_failed_merge_shows_mergekit_s_full_error(small, tmp_path, monkeypatch):
    """The one-line error, then every line of mergekit's message; its traceback in the log (and with --verbose)."""
    import mergekit.merge

    def failing(*args, **kwargs):
        raise ValueError("tensor model.layers.0.mlp.up_proj.weight: shapes differ\n  expert0: (64, 32)\n  expert1: (48, 32)")

    monkeypatch.setattr(mergekit.merge, "run_merge", failing)
    recipe = small.write_recipe(tmp_path / "r.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "out"))
    log = tmp_path / "run.log"
    result = CliRunner().invoke(main, ["run", str(recipe), "--log", str(log)])
    assert result.exit_code == EXIT_FAILED  # a library error: the run started and failed (README's exit codes)
    lines = result.stderr.splitlines()
    start = lines.index(f"featcal-llm: error: {recipe}: mergekit failed to merge the recipe: "
                        "tensor model.layers.0.mlp.up_proj.weight: shapes differ")
    assert lines[start + 1:] == ["  ValueError: tensor model.layers.0.mlp.up_proj.weight: shapes differ",
                                 "    expert0: (64, 32)", "    expert1: (48, 32)"]
    assert "Traceback" not in result.stderr
    text = log.read_text()
    assert "expert1: (48, 32)" in text and "Traceback (most recent call last)" in text and "in failing" in text
    verbose = CliRunner().invoke(main, ["run", str(recipe), "--verbose"])
    assert verbose.exit_code == EXIT_FAILED and "Traceback (most recent call last)" in verbose.stderr
    assert not (tmp_path / "merged").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_evaluate_scores_models_and_returns_their_summaries_and_table(tmp_path, monkeypatch):
    """`featcal_llm.evaluate` on a tiny model with lm-eval's hf backend (one local fixture task): the same summary file
    and table as `featcal-llm eval` writes."""
    pytest.importorskip("lm_eval")
    import featcal_llm
    from featcal_llm.tiny import build_char_tokenizer, new_tiny_llama, save_model, tiny_llama_config

    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("OMP_NUM_THREADS", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    tokenizer = build_char_tokenizer()
    model = save_model(new_tiny_llama(tiny_llama_config(len(tokenizer), max_position_embeddings=1024), 0), tokenizer, tmp_path / "tiny")
    fixture = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench" / "arc_challenge.jsonl"
    result = featcal_llm.evaluate({"mine": model}, tasks=["arc_challenge"], backend={"name": "hf"}, output="scores",
                                  chat_template="off", limit=2, data={"arc_challenge": str(fixture)}, quiet=True)
    assert result.output == tmp_path / "scores" and list(result.summaries) == ["mine"]
    summary = json.loads((tmp_path / "scores" / "mine.json").read_text())
    assert result.summaries["mine"] == summary and list(summary["tasks"]) == ["arc_challenge"]
    assert "| mine |" in result.table and (tmp_path / "scores" / "last-eval.md").read_text() == result.table
    from featcal_llm.errors import FeatCalError

    with pytest.raises(FeatCalError, match="two models have the same label"):
        featcal_llm.evaluate([tmp_path / "a" / "m", tmp_path / "b" / "m"])
    with pytest.raises(FeatCalError, match="two models have the same label"):  # one summary file, a_b.json, for both
        featcal_llm.evaluate({"a b": model, "a_b": model})
    with pytest.raises(FeatCalError, match=r"^evaluate\(\) limit: Input should be greater than 0"):  # the argument, not a flag
        featcal_llm.evaluate(model, limit=0)
    with pytest.raises(FeatCalError, match=r"^evaluate\(\) limitt: unknown argument; did you mean 'limit'\?$"):
        featcal_llm.evaluate(model, limitt=2)
    with pytest.raises(FeatCalError, match=r"^evaluate\(\) backend.batch_size: Input should be a valid integer or 'auto' \(got 'max'\)$"):
        featcal_llm.evaluate(model, backend={"name": "hf", "batch_size": "max"})  # one line for the union, not one per member


def test_a_resumed_bar_names_its_method_and_never_counts_past_the_last_layer():
    from featcal_llm.engine.progress import TokenProgress

    done = TokenProgress(2, 10, done_layers=2, method="RegMean++")  # every layer saved: a stack's stage 1 rerun
    again = TokenProgress(3, 10, done_layers=1)
    done.close(), again.close()
    assert done.bar.desc == "RegMean++ layer 2/2" and done.bar.n == 20 and again.bar.desc == "FeatCal layer 2/3"


def test_the_gpu_peak_is_the_largest_over_the_visible_gpus(monkeypatch):
    """A single-process run on cuda:1 allocates nothing on the current device (0): its peak is read from every GPU."""
    import torch

    from featcal_llm.api import _gpu_peak

    peaks, resets = {0: 0, 1: 7 * 2**30}, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks[0 if device is None else device])
    assert _gpu_peak(reset=True) is None and resets == [0, 1]
    assert _gpu_peak(reset=False) == 7 * 2**30


# --- API input audit: bad or edge inputs to calibrate / validate / evaluate (each test failed before its fix) ---


def _recipe_dict(small, tmp_path):
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    return recipe


@pytest.mark.parametrize("call", ["validate", "calibrate"])
@pytest.mark.parametrize("output", [123, b"out"])
def test_an_output_of_the_wrong_type_is_one_featcal_error(small, tmp_path, monkeypatch, call, output):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    if call == "validate":  # validate returns every problem, the arguments' too (as it does an unavailable device)
        result = featcal_llm.validate(_recipe_dict(small, tmp_path), output=output)
        assert [(problem.key, "output directory" in problem.message) for problem in result] == [("OUTPUT", True)], str(result)
        assert not list(tmp_path.iterdir())
        return
    with pytest.raises(featcal_llm.FeatCalError, match="output") as caught:
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), output=output, progress=False)
    assert "\n" not in str(caught.value) and not list(tmp_path.iterdir())


def test_validate_returns_a_device_that_is_no_string_as_calibrate_refuses_it(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    said = featcal_llm.validate(_recipe_dict(small, tmp_path), device=0)
    assert [problem.key for problem in said] == ["--device"], str(said)
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), device=0, progress=False)
    assert caught.value.problems == list(said)


def test_an_empty_output_is_judged_alike_by_validate_and_calibrate(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)
    if featcal_llm.validate(recipe, output="").ok:
        featcal_llm.calibrate(recipe, output="", progress=False)  # what validate passes, calibrate runs
    else:
        with pytest.raises(featcal_llm.FeatCalError):
            featcal_llm.calibrate(recipe, output="", progress=False)


def test_an_existing_output_argument_is_named_as_the_argument(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "earlier"
    existing.mkdir()
    (existing / "featcal_recipe.yml").write_text(small.recipe.read_text())  # an earlier featcal-llm output
    recipe = _recipe_dict(small, tmp_path)
    noted = [note for note in featcal_llm.validate(recipe, output=existing).notes if "already exists" in note]
    assert noted and "OUTPUT" in noted[0]
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(recipe, output=existing, progress=False)
    assert "already exists" in str(caught.value) and "featcal.output" not in str(caught.value), str(caught.value)


def test_recipe_text_given_as_a_string_is_one_line(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError) as caught:
        featcal_llm.calibrate(small.recipe.read_text(), progress=False)
    assert "\n" not in str(caught.value) and len(caught.value.problems) == 1
    result = featcal_llm.validate(small.recipe.read_text())
    assert len(result) == 1 and "\n" not in str(result[0])


def test_a_name_of_255_bytes_is_one_a_file_system_takes(small, tmp_path, monkeypatch):
    """NAME_MAX is 255 bytes: a recipe named in 255 is looked for (and found missing), one of 256 is refused."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    said = featcal_llm.validate("é" * 125 + ".yaml")  # 255 bytes
    assert len(said) == 1 and "past the 255" not in str(said[0]) and str(said[0]).endswith("recipe file not found"), str(said)
    said = featcal_llm.validate("é" * 125 + "x.yaml")
    assert len(said) == 1 and "a name of 256 bytes (éééééééééééééééééééééééé...), past the 255 a file system takes" in str(said[0]), str(said)


def test_an_output_name_leaves_room_for_the_folders_the_run_keeps_beside_it(small, tmp_path, monkeypatch):
    """The run keeps .NAME.featcal-partial (its progress) beside the output NAME: 17 bytes more, so an output's name
    may take 238 of a file system's 255 bytes; one longer is one problem from validate and one error from calibrate."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    assert featcal_llm.validate(_recipe_dict(small, tmp_path), output="x" * 238) == []
    line = ("a name of 239 bytes (xxxxxxxxxxxxxxxxxxxxxxxx...), past the 238 an output's name may take: the run keeps "
            ".NAME.featcal-partial beside it, in the 255 bytes a file system takes; name a shorter directory")
    said = featcal_llm.validate(_recipe_dict(small, tmp_path), output="x" * 239)
    assert len(said) == 1 and str(said[0]).endswith(line), str(said)
    said = featcal_llm.validate(small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / ("x" * 250))))
    assert len(said) == 1 and "a name of 250 bytes" in str(said[0]) and "past the 238" in str(said[0]), str(said)
    with pytest.raises(featcal_llm.FeatCalError, match="past the 238 an output's name may take"):
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), output="x" * 239, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".x")) == []


@pytest.mark.parametrize("probe", ["validate recipe", "calibrate recipe", "validate output", "evaluate model"])
def test_a_name_too_long_for_the_file_system_is_one_featcal_error(small, tmp_path, monkeypatch, probe):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    long = "x" * 300
    if probe.startswith("validate"):  # returned as the one problem, as validate returns every problem
        said = featcal_llm.validate(long + ".yaml") if probe == "validate recipe" else \
            featcal_llm.validate(_recipe_dict(small, tmp_path), output=long)
        assert len(said) == 1 and "past the 255 a file system takes" in str(said[0]), str(said)
        return
    with pytest.raises(featcal_llm.FeatCalError, match="past the 255 a file system takes"):
        if probe == "calibrate recipe":
            featcal_llm.calibrate(long + ".yaml", progress=False)
        else:
            featcal_llm.evaluate(long, tasks=["arc_challenge"], quiet=True)


def test_an_output_with_a_nul_byte_is_one_featcal_error(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="output|OUTPUT"):
        featcal_llm.calibrate(_recipe_dict(small, tmp_path), output="o\x00ut", progress=False)


def test_a_dict_recipe_takes_path_keys(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)
    recipe["featcal"]["data"] = {Path(name): spec for name, spec in recipe["featcal"]["data"].items()}
    assert featcal_llm.validate(recipe) == []


def test_a_dict_recipe_with_a_tuple_key_names_the_key(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)
    recipe[(1, 2)] = "x"
    result = featcal_llm.validate(recipe)
    assert len(result) == 1 and "line " not in str(result[0]) and "(1, 2)" in str(result[0]), str(result)


def test_a_dict_recipe_in_an_unwritable_working_directory_is_one_featcal_error(small, tmp_path, monkeypatch):
    import tempfile

    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe = _recipe_dict(small, tmp_path)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".featcal-recipe-x.yaml"))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    [problem] = featcal_llm.validate(recipe)
    assert "the working directory cannot take the recipe's temporary file (Permission denied)" in str(problem)
    with pytest.raises(featcal_llm.FeatCalError, match=r"^<recipe>: the working directory cannot take"):
        featcal_llm.calibrate(recipe, progress=False)


def test_an_output_of_the_working_directory_is_refused_for_itself_not_for_the_temporary_recipe(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    result = featcal_llm.validate(_recipe_dict(small, tmp_path), output=".")
    assert len(result) == 1 and "holds the recipe" not in str(result[0]), str(result)


@pytest.mark.parametrize("models", [None, 3, b"/tmp/model"])
def test_evaluate_refuses_models_that_are_no_paths(tmp_path, monkeypatch, models):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="model"):
        featcal_llm.evaluate(models, tasks=["arc_challenge"], quiet=True)


@pytest.mark.parametrize("which", ["list int", "list None", "list dict", "mapping int", "mapping None"])
def test_evaluate_refuses_a_model_entry_that_is_no_path(small, tmp_path, monkeypatch, which):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    models = {"list int": [small.base, 3], "list None": [small.base, None], "list dict": [{"a": small.base}],
              "mapping int": {"a": 3}, "mapping None": {"a": None}}[which]
    with pytest.raises(featcal_llm.FeatCalError):
        featcal_llm.evaluate(models, tasks=["arc_challenge"], quiet=True)


@pytest.mark.parametrize("backend", [3, None, ["hf"]])
def test_evaluate_refuses_a_backend_that_is_neither_a_name_nor_a_mapping(small, tmp_path, monkeypatch, backend):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="backend") as caught:
        featcal_llm.evaluate(small.base, tasks=["arc_challenge"], backend=backend, quiet=True)
    assert "backend.h" not in str(caught.value)


def test_evaluate_names_a_missing_model_first_as_eval_does(tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="nowhere"):
        featcal_llm.evaluate(tmp_path / "nowhere", quiet=True)


def test_evaluate_checks_every_model_before_scoring_any(small, tmp_path, monkeypatch):
    import featcal_llm
    from featcal_llm.evaluation import runner

    class Scored(Exception):
        pass

    def scoring(path, label, section, **kwargs):
        if Path(path).is_dir():
            raise Scored(path)  # the real one would run lm-eval here, minutes per model
        return runner.check_model_dir(Path(path))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "evaluate_model", scoring)
    with pytest.raises(featcal_llm.FeatCalError, match="nowhere"):
        featcal_llm.evaluate([small.base, tmp_path / "nowhere"], tasks=["arc_challenge"], quiet=True)


def test_evaluate_refuses_output_none(small, tmp_path, monkeypatch):
    import featcal_llm
    from featcal_llm.evaluation import runner

    class Scored(Exception):
        pass

    def scoring(path, label, section, **kwargs):
        raise Scored(section.output)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "evaluate_model", scoring)
    with pytest.raises(featcal_llm.FeatCalError, match="output"):
        featcal_llm.evaluate(small.base, tasks=["arc_challenge"], output=None, quiet=True)


def test_validate_returns_a_bad_device_as_a_problem_as_it_does_an_unavailable_one(small, tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    result = featcal_llm.validate(_recipe_dict(small, tmp_path), device="tpu")
    assert [problem.key for problem in result] == ["--device"]
