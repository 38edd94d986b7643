"""`validate` says what `run` will say about where a run writes: its output and the OUTPUT argument, the merge's staging
folder, generated records, a stack's stages, the log, the Hub (each test one edit, both commands asked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from agreement import error_lines, expert_of, recipe_of, refused_alike


def _transport_error() -> Exception:
    """What huggingface_hub's HTTP client raises when the host cannot be resolved."""
    for name in ("httpx2", "httpx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        return module.ConnectError("[Errno -2] Name or service not known")
    import requests

    return requests.exceptions.ConnectionError("Name or service not known")


@pytest.mark.parametrize("error", ["transport", "offline mode"])
def test_online_without_a_network_is_a_note_not_an_error(scenario, tmp_path, monkeypatch, error):
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    raised = _transport_error() if error == "transport" else OfflineModeIsEnabled("HF_HUB_OFFLINE is set")

    def unreachable(self, repo_id, **kwargs):
        raise raised

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"]["data"][expert_of(recipe, 1)]["path"] = "someone/calibration-set"
    recipe["featcal"]["data"]["someone/expert"] = recipe["featcal"]["data"].pop(expert_of(recipe, 2))
    recipe["models"][2]["model"] = "someone/expert"
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["validate", str(path), "--online"])
    assert result.exit_code == 0, result.output
    assert error_lines(result) == []
    assert ("featcal-llm: note: hub ids not checked: no network (someone/calibration-set (dataset), someone/expert)"
            in result.stderr.splitlines()), result.stderr


