"""One run at a time on an output, and outputs the run could not write refused before any work: a second run on the
same OUTPUT had shared the first's progress folder (deleting its layers, writing its own into them) and both had
exited 0; a dangling link, `.` or a file where the run keeps its progress had failed after the whole calibration."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.errors import FeatCalError
from featcal_llm.io.output_lock import OutputLock, lock_path
from featcal_llm.pipeline import run_recipe
from scenario import build_scenario

HOLD = """
import sys, time
from pathlib import Path
from featcal_llm.io.output_lock import OutputLock
lock = OutputLock.acquire(Path(sys.argv[1]), "holder")
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("lock"), experts=2, layers=1, samples=4)
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


def holder(output: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_run_on_an_output_in_use_is_refused_and_a_killed_holder_frees_it(small, tmp_path):
    output = tmp_path / "out"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output))
    process = holder(output)
    try:
        result = CliRunner().invoke(main, ["run", str(recipe)])
        assert result.exit_code != 0
        [line] = [line for line in result.stderr.splitlines() if "error" in line]
        assert line.endswith(f"featcal.output: {output}: another featcal-llm run (pid {process.pid}) is writing it; wait "
                             "for it to end, or name another output")
        assert not output.exists() and not (tmp_path / ".out.featcal-partial").exists()  # nothing of its own written
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert run_recipe(recipe, progress=False) == output  # the kernel released the killed holder's lock
    assert not lock_path(output).exists()  # removed with the run's end


def test_the_output_is_checked_again_once_the_lock_is_held(small, tmp_path, monkeypatch):
    """A run that checked OUTPUT absent while another finished writing it: once it holds the lock, it finds the output
    there and refuses, as without --force; the lock is released with the refusal."""
    import featcal_llm.pipeline as pipeline

    output = tmp_path / "out"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output))
    acquire = OutputLock.acquire

    def the_other_run_finished(path, where, recheck):
        output.mkdir()
        (output / "featcal_recipe.yml").write_text("written by the other run\n")
        return acquire(path, where, recheck)

    monkeypatch.setattr(pipeline.OutputLock, "acquire", the_other_run_finished)
    with pytest.raises(FeatCalError, match="already exists"):
        run_recipe(recipe, progress=False)
    assert not lock_path(output).exists() and (output / "featcal_recipe.yml").read_text() == "written by the other run\n"


def test_a_lock_file_replaced_while_it_was_opened_is_not_trusted(tmp_path, monkeypatch):
    """The holder removes its lock file as it ends. A run that had opened that file just before, and locks it just
    after, holds a lock on a removed file, which no later run sees: it takes the file now at the path instead."""
    import featcal_llm.io.output_lock as module

    output = tmp_path / "out"
    first = OutputLock.acquire(output, "first")
    flock = module.fcntl.flock
    calls = []

    def first_ends_in_between(descriptor, operation):
        if not calls:
            first.release()
        calls.append(descriptor)
        return flock(descriptor, operation)

    monkeypatch.setattr(module.fcntl, "flock", first_ends_in_between)
    second = OutputLock.acquire(output, "second")
    monkeypatch.setattr(module.fcntl, "flock", flock)
    assert len(calls) == 2 and lock_path(output).read_text() == f"{os.getpid()}\n"
    with pytest.raises(FeatCalError, match=rf"another featcal-llm run \(pid {os.getpid()}\) is writing it"):
        OutputLock.acquire(output, "third")
    second.release()
    assert not lock_path(output).exists()


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "out").symlink_to(d / "missing"), "out is a link to {d}/missing, which does not exist; name a folder"),
    (lambda d: (d / ".out.featcal-partial").write_text("junk"),
     ".out.featcal-partial is where featcal-llm keeps its progress, but it is not a folder; remove it"),
    (lambda d: (d / ".out.featcal-old").write_text("junk"),
     ".out.featcal-old is where featcal-llm keeps an old output while --force replaces it, but it is not a folder; remove it"),
    (lambda d: (d / ".out.featcal-lock").mkdir(),
     ".out.featcal-lock is the lock file a run holds while it writes out, but it is not a file; remove it"),
    (lambda d: ((d / "elsewhere").mkdir(), (d / ".out.featcal-partial").symlink_to(d / "elsewhere")),
     ".out.featcal-partial is where featcal-llm keeps its progress, but it is not a folder; remove it"),
    (lambda d: ((d / "out" / "sub").mkdir(parents=True), (d / "out" / "sub" / "..")),
     "out/sub/.. names no folder of its own: the run writes beside its output and renames it into place; name a new folder"),
])
def test_an_output_the_run_could_not_write_is_refused_by_validate_and_run(small, tmp_path, make, message):
    made = make(tmp_path)
    output = made[-1] if isinstance(made, tuple) and isinstance(made[-1], Path) else tmp_path / "out"  # `x/..` as written
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output))
    expected = message.format(d=tmp_path)
    problems = [str(problem) for problem in __import__("featcal_llm").validate(recipe)]
    assert len(problems) == 1 and problems[0].endswith(expected), problems
    with pytest.raises(FeatCalError, match="featcal.output") as error:
        run_recipe(recipe, progress=False, force=True)
    assert str(error.value).endswith(expected)


