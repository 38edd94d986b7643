"""`validate` says what `run` will say about the models: configs, tokenizers and their vocabularies, chat templates,
weight shards, one model named two ways (each test one edit of a recipe, both commands asked)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from agreement import (error_lines, expert_of, expert_with_a_quantization_config, model_path_typo, recipe_of,
                       refused_alike, without_chat_template, write_edited)


def test_a_model_path_typo_is_one_error_that_never_renames_the_data_key(scenario, tmp_path):
    recipe = write_edited(scenario, tmp_path, model_path_typo)
    (line,) = error_lines(CliRunner().invoke(main, ["validate", str(recipe)]))
    right = expert_of(recipe_of(scenario, tmp_path), 1)
    assert line == f"{recipe}: models: {right}x: model directory does not exist; did you mean {right!r} (featcal.data names it)?"


def test_run_reads_every_config_with_the_same_quantization_check(scenario, tmp_path):
    """run's own config reader (for the merge it makes too, which validate cannot read first) refuses what validate does."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.stages.prepare import _load_config

    recipe = recipe_of(scenario, tmp_path)
    expert_with_a_quantization_config(recipe, tmp_path)
    with pytest.raises(FeatCalError, match=r"^merge: .*quantized/config.json: quantization_config \(bitsandbytes\): featcal-llm "):
        _load_config(tmp_path / "quantized", "merge", False)
    assert _load_config(Path(recipe["base_model"]), "base", False).num_hidden_layers == 3


def test_validate_reads_a_hub_models_cached_config_for_quantization_too(scenario, tmp_path, monkeypatch):
    """A hub expert whose config.json (from the local cache) declares quantized weights: validate refuses it as run does."""
    import featcal_llm.io.validate as validate
    import featcal_llm.io.validate_models as validate_models

    recipe = recipe_of(scenario, tmp_path)
    config = json.loads((Path(recipe["base_model"]) / "config.json").read_text())
    recipe["featcal"]["data"]["org/quant"] = recipe["featcal"]["data"].pop(expert_of(recipe, 1))
    recipe["models"][1]["model"] = "org/quant"
    path = tmp_path / "hub.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    cached = {"org/quant": {**config, "quantization_config": {"quant_method": "gptq"}}}
    monkeypatch.setattr(validate_models, "hub_config", lambda model_path, online: cached.get(model_path.path))
    assert [str(problem) for problem in validate.validate_recipe(path)] == [
        f"{path}: models: org/quant: org/quant/config.json: quantization_config (gptq): featcal-llm merges and calibrates "
        "unquantized weights; give the unquantized checkpoint (where the block is a leftover over plain weights, as peft's "
        "merge_and_unload can leave one, delete it)"]


def test_a_tokenizer_named_like_a_hub_id_is_noted_or_caught_as_a_typo(scenario, tmp_path, monkeypatch):
    """`featcal.tokenizer: org/name` is a hub id to run (transformers fetches it): validate notes it as unchecked, as it
    notes hub models, looks it up with --online, and a close local name is a typo, refused at once."""
    import featcal_llm.io.validate_models as validate_models
    from featcal_llm.io.validate import check_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "toks" / "base").mkdir(parents=True)
    recipe = recipe_of(scenario, tmp_path)
    for name, expected in (("someorg/sometok", None), ("toks/bse", "toks/bse: tokenizer directory does not exist")):
        recipe["featcal"]["tokenizer"] = name
        path = tmp_path / "tok.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        report = check_recipe(path, plan=False)
        if expected is None:
            assert report.problems == [] and "someorg/sometok (tokenizer)" in " ".join(report.summary_notes())
            looked = []
            monkeypatch.setattr(validate_models, "hub_lookup", lambda kind, repo, *a: looked.append((kind, repo)))
            assert check_recipe(path, online=True, plan=False).problems == [] and looked[-1] == ("model", "someorg/sometok")
        else:
            assert [(p.key, p.message) for p in report.problems] == [("featcal.tokenizer", expected + " (toks/ is a local directory, so it is no hub id); did you mean 'toks/base'?")]