def test_push_to_hub_checks_the_login_before_any_work(scenario, tmp_path, monkeypatch):
    import huggingface_hub

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_of(scenario, tmp_path), sort_keys=False))
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    result = CliRunner().invoke(main, ["run", str(path), "--push-to-hub", "me/model"])
    assert result.exit_code == 2
    assert error_lines(result) == ["--push-to-hub me/model: not logged in to the Hugging Face Hub (run `hf auth login` or set HF_TOKEN); "
                               "nothing was computed"]

    class Rejected(Exception):
        response = type("Response", (), {"status_code": 401})()

    class Hub:
        def whoami(self, *args, **kwargs):
            raise Rejected("401 Client Error: Unauthorized")

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_expired")
    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    result = CliRunner().invoke(main, ["run", str(path), "--push-to-hub", "me/model"])
    assert result.exit_code == 2 and error_lines(result) == [
        "--push-to-hub me/model: the Hugging Face token was rejected (401: expired or revoked); log in again with `hf auth login`"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged").exists()


def test_the_output_argument_is_written_into_the_replay_recipe_with_comments_kept():
    from featcal_llm.io.recipe_yaml import with_output

    text = "merge_method: ties  # keep\nfeatcal:\n  output: old/out   # where\n  samples: 4\n"
    assert with_output(text, "new dir/x: y") == "merge_method: ties  # keep\nfeatcal:\n  output: 'new dir/x: y'   # where\n  samples: 4\n"
    assert yaml.safe_load(with_output("featcal: {samples: 4}\n", "o"))["featcal"] == {"samples": 4, "output": "o"}


def test_an_output_written_as_an_alias_is_replaced_without_touching_its_anchor():
    """`output: *m` names the node anchored elsewhere (here `merged: &m out`): the saved replay recipe must write the
    new output and leave `merged` (and every other alias of the anchor) as the recipe wrote it."""
    from featcal_llm.io.recipe_yaml import with_output

    text = "featcal:\n  merged: &m out  # the merge\n  output: *m\n  samples: 4\n"
    assert yaml.safe_load(with_output(text, "new"))["featcal"] == {"merged": "out", "output": "new", "samples": 4}


def test_the_output_argument_is_checked_in_place_of_featcal_output(scenario, tmp_path):
    """`run RECIPE OUTPUT` never writes featcal.output: that key may name anything, OUTPUT must be writable."""
    from featcal_llm.io.validate import check_before_run, check_recipe

    (tmp_path / "a-file").write_text("x")
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"]["output"] = str(tmp_path / "a-file" / "out")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert [p.key for p in check_recipe(path, plan=False).problems] == ["featcal.output"]
    assert check_recipe(path, plan=False, output=tmp_path / "elsewhere").problems == []
    check_before_run(path, tmp_path / "elsewhere")
    ran = CliRunner().invoke(main, ["run", str(path), str(tmp_path / "a-file" / "there")])
    assert ran.exit_code == 2 and error_lines(ran) == [f"{path}: OUTPUT: {tmp_path / 'a-file' / 'there'}: {tmp_path / 'a-file'} is not a directory"]


@pytest.mark.parametrize("output", ["", " "])
def test_an_empty_output_argument_is_refused_as_an_empty_featcal_output_is(scenario, tmp_path, output):
    """`run RECIPE ""` named the current folder (a path of ""), and was refused as the folder holding the recipe;
    both commands now say it is empty, in one line, as they say of `featcal.output: ""`."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_of(scenario, tmp_path), sort_keys=False))
    said = [CliRunner().invoke(main, [command, str(path), output]) for command in ("validate", "run")]
    assert [result.exit_code for result in said] == [2, 2]
    assert error_lines(said[0]) == error_lines(said[1]) == [f"{path}: OUTPUT: {output!r} is empty; name the directory the calibrated model is written to"]


@pytest.mark.parametrize("arguments, fragment", [
    (["~/calibrated"], "OUTPUT: ~/calibrated: run takes a path as written"),
    (["{tmp}/recipe-folder"], None),  # a fine OUTPUT for a recipe whose own output is not
    (["--device", "cuda"], "--device: cuda requested but CUDA is not available"),
])
def test_validate_takes_run_s_output_and_device(scenario, tmp_path, monkeypatch, arguments, fragment):
    """`validate RECIPE OUTPUT --device D` checks what `run RECIPE OUTPUT --device D` runs, in its words."""
    from featcal_llm import hardware

    monkeypatch.setattr(hardware, "cuda_refusal", lambda: "CUDA is not available (torch is a CPU-only build)")
    monkeypatch.chdir(tmp_path)
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"]["output"] = "~/elsewhere" if fragment is None else str(tmp_path / "out")  # refused unless OUTPUT replaces it
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    arguments = [argument.format(tmp=tmp_path) for argument in arguments]
    validated = CliRunner().invoke(main, ["validate", str(path), *arguments])
    if fragment is None:
        assert validated.exit_code == 0, validated.output
        return
    ran = CliRunner().invoke(main, ["run", str(path), *arguments])
    assert validated.exit_code == ran.exit_code == 2 and error_lines(validated) == error_lines(ran), (validated.output, ran.output)
    assert len(error_lines(validated)) == 1 and fragment in error_lines(validated)[0]
    assert not (tmp_path / "~").exists() and not (tmp_path / "out").exists()


def test_an_output_argument_that_is_a_file_is_refused_alike(scenario, tmp_path):
    """`run RECIPE FILE`, FILE an existing file: validate says its one line; run had answered click's usage error
    ("Error: Invalid value for '[OUTPUT]': Directory ... is a file.") instead of the same line."""
    recipe = recipe_of(scenario, tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    (tmp_path / "a-file").write_text("mine")
    validated = CliRunner().invoke(main, ["validate", str(path), str(tmp_path / "a-file")])
    ran = CliRunner().invoke(main, ["run", str(path), str(tmp_path / "a-file")])
    assert validated.exit_code == ran.exit_code == 2, (validated.output, ran.output)
    assert error_lines(validated) == [f"{path}: OUTPUT: {tmp_path / 'a-file'} is a file: --force replaces only an earlier output; "
                                  "name another directory"]
    assert error_lines(ran) == error_lines(validated), ran.output
    assert (tmp_path / "a-file").read_text() == "mine" and not (tmp_path / "merged").exists()


def test_a_file_in_place_of_the_generated_records_folder_is_refused_alike(scenario, tmp_path):
    """An expert that writes its own records (`generate:`), and a file named featcal_generated beside the output (where
    the run keeps the generated sets): validate had passed it; run merged, then died in a traceback (FileExistsError,
    exit 1) as it made the folder."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"]["data"][expert_of(recipe, 1)] = {"generate": {"samples": 2, "max_new_tokens": 4}}
    (tmp_path / "featcal_generated").write_text("mine")
    assert "featcal_generated" in refused_alike(recipe, tmp_path)[0]
    assert (tmp_path / "featcal_generated").read_text() == "mine"
    assert not (tmp_path / "merged").exists() and not (tmp_path / "out").exists()


def test_a_file_in_place_of_the_merge_s_staging_folder_is_refused_alike(scenario, tmp_path):
    """A file `merged.merging` beside the merge the run makes (where mergekit's merge is staged): validate had passed it,
    as it refuses a file at the output's `.out.featcal-partial`; run refused it with exit 1 ("cannot write the merge
    (File exists)") after validate's exit 0."""
    recipe = recipe_of(scenario, tmp_path)
    (tmp_path / "merged.merging").write_text("mine")
    assert "merged.merging" in refused_alike(recipe, tmp_path)[0]
    assert (tmp_path / "merged.merging").read_text() == "mine"


