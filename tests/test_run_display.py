"""What `featcal-llm run` shows: progress counted in tokens, the merge as a stage with mergekit's full error, --log,
--quiet and the end-of-run summary."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.errors import EXIT_FAILED


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