def test_an_empty_folder_is_an_output_force_may_write(small, tmp_path):
    """A folder made ready for the output (mkdir, then run) is replaced with --force, as an earlier output is; validate
    has only its note for it."""
    import featcal_llm

    output = tmp_path / "out"
    output.mkdir()
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output))
    assert featcal_llm.validate(recipe) == []
    assert (run_recipe(recipe, progress=False, force=True) / "featcal_recipe.yml").is_file()


def test_an_output_that_is_the_merge_through_a_link_is_refused(small, tmp_path):
    """featcal.merged real/m (not yet made) and the output link/m, with link -> real: one folder, which the run would
    write its merge into and then replace with its output. The paths compare with links followed."""
    import featcal_llm

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    merged, output = tmp_path / "real" / "m", tmp_path / "link" / "m"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output), merged=str(merged))
    line = (f"{recipe}: featcal.output: {output} is also featcal.merged {merged}: the run replaces its output as a "
            "whole; name another directory")
    assert [str(problem) for problem in featcal_llm.validate(recipe)] == [line]
    with pytest.raises(FeatCalError, match="is also featcal.merged"):
        run_recipe(recipe, progress=False)
    assert not merged.exists()


def test_the_current_folder_is_no_output(small, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    recipe = small.write_recipe(tmp_path / "r.yaml", output=".")
    with pytest.raises(FeatCalError, match=r"featcal.output: \. names no folder of its own"):
        run_recipe(recipe, progress=False, force=True)


def test_an_old_output_left_by_a_killed_swap_is_removed_by_the_next_run(small, tmp_path):
    """Killed between --force's two renames: the output is gone and the old one waits in .out.featcal-old; the rerun
    writes the output and removes it (it had stayed, a whole checkpoint, until a later --force)."""
    trash = tmp_path / ".out.featcal-old"
    trash.mkdir()
    (trash / "model.safetensors").write_bytes(b"old")
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    assert (run_recipe(recipe, progress=False) / "config.json").is_file()
    assert not trash.exists()


def test_an_existing_output_with_progress_beside_it_says_so(small, tmp_path):
    """Killed after the output moved into place and before its progress folder was removed: the rerun's refusal names
    the folder and what --force does with it, where it had said only that the output exists."""
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    run_recipe(recipe, progress=False)
    (tmp_path / ".out.featcal-partial").mkdir()
    with pytest.raises(FeatCalError) as error:
        run_recipe(recipe, progress=False)
    assert str(error.value).endswith(f"already exists (pass --force, or force=True to calibrate(), to replace it); "
                                     f"{tmp_path}/.out.featcal-partial beside it holds the saved progress of a run that did "
                                     "not finish or clean up, or that kept it (--keep-layers), which --force resumes as far as it "
                                     "matches the recipe (remove it to start over)")


def test_the_written_model_and_merge_have_the_umasks_mode(small, tmp_path):
    """safetensors writes its files 0600; the output and the merge a run makes are read by servers running as other
    users (vLLM in a container), so every file gets the mode the umask gives new files, as the other files have."""
    mask = os.umask(0o022)
    try:
        recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), merged=str(tmp_path / "merged"))
        output = run_recipe(recipe, progress=False)
    finally:
        os.umask(mask)
    written = [path for folder in (output, tmp_path / "merged") for path in folder.rglob("*") if path.is_file()]
    assert any(path.name.endswith(".safetensors") for path in written)
    assert {oct(path.stat().st_mode & 0o777) for path in written} == {"0o644"}


