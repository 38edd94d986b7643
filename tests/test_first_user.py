"""What a first-time user runs into: the README's commands on their own tiny models and data, and the usual mistakes
(a key at the wrong level, a data entry without the field its format reads by default, an expert with another
tokenizer, a quiet run logged to a file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from scenario import build_scenario


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two experts, two layers, merged once."""
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("first-user"), experts=2, layers=2, samples=8)
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


def _errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("featcal-llm: error:")]


def test_a_quiet_logged_run_keeps_the_summary_table_in_the_log(small, tmp_path):
    """`run -q --log run.log` (a batch job: a quiet terminal, a full log): the log held every stage and layer line but
    not the drift table nor the time line that end a normal run, which the terminal does not show under -q either."""
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    log = tmp_path / "run.log"
    result = CliRunner().invoke(main, ["run", str(recipe), "-q", "--log", str(log)])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # -q: warnings, errors and the result only
    text = log.read_text()
    assert "layer 2/2 calibrated" in text
    assert "drift merged" in text and "drift calibrated" in text and "\ntime " in text, text


def test_a_featcal_key_at_the_top_level_is_refused_by_validate_and_run(small, tmp_path):
    """`samples:` or `refine: true` written at the top level instead of under `featcal:`: validate said 'ok' (or, for
    `samples`, "not a mergekit or featcal key; did you mean 'slices'?"), and the run went on without them. Now both
    refuse it in the same line per key, and the run writes nothing."""
    from agreement import error_lines

    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["samples"] = 4
    recipe["refine"] = True
    output = tmp_path / "out"
    recipe["featcal"]["output"] = str(output)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert validated.exit_code == 2 and ran.exit_code == 2, (validated.output, ran.output)
    lines = error_lines(validated)
    assert error_lines(ran) == lines
    for key in ("samples", "refine"):
        (line,) = [line for line in lines if f": {key}: " in line]
        assert f"{path}" in line and "a featcal key" in line and "under featcal:" in line and "slices" not in line, line
    assert not output.exists()
    for result in (validated, ran):  # the key is refused, not also warned about as a misspelt mergekit key
        assert "did you mean 'slices'" not in result.output, result.output


def _data_recipe(small, tmp_path, records: list[dict], entry: dict) -> "Path":  # noqa: F821
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    recipe = yaml.safe_load(small.recipe.read_text())
    first = next(iter(recipe["featcal"]["data"]))
    recipe["featcal"]["data"][first] = {"path": str(data), **entry}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("records, entry, hint", [
    ([{"instruction": "add 2 and 3", "input": "", "answer": "5"}] * 12, {"format": "alpaca", "response": "reply"}, "response: answer"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 12,
     {"format": "chat", "prompt": "prompt"}, "messages: messages"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 12, {"format": "text"},
     "format: chat, messages: messages"),
], ids=["alpaca-answer", "chat-messages", "text-on-messages"])
def test_a_missing_default_field_names_the_key_to_set(small, tmp_path, records, entry, hint):
    """Records that hold what the entry reads under another name; validate said "record 0 has no field 'response'
    (fields: instruction, input, answer)" and left the user to find out which key of the entry names it. (Stanford
    Alpaca's `output` and a `messages` column are read by default: tests/test_data_field_defaults.py.)"""
    path = _data_recipe(small, tmp_path, records, entry)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    (line,) = _errors(result)
    assert "has no field" in line and f"write `{hint}` in this entry" in line, line


def test_an_expert_with_another_tokenizer_is_refused_with_the_recipe_and_the_fix(small, tmp_path):
    """An expert whose tokenizer gives its tokens other ids: run answered "expert X: tokenizer maps 'V' to 42, the
    calibration tokenizer to 61", without the recipe every other error starts with, or what to do."""
    from agreement import expert_of_other_token_ids

    recipe = yaml.safe_load(small.recipe.read_text())
    alien = expert_of_other_token_ids(recipe, 0, tmp_path / "alien")
    recipe["featcal"]["output"] = str(tmp_path / "out")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 2, result.output
    (line,) = _errors(result)
    assert line.startswith(f"featcal-llm: error: {path}: expert {alien}: tokenizer maps "), line
    assert "(read from " in line and "must give its tokens the same ids" in line, line


def test_a_key_one_level_off_is_told_where_it_goes(small, tmp_path):
    """Two indentation slips: the data entries written level with `data:` (validate said "featcal.data: Input should be
    a valid dictionary (got null)" and "featcal.EXPERT: unknown key"), and `lambda:` inside a data entry ("unknown key")."""
    recipe = yaml.safe_load(small.recipe.read_text())
    entries = recipe["featcal"].pop("data")
    recipe["featcal"]["data"] = None
    recipe["featcal"].update(entries)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    errors = _errors(result)
    for name in entries:
        (line,) = [e for e in errors if f": featcal.{name}: " in e]
        assert "an expert of models:" in line and "under featcal.data:" in line, line
    (data,) = [e for e in errors if ": featcal.data: " in e]
    assert "valid dictionary" not in data and "one entry per expert" in data, data
    recipe = yaml.safe_load(small.recipe.read_text())
    next(iter(recipe["featcal"]["data"].values()))["lambda"] = 0.1
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["validate", str(path)])
    (misplaced,) = _errors(result)
    assert misplaced.endswith(".lambda: unknown key here: a key of featcal: or featcal.head: (move it there)"), misplaced