def test_chat_records_take_the_template_the_merge_is_given(scenario, tmp_path):
    """Base and experts without a chat template, `chat_template: chatml` in the merge: validate and run accept chat
    records (both had refused them), which are rendered with the merge's template, the one the output serves."""
    from featcal_llm.pipeline import run_recipe

    recipe = recipe_of(scenario, tmp_path)
    recipe["base_model"] = without_chat_template(recipe["base_model"], tmp_path / "plain-base")
    for index in range(len(recipe["models"])):
        plain = without_chat_template(expert_of(recipe, index), tmp_path / f"plain-expert{index}")
        recipe["featcal"]["data"][plain] = recipe["featcal"]["data"].pop(expert_of(recipe, index))
        recipe["models"][index]["model"] = plain
    turns = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo, fine"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(4)))
    recipe["featcal"]["data"][expert_of(recipe, 0)] = {"path": str(tmp_path / "chat.jsonl"), "format": "chat", "messages": "messages"}
    recipe["chat_template"] = "chatml"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0
    output = run_recipe(path, progress=False)
    assert "<|im_start|>" in (output / "tokenizer_config.json").read_text() + "".join(
        p.read_text() for p in output.glob("chat_template.jinja"))


def test_a_merge_mergekit_wrote_without_a_tokenizer_is_refused(scenario, tmp_path, monkeypatch):
    """mergekit logs a failed tokenizer copy ("the merge was still successful") and writes the merge without one."""
    import mergekit.merge

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    def broken(*args, **kwargs):
        raise OSError("disk hiccup")

    monkeypatch.setattr(mergekit.merge, "_copy_tokenizer", broken)
    with pytest.raises(FeatCalError, match="mergekit wrote the merge without a tokenizer"):
        ensure_merged(load_recipe(scenario.recipe), tmp_path / "merged", "cpu")
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.merging").exists()


def test_an_empty_weight_shard_is_refused_alike(scenario, tmp_path):
    """An expert whose shard is a zero-byte file (a download cut short): validate had passed it (it reads the index and
    adapters' headers, not the shards'); run started the merge and failed with exit 1, "mergekit failed to merge the
    recipe: Error while deserializing header: header too small", naming no file."""
    recipe = recipe_of(scenario, tmp_path)
    expert = tmp_path / "cut-short"
    shutil.copytree(recipe["models"][1]["model"], expert, copy_function=os.symlink)
    shard = sorted(expert.glob("*.safetensors"))[0]
    shard.unlink()
    shard.touch()
    recipe["featcal"]["data"][str(expert)] = recipe["featcal"]["data"].pop(recipe["models"][1]["model"])
    recipe["models"][1]["model"] = str(expert)
    assert shard.name in refused_alike(recipe, tmp_path)[0]
    assert not (tmp_path / "merged").exists()