def test_a_folder_in_place_of_a_generated_set_is_refused_alike(scenario, tmp_path):
    """featcal_generated/<expert>.jsonl is a folder (where the run writes an expert's generated records): validate had
    passed it; run sampled the expert's records, then died in a traceback (IsADirectoryError, exit 1) writing them."""
    recipe = recipe_of(scenario, tmp_path)
    expert = expert_of(recipe, 1)
    recipe["featcal"]["data"][expert] = {"generate": {"samples": 2, "max_new_tokens": 4}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    from featcal_llm.generation.store import GENERATED_DIR

    (tmp_path / GENERATED_DIR / f"{Path(expert).name}.jsonl").mkdir(parents=True)
    refused_alike(None, tmp_path)
    assert not (tmp_path / "merged").exists()


def test_a_file_in_place_of_a_stack_s_first_stage_is_refused_alike(scenario, tmp_path):
    """`method: [regmean, featcal]` and a file at `.out.regmean` (where the stack's first stage is written): validate had
    passed it, as it refuses a file at `.out.featcal-partial`; run refused it (".out.regmean is a file: --force replaces
    only an earlier output")."""
    recipe = recipe_of(scenario, tmp_path)
    for key in ("expert_weights", "token_weights", "trailing_experts"):
        recipe["featcal"].pop(key, None)
    recipe["featcal"]["method"] = ["regmean", "featcal"]
    (tmp_path / ".out.regmean").write_text("mine")
    refused_alike(recipe, tmp_path)
    assert (tmp_path / ".out.regmean").read_text() == "mine" and not (tmp_path / "merged").exists()


def test_a_folder_of_other_things_at_the_merge_s_staging_path_is_not_deleted(scenario, tmp_path):
    """A folder `merged.merging` holding the user's own files: validate passed the recipe and run deleted the folder
    without a word (shutil.rmtree before mergekit stages the merge there), where an output folder of other things is
    refused by both commands, --force or not."""
    recipe = recipe_of(scenario, tmp_path)
    (tmp_path / "merged.merging").mkdir()
    (tmp_path / "merged.merging" / "notes.txt").write_text("mine")
    refused_alike(recipe, tmp_path)
    assert (tmp_path / "merged.merging" / "notes.txt").read_text() == "mine"


def test_a_staging_folder_a_stopped_merge_left_is_emptied_and_the_merge_made(scenario, tmp_path):
    """A merge stopped half-way leaves its staging folder with featcal-llm's mark in it: the next run empties it and
    merges, and the merge it moves into place carries no staging mark."""
    from featcal_llm.io.merge import STAGING_MARKER
    from featcal_llm.io.merge_identity import MARKER

    recipe = recipe_of(scenario, tmp_path)
    (tmp_path / "merged.merging").mkdir()
    (tmp_path / "merged.merging" / STAGING_MARKER).write_text("")
    (tmp_path / "merged.merging" / "model-00001-of-00002.safetensors").write_text("half")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert ran.exit_code == 0, ran.output
    assert not (tmp_path / "merged.merging").exists() and (tmp_path / "merged" / MARKER).is_file()
    assert not (tmp_path / "merged" / STAGING_MARKER).exists()


def test_a_log_file_under_a_file_is_refused_in_one_line(scenario, tmp_path):
    """`run --log a-file/run.log`, a-file an existing file: run died in a traceback (FileExistsError from the log's
    mkdir, exit 1), where a bad OUTPUT or --device is one line, exit 2, before any work."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_of(scenario, tmp_path), sort_keys=False))
    (tmp_path / "a-file").write_text("mine")
    ran = CliRunner().invoke(main, ["run", str(path), "--log", str(tmp_path / "a-file" / "run.log")])
    assert isinstance(ran.exception, SystemExit) and ran.exit_code == 2, repr(ran.exception)
    assert len(error_lines(ran)) == 1 and error_lines(ran)[0].startswith(f"--log: {tmp_path / 'a-file' / 'run.log'}"), ran.output
    assert (tmp_path / "a-file").read_text() == "mine" and not (tmp_path / "merged").exists()


def test_a_log_file_that_is_a_directory_is_refused_in_one_line(scenario, tmp_path):
    """`run --log DIR`, DIR an existing directory: run answered click's usage error in three lines ("Usage: ... Error:
    Invalid value for '--log': File '...' is a directory."), where an OUTPUT that is a file, or --log naming the
    recipe, is one `featcal-llm: error: ...` line."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_of(scenario, tmp_path), sort_keys=False))
    (tmp_path / "logs").mkdir()
    ran = CliRunner().invoke(main, ["run", str(path), "--log", str(tmp_path / "logs")])
    assert ran.exit_code == 2 and len(error_lines(ran)) == 1 and error_lines(ran)[0].startswith(f"--log: {tmp_path / 'logs'}"), ran.output
    assert "Usage:" not in ran.output and not (tmp_path / "merged").exists()