@pytest.mark.parametrize("edit, key, home", [
    (lambda block, entry: block.update(steps=4), "featcal.steps", "featcal.refine:"),  # was: did you mean 'eps'?
    (lambda block, entry: block.update(refine={"holdout": 0.1}), "featcal.refine.holdout", "featcal.tune:"),
    (lambda block, entry: block.update(tune={"steps": 4}), "featcal.tune.steps", "featcal.refine:"),
    (lambda block, entry: block.update(refine={"tune": {"budget": 4}}), "featcal.refine.tune", "featcal:"),
    (lambda block, entry: entry.update(temperature=0.5), "featcal.data.{expert}.temperature", "featcal.data.{expert}.generate:"),
    (lambda block, entry: block.update(generate={"samples": 4}), "featcal.generate", "featcal.data.EXPERT:"),
])
def test_a_key_of_another_section_is_told_its_section(small, tmp_path, edit, key, home):
    """A refine, tune or sampling key one level off: pydantic's nearest spelling at its level pointed the wrong way
    (`featcal.steps: unknown key; did you mean 'eps'?`) or said nothing. validate and run print the same line."""
    recipe = yaml.safe_load(small.recipe.read_text())
    expert, entry = next(iter(recipe["featcal"]["data"].items()))
    edit(recipe["featcal"], entry)
    output = tmp_path / "out"
    recipe["featcal"]["output"] = str(output)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    expected = f"featcal-llm: error: {path}: {key.format(expert=expert)}: unknown key here: a key of {home.format(expert=expert)} (move it there)"
    for command in ("validate", "run"):
        result = CliRunner().invoke(main, [command, str(path)])
        assert result.exit_code == 2, result.output
        assert _errors(result) == [expected], (command, result.output)
    assert not output.exists()


def test_data_written_as_a_list_is_told_its_form(small, tmp_path):
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["data"] = list(recipe["featcal"]["data"].values())
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["validate", str(path)])
    (line,) = _errors(result)
    assert ": featcal.data: expected a mapping: one entry per expert, keyed by its name under models:" in line, line
    assert "valid dictionary" not in line and "(got [" in line, line