def test_a_damaged_shard_is_told_from_its_header():
    """A safetensors file cut short, one of other bytes and a whole one, written by safetensors itself: the header
    alone tells which can be read (a cut-short shard failed half-way through mergekit's merge)."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    from featcal_llm.io.model_files import damaged_shard

    with tempfile.TemporaryDirectory() as folder:
        whole = Path(folder) / "model.safetensors"
        save_file({"a": torch.ones(64, 64), "b": torch.zeros(8)}, str(whole))
        assert damaged_shard(whole) is None
        size = whole.stat().st_size
        cut = Path(folder) / "cut.safetensors"
        cut.write_bytes(whole.read_bytes()[:-100])
        assert damaged_shard(cut) == f"cut.safetensors: cut short ({size - 100} bytes; its header lists {size}); download it again"
        other = Path(folder) / "other.safetensors"
        other.write_bytes(b"<html>not found</html>" * 4)
        assert damaged_shard(other).startswith("other.safetensors: not a safetensors file")
        empty = Path(folder) / "empty.safetensors"  # a header and no tensor bytes: whole, its header ends the file
        save_file({"e": torch.zeros(0)}, str(empty))
        assert damaged_shard(empty) is None
        assert damaged_shard(cut.with_name("gone.safetensors")).startswith("gone.safetensors: not a safetensors file (FileNotFoundError")


@pytest.mark.parametrize("source, refused", [("Base", True), ("someorg/sometok", False)])
def test_a_tokenizer_source_that_is_no_local_model_is_not_looked_up_without_online(scenario, tmp_path, monkeypatch, source, refused):
    """`tokenizer_source: Base` (a capital B: no such directory) or a hub id: validate refuses the first in one line
    (and run alike), but only after mergekit's tokenizer builder (io/merge_vocabulary.py) asked the Hub for
    Base/resolve/main/config.json, twice: ~50 s of retries on a machine without a network, for validate and run each.
    Without --online validate looks nothing up (a hub id is a note, as for hub models)."""
    import huggingface_hub.file_download as download

    asked = []

    def no_network(url, *args, **kwargs):
        asked.append(url)
        raise OSError("no network in this test")

    monkeypatch.setattr(download, "get_hf_file_metadata", no_network)
    recipe = recipe_of(scenario, tmp_path)
    recipe["tokenizer_source"] = source
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    assert validated.exit_code == (2 if refused else 0), validated.output
    assert asked == [], asked


@pytest.mark.parametrize("spelling", ["link", "slash", "base-link"])
def test_one_model_written_two_ways_is_refused_alike(scenario, tmp_path, spelling):
    """An expert listed again through a link to its folder, or with a trailing slash, or the base listed as an expert
    through a link: both commands had accepted it, and mergekit merged the folder twice (an expert's task vector
    counted double; the base calibrated toward as an expert). The literal repeat was already refused."""
    recipe = recipe_of(scenario, tmp_path)
    first = expert_of(recipe, 0)
    target = recipe["base_model"] if spelling == "base-link" else first
    other = str(tmp_path / "again") if spelling != "slash" else first + "/"
    if spelling != "slash":
        os.symlink(target, other)
    recipe["models"].append({"model": other, "parameters": dict(recipe["models"][0].get("parameters") or {})})
    recipe["featcal"]["data"][other] = dict(recipe["featcal"]["data"][first])
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith(f"r.yaml: models: {target} and {other} are one model (the folder {os.path.realpath(target)}); "
                         "list each model once, written one way") or \
        line.endswith(f"r.yaml: models: {other} and {target} are one model (the folder {os.path.realpath(target)}); "
                      "list each model once, written one way"), line
    assert not (tmp_path / "merged").exists()


def test_one_model_two_ways_is_only_one_local_folder_without_an_adapter(tmp_path):
    """mergekit merges each distinct reference as an input of its own: a folder and a link to it (or the same path with
    a trailing slash) are one model twice; a folder and that folder with a LoRA applied are two models, and references
    that are no local folder (hub ids) name none."""
    import os

    from mergekit.common import ModelReference
    from mergekit.config import MergeConfiguration

    from featcal_llm.io.model_spellings import one_model_two_ways

    (tmp_path / "base").mkdir()
    (tmp_path / "e1").mkdir()
    (tmp_path / "lora").mkdir()
    os.symlink(tmp_path / "e1", tmp_path / "link")

    def found(models, base=str(tmp_path / "base")):
        return one_model_two_ways(MergeConfiguration.model_validate({"merge_method": "task_arithmetic", "base_model": base,
                                                                      "models": [{"model": m} for m in models]}))

    e1, adapted = str(tmp_path / "e1"), f"{tmp_path / 'e1'}+{tmp_path / 'lora'}"
    assert ModelReference.model_validate(adapted) != ModelReference.model_validate(e1)  # two inputs to mergekit
    assert found([e1, adapted]) == []
    assert found(["org/model", "org/model/"], base="org/base") == []
    assert found([e1, str(tmp_path / "base")]) == []  # the base listed as it is written: mergekit's one input
    [line] = found([e1, str(tmp_path / "link")])
    assert line.startswith(f"{e1} and {tmp_path / 'link'} are one model (the folder {os.path.realpath(e1)})")
    [line] = found([e1, e1 + "/"])
    assert line.startswith(f"{e1} and {e1}/ are one model")
    os.symlink(tmp_path / "base", tmp_path / "base-link")
    [line] = found([e1, str(tmp_path / "base-link")])
    assert line.startswith(f"{tmp_path / 'base-link'} and {tmp_path / 'base'} are one model")


@pytest.mark.parametrize(("contents", "why"), [
    (None, "{folder}: not a model directory (no config.json)"),
    ("{oops", "{folder}/config.json: not a readable JSON file (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("[1, 2]", "{folder}/config.json: expected a JSON object (a model config)"),
])
def test_an_experts_unreadable_config_json_is_refused_in_the_words_eval_uses(scenario, tmp_path, contents, why):
    """One reader of a model folder's config.json (io/model_files.read_config_json) for validate, run and eval: the
    same three refusals, named by the recipe's key."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.modelinfo import check_model_dir

    recipe = recipe_of(scenario, tmp_path)
    folder = tmp_path / "odd"
    shutil.copytree(expert_of(recipe, 1), folder, copy_function=os.symlink)
    (folder / "config.json").unlink()
    if contents is not None:
        (folder / "config.json").write_text(contents)
    recipe["featcal"]["data"][str(folder)] = recipe["featcal"]["data"].pop(expert_of(recipe, 1))
    recipe["models"][1]["model"] = str(folder)
    expected = why.format(folder=folder)
    assert refused_alike(recipe, tmp_path) == [f"{tmp_path / 'r.yaml'}: models: {folder}: {expected}"]
    with pytest.raises(FeatCalError) as refused:
        check_model_dir(folder)
    assert str(refused.value) == expected
