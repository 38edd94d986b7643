"""Bad input: one line naming the culprit, a non-zero exit, nothing written (issues 2 and 4)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from featcal_llm.cli import main
from featcal_llm.tiny import (
    build_char_tokenizer,
    new_tiny_llama,
    save_model,
    tiny_llama_config,
)


def _odd_expert(recipe, tmp_path, **overrides) -> None:
    """Replace the last expert by a freshly built model whose config differs by `overrides`."""
    tokenizer = build_char_tokenizer()
    settings = dict(num_hidden_layers=3, vocab_size=len(tokenizer))
    settings.update(overrides)
    config = tiny_llama_config(**settings)
    odd = save_model(new_tiny_llama(config, seed=5), tokenizer, tmp_path / "odd-expert")
    _replace_expert(recipe, odd)


def _replace_expert(recipe, new_path) -> None:
    old = recipe["models"][-1]["model"]
    recipe["models"][-1]["model"] = str(new_path)
    recipe["featcal"]["data"][str(new_path)] = recipe["featcal"]["data"].pop(old)


def _first_data(recipe) -> dict:
    return recipe["featcal"]["data"][recipe["models"][0]["model"]]


def _data_file(recipe, tmp_path, content: str) -> None:
    path = tmp_path / "cal.jsonl"
    path.write_text(content)
    _first_data(recipe)["path"] = str(path)


def _chat_template_refusing_a_system_turn(recipe, tmp_path) -> None:
    """A tokenizer whose chat template raises on a system turn (as Gemma's does), and chat records that open with one."""
    base = tmp_path / "strict-base"
    shutil.copytree(recipe["base_model"], base, symlinks=True, ignore=shutil.ignore_patterns("chat_template.jinja"))
    (base / "chat_template.jinja").write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                                              "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    recipe["featcal"]["tokenizer"] = str(base)  # the records' tokenizer (else the merge's)
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    _data_file(recipe, tmp_path, json.dumps({"messages": turns}) + "\n")
    _first_data(recipe).update(format="chat", messages="messages")


def _copy_merged(recipe, tmp_path) -> Path:
    copy = tmp_path / "merged-copy"
    shutil.copytree(recipe["featcal"]["merged"], copy)
    recipe["featcal"]["merged"] = str(copy)
    return copy


def _drop_tensor_from_shard(recipe, tmp_path):
    merged = _copy_merged(recipe, tmp_path)
    shard = merged / "model.safetensors"
    tensors = load_file(shard)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in [*tensors, "model.layers.1.mlp.up_proj.weight"]}}
    (merged / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_to_missing_shard(recipe, tmp_path):
    merged = _copy_merged(recipe, tmp_path)
    tensors = load_file(merged / "model.safetensors")
    weight_map = {name: "model.safetensors" for name in tensors}
    weight_map["model.layers.0.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors"
    (merged / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _pickled_expert(recipe, tmp_path):
    source = Path(recipe["models"][-1]["model"])
    pickled = tmp_path / "pickled-expert"
    pickled.mkdir()
    shutil.copy(source / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not really a pickle")
    _replace_expert(recipe, pickled)


def _set(*path, value):
    def mutate(recipe, _tmp):
        target = recipe
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _text(content: str):
    def write(_recipe, tmp_path) -> str:
        (tmp_path / "bad.yaml").write_text(content)
    write.raw = True
    return write


CASES = {
    "recipe is not YAML": (_text("merge_method: [task_arithmetic\n"), ["bad.yaml: not valid YAML"]),
    "recipe is not a mapping": (_text("- a\n- b\n"), ["bad.yaml: expected a YAML mapping"]),
    "featcal block missing": (lambda r, _: r.pop("featcal"), ["bad.yaml: featcal: block is missing"]),
    "merge_method missing": (lambda r, _: r.pop("merge_method"), ["bad.yaml: merge_method: required key is missing"]),
    "unknown key": (_set("featcal", "lamda", value=0.1), ["bad.yaml: featcal.lamda: unknown key"]),
    "misspelled key": (_set("featcal", "aplha", value=0.1), ["bad.yaml: featcal.aplha: unknown key"]),
    "lambda not positive": (_set("featcal", "lambda", value=0.0), ["bad.yaml: featcal.lambda:", "greater than 0"]),
    "alpha above one": (_set("featcal", "alpha", value=1.5), ["bad.yaml: featcal.alpha:", "less than or equal to 1"]),
    "eps not positive": (_set("featcal", "eps", value=-1e-8), ["bad.yaml: featcal.eps:", "greater than 0"]),
    "samples below one": (_set("featcal", "samples", value=0), ["bad.yaml: featcal.samples:", "greater than or equal to 1"]),
    "max_length below two": (_set("featcal", "max_length", value=1), ["bad.yaml: featcal.max_length:", "greater than or equal to 2"]),
    "unknown projection": (_set("featcal", "modules", value=["q_proj", "qkv_proj"]), ["featcal.modules: unknown projection 'qkv_proj'"]),
    "cuda without a GPU": (_set("featcal", "device", value="cuda"), ["featcal.device: cuda requested but CUDA is not available"]),
    "missing data entry": (lambda r, _: r["featcal"]["data"].pop(r["models"][1]["model"]), ["bad.yaml: featcal.data: no calibration data for expert", "expert1"]),
    "data for a non-expert": (lambda r, _: r["featcal"]["data"].__setitem__("someone/else", {"path": "x.jsonl"}), ["featcal.data.someone/else: not an expert"]),
    "expert path does not exist": (lambda r, t: _replace_expert(r, t / "no-such-expert"), ["no-such-expert: model directory does not exist"]),
    "base path does not exist": (lambda r, t: r.__setitem__("base_model", str(t / "no-base")), ["base_model", "no-base: model directory does not exist"]),
    "expert of another architecture": (
        lambda r, t: (_odd_expert(r, t), _patch_json(t / "odd-expert" / "config.json", architectures=["MistralForCausalLM"], model_type="mistral")),
        ["odd-expert/config.json", "architecture ['MistralForCausalLM']"],
    ),
    "expert with another layer count": (lambda r, t: _odd_expert(r, t, num_hidden_layers=2), ["odd-expert/config.json", "num_hidden_layers = 2"]),
    "expert with another hidden size": (lambda r, t: _odd_expert(r, t, hidden_size=32), ["odd-expert/config.json", "hidden_size = 32"]),
    "expert with another intermediate size": (lambda r, t: _odd_expert(r, t, intermediate_size=96), ["odd-expert/config.json", "intermediate_size = 96"]),
    # the recipe's merge is featcal-llm's, made from the expert replaced: run would merge again, so the rows are compared
    # with the base's first (the calibration tokens past row 20: tests/test_review_fixes.py, tests/test_tokenizer_sources.py)
    "expert vocabulary too small": (lambda r, t: _odd_expert(r, t, vocab_size=20), ["odd-expert/config.json: vocabulary of 20 rows, the base model has 100"]),
    "pickled .bin weights": (_pickled_expert, ["pickled-expert", "only pickled .bin weights found"]),
    "tensor missing from its shard": (_drop_tensor_from_shard, ["model.layers.1.mlp.up_proj.weight listed in the index is missing from the shard"]),
    "index points at a missing shard": (_index_to_missing_shard, ["points at missing shard file model-00002-of-00002.safetensors"]),
    "calibration file missing": (lambda r, t: _first_data(r).__setitem__("path", str(t / "nowhere.jsonl")), ["bad.yaml: featcal.data.", "nowhere.jsonl: calibration file not found"]),
    "a data format misspelt": (lambda r, t: _first_data(r).__setitem__("format", "txt"), [
        "format: Input should be 'text', 'alpaca', 'chat' or 'completion' (got 'txt'); did you mean 'text'?"]),
    "calibration file misspelt": (lambda r, t: ((t / "json_calib.jsonl").write_text('{"text": "a b"}\n'),
                                                _first_data(r).__setitem__("path", str(t / "json_calb.jsonl"))),
                                  ["json_calb.jsonl: calibration file not found; did you mean ", "json_calib.jsonl'?"]),
    "calibration file empty": (lambda r, t: _data_file(r, t, ""), ["cal.jsonl: file is empty"]),
    "calibration file unreadable": (lambda r, t: _data_file(r, t, "{not json\n"), ["cal.jsonl: cannot load calibration data"]),
    "calibration field missing": (lambda r, t: _data_file(r, t, '{"body": "x"}\n'), ["record 0 has no field 'text'"]),
    "a chat template that refuses a record": (_chat_template_refusing_a_system_turn, [
        "bad.yaml: featcal.data.", "record 0: the tokenizer's chat template refused it (System role not supported)"]),
    "an empty text": (lambda r, t: _data_file(r, t, '{"text": "ok"}\n{"text": ""}\n'), ["cal.jsonl: record 1: field 'text' is empty; drop the record"]),
    "calibration file of unknown type": (lambda r, t: (_data_file(r, t, "x"), _first_data(r).__setitem__("path", str(_touch(t / "cal.txt")))), ["cal.txt: unsupported file type"]),
    "seed below zero": (_set("featcal", "seed", value=-1), ["bad.yaml: featcal.seed:", "greater than or equal to 0"]),
    "merge seed past numpy's range": (_set("featcal", "merge_options", value={"random_seed": 2**32}),
                                      ["bad.yaml: featcal.merge_options.random_seed:", "less than or equal to 4294967295"]),
    "output is the merged directory": (
        lambda r, t: (r["featcal"].__setitem__("merged", str(t / "same")), r["featcal"].__setitem__("output", str(t / "same"))),
        ["featcal.output:", "same is also featcal.merged", "name another directory"],
    ),
    "output inside the merged directory": (
        lambda r, t: (r["featcal"].__setitem__("merged", str(t / "merge")), r["featcal"].__setitem__("output", str(t / "merge" / "out"))),
        ["featcal.output:", "lies inside featcal.merged", "name a directory outside it"],
    ),
    "output where the merge is staged": (
        lambda r, t: (r["featcal"].__setitem__("merged", str(t / "merge")), r["featcal"].__setitem__("output", str(t / "merge.merging"))),
        ["featcal.output:", "merge.merging is where a merge into featcal.merged", "is staged", "name another directory"],
    ),
    "no projection to re-fit": (_set("featcal", "modules", value=[]), ["bad.yaml: featcal.modules:", "at least 1 item"]),
    "lambda infinite": (_set("featcal", "lambda", value=float("inf")), ["bad.yaml: featcal.lambda: expected a finite number"]),
    "eps infinite": (_set("featcal", "eps", value=float("inf")), ["bad.yaml: featcal.eps: Input should be a finite number"]),
    "max_length past any context": (_set("featcal", "max_length", value=2**64), ["featcal.max_length:", "less than or equal to 16777216"]),
    "output empty": (_set("featcal", "output", value=""), ["bad.yaml: featcal.output: String should have at least 1 character"]),
    "output under ~": (_set("featcal", "output", value="~/calibrated"), ["featcal.output: ~/calibrated: run takes a path as written"]),
    "a record past the first without the field": (lambda r, t: _data_file(r, t, '{"text": "ok"}\n{"body": "x"}\n'),
                                                   ["cal.jsonl: record 1: field 'text' is null (or missing"]),
    "a calibration file that is not UTF-8": (lambda r, t: _latin1_data_file(r, t), ["cal.jsonl: cannot load calibration data (not UTF-8 text: byte b'\\xe9' on line 2"]),
    "a dtype mergekit does not merge in": (lambda r, _: r.__setitem__("dtype", "fp8"), ["bad.yaml: dtype: fp8: mergekit merges in bfloat16, float16"]),
    "a dtype written as torch's name": (lambda r, _: r.__setitem__("dtype", "torch.float32"),
                                        ["bad.yaml: dtype: torch.float32: write float32 (mergekit would write torch.float32 into"]),
    "a whole-number merge": (lambda r, _: r.__setitem__("out_dtype", "int64"), ["bad.yaml: out_dtype: int64: a merge of whole numbers"]),
    "an expert listed twice": (lambda r, _: r["models"].append(dict(r["models"][0])), ["bad.yaml: models:", "is listed 2 times; list each model once"]),
    "the base as an expert": (lambda r, _: _replace_expert(r, r["base_model"]), ["this is the base_model, not an expert"]),
    "tokenizer is a file": (lambda r, t: r["featcal"].__setitem__("tokenizer", str(_touch(t / "tokenizer.json"))),
                            ["featcal.tokenizer:", "tokenizer.json: a file; name the directory that holds it"]),
    "merge in an unwritable place": (lambda r, t: r["featcal"].__setitem__("merged", str(_touch(t / "a-file") / "merged")),
                                     ["featcal.merged:", "a-file is not a directory"]),
    "a merge made again over an expert inside it": (lambda r, t: _expert_inside_the_merge(r, t), ["featcal.merged:", "holds the expert", "deleting it"]),
    "output under a file": (lambda r, t: r["featcal"].__setitem__("output", str(_touch(t / "a-file") / "out")), ["featcal.output", "a-file is not a directory"]),
}


def _linked(source: Path, link: Path) -> Path:
    """A link to a shared test model, so that a run that failed to refuse could delete only the link."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(source.resolve(), target_is_directory=True)
    return link


def _latin1_data_file(recipe, tmp_path) -> None:
    """A file written in Latin-1: run's reader (Arrow) had failed on it with a traceback."""
    path = tmp_path / "cal.jsonl"
    path.write_bytes('{"text": "plain"}\n{"text": "café"}\n'.encode("latin-1"))
    _first_data(recipe)["path"] = str(path)


def _expert_inside_the_merge(recipe, tmp_path):
    """A merge featcal-llm made (it may merge again over it) that holds one of the experts (a link to it)."""
    merged = tmp_path / "merge"
    shutil.copytree(recipe["featcal"]["merged"], merged)
    _replace_expert(recipe, _linked(Path(recipe["models"][-1]["model"]), merged / "expert"))
    recipe["featcal"]["merged"] = str(merged)


def _touch(path: Path) -> Path:
    path.write_text("x")
    return path


def _patch_json(path: Path, **values) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def _recipe(scenario, tmp_path, mutate) -> tuple[Path, Path]:
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    path = tmp_path / "bad.yaml"
    if getattr(mutate, "raw", False):
        mutate(recipe, tmp_path)
        return path, tmp_path / "out"
    mutate(recipe, tmp_path)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path, Path(recipe.get("featcal", {}).get("output") or tmp_path / "out")


def test_the_matrix_has_at_least_twenty_cases():
    assert len(CASES) >= 20


def assert_refused_in_one_line(scenario, tmp_path, mutate, expected: list[str]) -> None:
    """Running the mutated recipe exits 2 with one `featcal-llm: error:` line holding every fragment, and writes nothing."""
    recipe, output = _recipe(scenario, tmp_path, mutate)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(main, ["run", str(recipe)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, lines, result.exception)
    assert all(line.startswith("featcal-llm: ") for line in lines), lines  # no traceback, no noise
    errors = [line for line in lines if line.startswith("featcal-llm: error: ")]
    assert len(errors) == 1, lines
    message = errors[0]
    for fragment in expected:
        assert fragment in message, (fragment, message)
    assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "something was written"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line(merged_scenario, tmp_path, case):
    mutate, expected = CASES[case]
    assert_refused_in_one_line(merged_scenario, tmp_path, mutate, expected)


def test_existing_output_is_refused_without_force(merged_scenario, tmp_path):
    recipe, output = _recipe(merged_scenario, tmp_path, lambda r, _: None)
    output.mkdir()
    (output / "featcal_recipe.yml").write_text("an earlier output's")
    (output / "keep.txt").write_text("mine")
    result = subprocess.run([sys.executable, "-m", "featcal_llm", "run", str(recipe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("already exists (pass --force, or force=True to calibrate(), to replace it)")
    assert (output / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_force_replaces_only_an_earlier_output(merged_scenario, tmp_path, kind):
    """`run recipe.yaml ~ --force` would have replaced the home folder: --force replaces an earlier featcal-llm output
    (its featcal_recipe.yml) or an empty folder, never a file or a folder of other things; validate says so too."""
    import featcal_llm

    recipe, output = _recipe(merged_scenario, tmp_path, lambda r, _: None)
    if kind == "folder":
        output.mkdir()
        (output / "keep.txt").write_text("mine")
    else:
        output.write_text("mine")
    what = "a folder that is no featcal-llm output (it has no featcal_recipe.yml)" if kind == "folder" else "a file"
    line = f"featcal.output: {output} is {what}: --force replaces only an earlier output; name another directory"
    result = CliRunner().invoke(main, ["run", str(recipe), "--force"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [f"featcal-llm: error: {recipe}: {line}"]
    assert [str(problem) for problem in featcal_llm.validate(recipe)] == [f"{recipe}: {line}"]
    assert (output / "keep.txt" if kind == "folder" else output).read_text() == "mine"


@pytest.mark.parametrize("holder", ["models", "models/last"])
def test_output_over_an_input_is_refused_even_with_force(merged_scenario, tmp_path, holder):
    """`--force` replaces an old output, never an input: an output that is a model of the recipe, or holds one (here a
    link to the last expert), is refused before the merge, and the input is still there."""
    def mutate(recipe, tmp):
        _replace_expert(recipe, _linked(Path(recipe["models"][-1]["model"]), tmp / "models" / "last"))
        recipe["featcal"]["output"] = str(tmp / holder)

    recipe, output = _recipe(merged_scenario, tmp_path, mutate)
    result = CliRunner().invoke(main, ["run", str(recipe), "--force"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("featcal-llm: error: ")]
    assert result.exit_code == 2 and len(errors) == 1, result.stderr
    verb = "is also" if holder.endswith("last") else "holds"
    assert f"featcal.output: {output} {verb} the expert {tmp_path / 'models' / 'last'}" in errors[0], errors[0]
    assert (tmp_path / "models" / "last" / "config.json").is_file()


@pytest.mark.parametrize("where", ["recipe", "data", "output"])
def test_the_log_file_may_not_be_an_input_or_inside_the_output(merged_scenario, tmp_path, where):
    """`--log` appends from the start: onto the recipe or a calibration file it corrupted them, and inside the output
    it created that folder before the checks (the next run then found it existing). Refused first, nothing written."""
    recipe, output = _recipe(merged_scenario, tmp_path, lambda r, _: None)
    data = Path(next(iter(yaml.safe_load(recipe.read_text())["featcal"]["data"].values()))["path"])
    log = {"recipe": recipe, "data": data, "output": output / "run.log"}[where]
    before = {path: path.read_bytes() for path in (recipe, data)}
    result = CliRunner().invoke(main, ["run", str(recipe), "--log", str(log)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"featcal-llm: error: --log: {log} "), lines
    assert ("which the run writes as a whole" if where == "output" else "which the run reads; name another file") in lines[0]
    assert {path: path.read_bytes() for path in before} == before and not output.exists()


def test_an_output_argument_under_a_tilde_is_refused_as_featcal_output_is(merged_scenario, tmp_path, monkeypatch):
    """`run RECIPE '~/x'` (quoted, or `calibrate(output="~/x")`) had made a folder named `~` here, which a later
    `rm -rf ~` to clean it up would turn into the home folder's removal."""
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    recipe, _ = _recipe(merged_scenario, tmp_path, lambda r, _: None)
    result = CliRunner().invoke(main, ["run", str(recipe), "~/calibrated"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1] == (
        f"featcal-llm: error: {recipe}: OUTPUT: ~/calibrated: run takes a path as written, so `~` would be a folder of "
        "that name here; write the path out in full")
    with pytest.raises(featcal_llm.FeatCalError, match="OUTPUT: ~/calibrated: run takes a path as written"):
        featcal_llm.calibrate(recipe, output="~/calibrated", progress=False)
    assert not (tmp_path / "~").exists()


def test_a_tokenizer_folder_with_a_config_but_no_vocabulary_is_named_as_such(tmp_path):
    """A LoRA adapter folder that copied only tokenizer_config.json: transformers' own message listed the files it had
    tried as "one of: " and nothing; the line says which file is missing."""
    import json

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.tokenizers import load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(FeatCalError) as error:
        load_tokenizer(tmp_path, "expert e", False)
    assert str(error.value) == (f"expert e: {tmp_path}: cannot load a tokenizer: it has tokenizer_config.json but no vocabulary "
                                "file (tokenizer.json, tokenizer.model, vocab.json); copy the tokenizer's files there")