def test_a_staging_area_is_removed_state_first(tmp_path, monkeypatch):
    """A removal stopped half-way (a kill during rmtree) must not leave a state naming layers already deleted."""
    import shutil

    from featcal_llm.engine.resume import STATE_FILE, StagingArea, remove_staging

    staging = StagingArea(tmp_path / "partial", "fingerprint")
    seen = []
    monkeypatch.setattr(shutil, "rmtree", lambda path, ignore_errors=False: seen.append((Path(path) / STATE_FILE).exists()))
    remove_staging(staging.root)
    assert seen == [False]


def test_a_stack_is_refused_before_its_first_stage_while_its_output_is_in_use(small, tmp_path):
    """A stack holds its output's lock across both stages: a second run of it is refused before stage 1 (it had run
    stage 1 again, swapping out the intermediate the first run was reading, and been refused only at stage 2)."""
    output = tmp_path / "stack"
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(output), method=["regmean++", "featcal"])
    process = holder(output)
    try:
        with pytest.raises(FeatCalError, match=rf"stack: another featcal-llm run \(pid {process.pid}\) is writing it"):
            run_recipe(recipe, progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".stack.featcal-lock", "r.yaml"]  # no stage 1
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert run_recipe(recipe, progress=False) == output and sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "stack"]


def test_the_umask_is_read_without_being_set():
    from featcal_llm.io.checkpoint import current_umask

    mask = os.umask(0o027)
    try:
        assert current_umask() == 0o027 and os.umask(0o027) == 0o027
    finally:
        os.umask(mask)


def test_a_run_waits_while_another_holds_its_merge_directory(small, tmp_path, monkeypatch):
    """Two runs with other outputs but one `featcal.merged` (a sweep) would both merge into one `.merging` folder at
    once; the second waits for the first's lock instead, writing nothing meanwhile, then merges (or reuses its merge)."""
    import threading
    import time

    import featcal_llm.io.merge as merge
    from featcal_llm.io.recipe import load_recipe

    merged = tmp_path / "merged"
    said, waiting = [], threading.Event()
    monkeypatch.setattr(merge, "_say", lambda message: (said.append(message), waiting.set()))
    process = holder(merged)
    made = {}
    thread = threading.Thread(target=lambda: made.update(path=merge.ensure_merged(load_recipe(small.recipe), merged, "cpu")))
    try:
        thread.start()
        assert waiting.wait(30), "ensure_merged did not wait for the merge directory's lock"
        assert said == [f"waiting for another featcal-llm run (pid {process.pid}), which holds {merged}"]
        time.sleep(0.5)
        assert not merged.exists() and not merged.with_name("merged.merging").exists()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    thread.join(300)
    assert made["path"] == merged and (merged / "featcal_merge.json").is_file()
    assert not lock_path(merged).exists()


def test_a_supplied_merge_in_a_folder_that_cannot_hold_the_lock_is_read(small, tmp_path, monkeypatch):
    """A merge the user supplies from a read-only folder: no lock file can be made beside it, and none is needed."""
    import featcal_llm.io.output_lock as module
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    def read_only(path, flags, mode=0o777):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(module.os, "open", read_only)
    merged = small.root / "merged"
    assert ensure_merged(load_recipe(small.recipe), merged, "cpu") == merged
    with pytest.raises(Exception, match="cannot lock it for the merge"):
        ensure_merged(load_recipe(small.recipe), tmp_path / "elsewhere", "cpu")