def test_a_data_file_found_nowhere_says_where_it_was_looked_for(small, tmp_path, monkeypatch):
    """A recipe in configs/, run from the project folder, with `path: code.jsonl` (the file is in data/): validate said
    "code.jsonl: calibration file not found", where a relative path is looked for in two places (the current directory,
    then beside the recipe; docs/how-it-works.md#paths)."""
    recipe = yaml.safe_load(small.recipe.read_text())
    first = next(iter(recipe["featcal"]["data"]))
    recipe["featcal"]["data"][first]["path"] = "code.jsonl"
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    for command in (["validate", "configs/r.yaml"], ["run", "configs/r.yaml"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2
        (line,) = _errors(result)
        assert "code.jsonl: calibration file not found in the current directory nor beside the recipe (configs)" in line, line


def test_each_logged_run_starts_with_a_dated_line_naming_the_command(small, tmp_path):
    """`--log run.log` appends: two runs into one file read as one stream of HH:MM:SS lines, with no line where the
    second starts, what it ran (--force?) or on which day."""
    import re

    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    log = tmp_path / "run.log"
    for extra in ([], ["--force"]):
        result = CliRunner().invoke(main, ["run", str(recipe), "--log", str(log), "-q", *extra])
        assert result.exit_code == 0, result.output
    starts = [line for line in log.read_text().splitlines() if line.startswith("=== ")]
    assert len(starts) == 2, log.read_text()
    assert re.match(r"=== \d{4}-\d\d-\d\d \d\d:\d\d:\d\d featcal-llm \S+: run .*r\.yaml", starts[0]), starts
    assert "--force" not in starts[0] and " --force" in starts[1], starts


def test_the_card_s_recipe_shortens_a_relative_output_as_it_does_merged(small, tmp_path, monkeypatch):
    """`merged: out/merged, output: out/featcal` (relative, as the README writes them): the card's Recipe section,
    "local paths shortened to their names", showed `merged: merged` but `output: out/featcal` (the folder did not exist
    yet when the card was written)."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(small.root / "merged", tmp_path / "out" / "merged")
    recipe = small.write_recipe(tmp_path / "r.yaml", merged="out/merged", output="out/featcal")
    result = CliRunner().invoke(main, ["run", str(recipe), "-q"])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "out" / "featcal" / "README.md").read_text()
    section = card.split("## Recipe", 1)[1]
    assert "  merged: merged\n" in section and "  output: featcal\n" in section, section


def test_the_summary_table_says_what_its_columns_measure(small, tmp_path):
    """The table a run ends with, "expert  drift merged  drift calibrated  KL merged  KL calibrated", said on what
    records it measured but not what drift is or that lower is better: a first reader could not tell a row that got
    worse from one that got better."""
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    result = CliRunner().invoke(main, ["run", str(recipe)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("expert ") and "drift merged" in line)
    legend = [line for line in lines[start:] if line.startswith("drift: ")]
    assert legend and "lower is closer to the expert" in legend[0], lines[start:]


def test_a_missing_required_key_says_what_it_is_for(small, tmp_path):
    """`featcal.merged` forgotten (a mergekit user has no such folder yet): validate said "featcal.merged: required key
    is missing", where the README's one-line answer is that it is where the run writes mergekit's merge."""
    recipe = yaml.safe_load(small.recipe.read_text())
    del recipe["featcal"]["merged"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["validate", str(path)])
    (line,) = _errors(result)
    assert line.endswith("featcal.merged: required key is missing: directory of the mergekit merge (written by the run "
                         "when it does not exist)"), line


def test_demo_quick_says_it_checks_the_pipeline_not_the_method():
    """`demo --quick`, the seconds-long way to try an install, ends on a table of 0.0 for every model and "there is no gap
    to recover"; its help said only "A seconds-long reduced scenario (used by the test suite)"."""
    result = CliRunner().invoke(main, ["demo", "-h"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--quick" in text and "often 0.0" in text and "without --quick" in text, text


def test_a_data_key_written_as_the_folder_name_names_the_expert(small, tmp_path):
    """`models: [{model: models/wiki}]` with `data: {wiki: ...}` (the card and the table call the expert `wiki`):
    validate said "featcal.data.wiki: not an expert of this recipe (experts: ...)" and, for the same slip, "featcal.data:
    no calibration data for expert 'models/wiki'"."""
    recipe = yaml.safe_load(small.recipe.read_text())
    data = recipe["featcal"]["data"]
    first = next(iter(data))
    short = first.rsplit("/", 1)[1]
    recipe["featcal"]["data"] = {(short if key == first else key): value for key, value in data.items()}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = CliRunner().invoke(main, ["validate", str(path)])
    (line,) = _errors(result)
    assert f"featcal.data.{short}: not an expert of this recipe" in line and f"did you mean {first!r}?" in line, line


def test_the_table_marks_an_expert_the_calibration_took_the_model_farther_from():
    """A row whose KL rose above the merge's (the broad setting's harm: a kind of text made worse than the merge) is
    marked `!` and the mark explained; a row that fell, or equal, or unmeasured, is not."""
    from featcal_llm.calibration_result import CalibrationResult, ExpertSummary

    experts = {"models/up": ExpertSummary(0.40, 0.45, 0.30, 0.31), "models/down": ExpertSummary(0.40, 0.20, 0.30, 0.10),
               "models/same": ExpertSummary(0.40, 0.40, 0.30, 0.30), "models/none": ExpertSummary(None, None, None, None)}
    rows = CalibrationResult(Path("out"), Path("merged"), experts).table().splitlines()
    marked = [row.split()[0] for row in rows[2:6] if row.endswith("  !")]
    assert marked == ["up"], rows
    assert ("! KL calibrated above KL merged: on these records the calibrated model predicts this expert's next tokens "
            "worse than the merged model did") in rows
    assert not any(row.startswith("! ") for row in CalibrationResult(Path("out"), Path("merged"), {
        "models/down": experts["models/down"]}).table().splitlines())


def test_a_folder_whose_path_holds_a_plus_is_refused_by_validate_and_run_alike(tmp_path):
    """Models under `runs/a+b/`: mergekit reads `+` as model+adapter (model `runs/a`, hub adapter `b/base`); validate
    said ok (the 'hub ids' left to --online) and run failed looking the adapter up on the hub."""
    from agreement import error_lines

    scenario = build_scenario(tmp_path / "a+b", experts=2, layers=1, samples=4)
    validated = CliRunner().invoke(main, ["validate", str(scenario.recipe)])
    ran = CliRunner().invoke(main, ["run", str(scenario.recipe)])
    assert validated.exit_code == 2 and ran.exit_code == 2, (validated.output, ran.output)
    lines = error_lines(validated)
    assert error_lines(ran) == lines and len(lines) == 3, lines  # the base and the two experts, one line each
    base = next(line for line in lines if ": base_model: " in line)
    assert f"{scenario.base}: mergekit reads '+' as model+adapter (model {tmp_path / 'a'}, adapter b/base)" in base, base
    assert not (tmp_path / "a+b" / "merged").exists()
