"""mergekit ModelReferences read completely (issue 16): `@revision`, `override_architecture`, `trust_remote_code`.

The hub is unreachable in tests: huggingface_hub's listing and snapshot download
are replaced by a fake that serves the local scenario directories and records
the revision it was asked for, so the path through mergekit's own
`ModelReference.local_path` is the real one.
"""

from __future__ import annotations

from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from test_exactness import read_weights
from test_recipe_forms import refused, write_recipe

from featcal_llm.io.merge import ensure_merged
from featcal_llm.io.recipe import load_recipe
from featcal_llm.pipeline import run_recipe
from featcal_llm.io.run_record import read_run_record


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """A 2-layer float64 scenario, its task-arithmetic merge, and that merge calibrated with plain local paths."""
    from scenario import build_scenario

    root = tmp_path_factory.mktemp("refs")
    scenario = build_scenario(root, experts=2, layers=2, samples=4, words=(3, 8), dtype="float64")
    recipe = write_recipe(scenario, root, "plain", merge_of(scenario, [str(p) for p in scenario.experts.values()]))
    scenario.plain = run_recipe(recipe, progress=False)
    scenario.merged = root / "merged_plain"
    return scenario


def merge_of(scenario, experts: list) -> dict:
    return {"merge_method": "task_arithmetic", "base_model": str(scenario.base), "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts]}


@pytest.fixture
def fake_hub(refs, monkeypatch):
    """org/expert1 on the 'hub' is the local expert1; every download's revision is recorded."""
    calls = []

    def list_repo_files(repo, repo_type="model", revision=None):
        return ["config.json", "model.safetensors"]

    def snapshot_download(repo, revision=None, cache_dir=None, allow_patterns=None):
        calls.append((repo, revision))
        if revision == "missing":
            raise OSError("no such revision")
        return str(refs.experts["expert1"])

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_hub_revision_is_downloaded_and_recorded(refs, tmp_path, fake_hub):
    experts = [str(refs.experts["expert0"]), "org/expert1@v2"]
    recipe = write_recipe(refs, tmp_path, "rev", merge_of(refs, experts), experts, merged=str(refs.merged))
    output = run_recipe(recipe, progress=False)
    assert ("org/expert1", "v2") in fake_hub
    ours, plain = read_weights(output), read_weights(refs.plain)
    assert all(torch.equal(ours[n], plain[n]) for n in plain)  # the same expert, the same calibration
    assert read_run_record(output)["models"]["org/expert1@v2"] == {"reference": "org/expert1@v2", "revision": "v2"}


def test_a_supplied_merge_of_a_hub_expert_is_used(refs, tmp_path, fake_hub, capsys):
    """A merge mergekit-yaml made of a hub expert is judged by the snapshot's files, as run resolves it: the same."""
    import shutil

    import yaml

    from featcal_llm.io import merge

    experts = [str(refs.experts["expert0"]), "org/expert1"]
    supplied = tmp_path / "supplied"
    shutil.copytree(refs.merged, supplied, ignore=shutil.ignore_patterns(merge.MARKER, merge.MERGEKIT_CONFIG))
    (supplied / merge.MERGEKIT_CONFIG).write_text(yaml.safe_dump({**merge_of(refs, experts), "dtype": "float64"}))
    recipe = write_recipe(refs, tmp_path, "hub", merge_of(refs, experts), experts, merged=str(supplied))
    merge._settled.clear()
    output = run_recipe(recipe, progress=False)
    assert f"reusing {supplied}" in capsys.readouterr().err
    ours, plain = read_weights(output), read_weights(refs.plain)
    assert all(torch.equal(ours[n], plain[n]) for n in plain)


def test_revision_changes_the_run_fingerprint(refs):
    """A resumed run with another revision starts over: the revision is part of the fingerprint."""
    from featcal_llm.io.references import ModelSource
    from featcal_llm.stages.prepare import run_fingerprint

    recipe = load_recipe(write_recipe(refs, refs.root, "fp", merge_of(refs, [str(p) for p in refs.experts.values()])))
    models = SimpleNamespace(merged=SimpleNamespace(directory=refs.merged))
    runner = SimpleNamespace(device=torch.device("cpu"), dtype="float64", stats_dtype="float64", head_stats_dtype="float64")

    def fingerprint(revision):
        source = ModelSource(f"org/expert1@{revision}", refs.experts["expert1"], None, (revision, None))
        return run_fingerprint(recipe, {"a": [[1, 2]]}, {"a": [[1]]}, models, runner, 256, {"org/expert1": source})

    assert fingerprint("v1") == fingerprint("v1") != fingerprint("v2")


def test_unknown_revision_is_one_line(refs, tmp_path, fake_hub):
    experts = [str(refs.experts["expert0"]), "org/expert1@missing"]
    line = refused(write_recipe(refs, tmp_path, "rev", merge_of(refs, experts), experts, merged=str(refs.merged)))
    assert "org/expert1@missing: not a local directory and could not be fetched from the hub at revision missing" in line


def test_revision_on_a_local_directory_is_refused(refs, tmp_path):
    experts = [str(refs.experts["expert0"]), f"{refs.experts['expert1']}@v2"]
    line = refused(write_recipe(refs, tmp_path, "rev", merge_of(refs, experts), experts))
    assert "a revision applies to hub ids only" in line and "drop @v2" in line
    assert not (tmp_path / "merged_rev").exists()


def with_override(path, architecture: str) -> dict:
    return {"model": {"model": {"path": str(path)}, "override_architecture": architecture}, "parameters": {"weight": 0.5}}


def test_override_architecture_naming_the_models_own_class_is_accepted(refs, tmp_path):
    merge = merge_of(refs, [str(refs.experts["expert0"])])
    merge["models"].append(with_override(refs.experts["expert1"], "LlamaForCausalLM"))
    recipe = write_recipe(refs, tmp_path, "override", merge, merged=str(refs.merged))
    output = run_recipe(recipe, progress=False)
    ours, plain = read_weights(output), read_weights(refs.plain)
    assert all(torch.equal(ours[n], plain[n]) for n in plain)


def test_override_architecture_to_another_class_is_refused(refs, tmp_path):
    merge = merge_of(refs, [str(refs.experts["expert0"])])
    merge["models"].append(with_override(refs.experts["expert1"], "MistralForCausalLM"))
    line = refused(write_recipe(refs, tmp_path, "override", merge))
    assert "override_architecture MistralForCausalLM differs from the config's ['LlamaForCausalLM']" in line
    assert not (tmp_path / "merged_override").exists()


def test_trust_remote_code_reaches_mergekit(refs, tmp_path, monkeypatch):
    """featcal.trust_remote_code is mergekit's MergeOptions.trust_remote_code (it was always False before)."""
    import mergekit.merge

    seen = {}

    def run_merge(config, out_path, options, config_source=None):
        seen["trust"], seen["cache"] = options.trust_remote_code, options.lora_merge_cache
        (tmp_path / "merged.merging").mkdir(exist_ok=True)  # as mergekit makes it: the run made it first, with its mark
        (tmp_path / "merged.merging" / "tokenizer.json").write_text("{}")  # mergekit's copy of the base's

    monkeypatch.setattr(mergekit.merge, "run_merge", run_merge)
    recipe = load_recipe(write_recipe(refs, tmp_path, "trust", merge_of(refs, [str(p) for p in refs.experts.values()])))
    ensure_merged(recipe, tmp_path / "merged", "cpu", None, trust_remote_code=True)
    assert seen == {"trust": True, "cache": str(tmp_path / ".merged.lora-cache")}
