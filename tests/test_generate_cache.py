"""Data-free generation (`generate:`) is deterministic for a seed and cached: the cache is missed when a setting or the
expert changes, the saved recipe spells out the sampling and replays the same samples, and the generated sets are
kept apart per expert beside the output."""

from __future__ import annotations

import json
import shutil

import yaml

from featcal_llm.generation import run as generation_run
from featcal_llm.generation.store import GENERATED_DIR
from featcal_llm.pipeline import run_recipe
from featcal_llm.tiny import build_char_tokenizer
from test_generate import SMALL, _generate_only, _generate_recipe, _stored


def test_generation_is_deterministic_for_a_seed_and_cached(merged_scenario, tmp_path, count_samplers):
    expert = merged_scenario.experts["expert0"].name
    first = _generate_recipe(merged_scenario, tmp_path / "a", which=(0,), chat_template="off")
    run_recipe(first, progress=False)
    assert count_samplers == [str(merged_scenario.experts["expert0"])]
    samples = _stored(tmp_path / "a", expert)
    assert len(samples) == SMALL["samples"]
    bos = build_char_tokenizer().bos_token_id
    for sample in samples:  # from BOS, at most max_new_tokens more, the text is the ids decoded
        assert sample["token_ids"][0] == bos and 1 < len(sample["token_ids"]) <= 1 + SMALL["max_new_tokens"]
        assert sample["prompt"] == "" and sample["text"] == build_char_tokenizer().decode(sample["token_ids"])
    record = json.loads((tmp_path / "a" / GENERATED_DIR / f"{expert}.json").read_text())
    assert record["kept"] == 6 and record["backend"] == "transformers" and record["start"] == "BOS token"

    # a second workdir, same settings: the same samples, freshly generated
    second = _generate_recipe(merged_scenario, tmp_path / "b", which=(0,), chat_template="off")
    assert _generate_only(second)[str(merged_scenario.experts["expert0"])] == [s["token_ids"] for s in samples]
    assert len(count_samplers) == 2
    assert _stored(tmp_path / "b", expert) == samples
    # another seed: other samples
    third = _generate_recipe(merged_scenario, tmp_path / "c", which=(0,), chat_template="off", seed=7)
    _generate_only(third)
    assert [s["token_ids"] for s in _stored(tmp_path / "c", expert)] != [s["token_ids"] for s in samples]

    # rerun of the first recipe: the set is reused, the output is byte-identical
    weights = (tmp_path / "a" / "out" / "model.safetensors").read_bytes()
    run_recipe(first, force=True, progress=False)
    assert len(count_samplers) == 3  # no new sampler
    assert (tmp_path / "a" / "out" / "model.safetensors").read_bytes() == weights


def test_the_cache_is_missed_when_settings_or_the_expert_change(merged_scenario, tmp_path, count_samplers):
    root = tmp_path / "w"
    expert_dir = tmp_path / "expert-copy"
    shutil.copytree(merged_scenario.experts["expert1"], expert_dir)
    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    old = recipe["models"][1]["model"]
    recipe["models"][1]["model"] = str(expert_dir)
    recipe["featcal"]["data"].pop(old)
    recipe["featcal"]["data"][str(expert_dir)] = {"generate": {**SMALL, "chat_template": "off"}}
    recipe["featcal"]["output"] = str(root / "out")
    root.mkdir()
    path = root / "recipe.yaml"

    def run(**generate):
        recipe["featcal"]["data"][str(expert_dir)]["generate"] = {**SMALL, "chat_template": "off", **generate}
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        before = len(count_samplers)
        _generate_only(path)
        return len(count_samplers) > before

    assert run() is True
    assert run() is False  # hit
    assert run(temperature=0.5) is True  # a setting changed
    assert run(temperature=0.5) is False
    assert run(temperature=0.5, min_p=0.05) is True
    assert run(temperature=0.5, max_new_tokens=8) is True
    samples = root / GENERATED_DIR / "expert-copy.jsonl"
    samples.write_text(samples.read_text().replace('"text"', '"text" ', 1))  # edited by hand: not the recorded set
    assert run(temperature=0.5, max_new_tokens=8) is True
    from safetensors.torch import load_file, save_file

    for shard in sorted(expert_dir.glob("*.safetensors")):  # the expert's weights change
        tensors = load_file(shard)
        name = next(iter(tensors))
        tensors[name] = tensors[name] + 1e-3
        save_file(tensors, shard, metadata={"format": "pt"})
    assert run(temperature=0.5, max_new_tokens=8) is True


def test_the_saved_recipe_spells_out_the_sampling_and_replays_the_same_samples(merged_scenario, tmp_path, count_samplers, monkeypatch):
    """featcal_recipe.yml writes out each `generate:` expert's sampling settings, so its replay reuses the very samples
    (and gives the same weights) even under a later version whose sampling defaults differ; file-backed experts stay as written."""
    from featcal_llm.io.saved_recipe import PINNED_SAMPLING
    from featcal_llm.io.recipe import load_recipe

    path = _generate_recipe(merged_scenario, tmp_path, which=(0, 1), chat_template="off")
    names = [m["model"] for m in yaml.safe_load(path.read_text())["models"]]
    run_recipe(path, progress=False)
    first = (tmp_path / "out" / "model.safetensors").read_bytes()
    saved_text = (tmp_path / "out" / "featcal_recipe.yml").read_text()
    saved = yaml.safe_load(saved_text)["featcal"]["data"]
    original = load_recipe(path)
    for name in names[:2]:
        resolved = generation_run.settings_of(original, name)
        assert {key: saved[name]["generate"][key] for key in PINNED_SAMPLING} == {key: resolved[key] for key in PINNED_SAMPLING}
    assert saved[names[2]] == yaml.safe_load(path.read_text())["featcal"]["data"][names[2]]

    settings_of = generation_run.settings_of

    def later_defaults(recipe, name):  # a version that samples cooler and longer unless the recipe says otherwise
        settings, given = settings_of(recipe, name), recipe.featcal.data[name].generate.model_fields_set
        return settings | {key: value for key, value in (("temperature", 0.3), ("max_new_tokens", 9)) if key not in given}

    monkeypatch.setattr(generation_run, "settings_of", later_defaults)
    replay = tmp_path / "replay.yaml"
    replay.write_text(saved_text)
    opened = len(count_samplers)
    run_recipe(replay, force=True, progress=False)
    assert len(count_samplers) == opened  # both sets reused: nothing sampled again
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == first


def test_writing_out_the_sampling_keeps_what_the_recipe_says_and_a_replay_header():
    """Given keys win over resolved ones; a bare `generate:` gets a mapping; a tuned run's replay header survives."""
    from featcal_llm.io.saved_recipe import PINNED_SAMPLING, REPLAY_HEADER, SAMPLING_HEADER, with_sampling_pinned

    text = "models: []\nfeatcal:\n  data:\n    a: {generate: {temperature: 0.2}}\n    b: {generate: null}\n    c: {path: c.jsonl}\n"
    resolved = dict(zip(PINNED_SAMPLING, (16, 0.7, 1.0, 0.0, 3, 32), strict=True))
    out = with_sampling_pinned(text, {"a": resolved | {"temperature": 0.2}, "b": resolved})
    data = yaml.safe_load(out)["featcal"]["data"]
    assert data["a"]["generate"] == dict(zip(PINNED_SAMPLING, (16, 0.2, 1.0, 0.0, 3, 32), strict=True))
    assert data["b"]["generate"] == resolved and data["c"] == {"path": "c.jsonl"}
    assert out.startswith(SAMPLING_HEADER) and with_sampling_pinned(text, {}) == text
    assert with_sampling_pinned(REPLAY_HEADER + text, {"b": resolved}).startswith(REPLAY_HEADER)


def test_generated_set_paths_are_the_short_labels_made_file_safe_beside_the_output(tmp_path):
    """Each expert's set and record: featcal_generated/ beside the output, named by its legend label (io/names.py),
    a label's characters outside [A-Za-z0-9._-] turned to `_`, no name hidden (a leading dot) nor empty."""
    from featcal_llm.generation.store import generated_folder, generated_set_paths

    output = tmp_path / "runs" / "out"
    experts = ["/m/a/math-v1.2", "/m/b/math-v1.2", "org/code", "/m/.cache model", "/m/@@", "/m/__x__"]
    paths = generated_set_paths(output, experts)
    assert generated_folder(output) == tmp_path / "runs" / GENERATED_DIR
    stems = {name: (samples.name, record.name) for name, (samples, record) in paths.items()}
    assert stems == {"/m/a/math-v1.2": ("a_math-v1.2.jsonl", "a_math-v1.2.json"), "/m/b/math-v1.2": ("b_math-v1.2.jsonl", "b_math-v1.2.json"),
                     "org/code": ("code.jsonl", "code.json"), "/m/.cache model": ("cache_model.jsonl", "cache_model.json"),
                     "/m/@@": ("expert.jsonl", "expert.json"), "/m/__x__": ("x.jsonl", "x.json")}
    assert all(samples.parent == record.parent == tmp_path / "runs" / GENERATED_DIR for samples, record in paths.values())


def test_experts_whose_labels_differ_only_in_case_get_sets_a_case_blind_folder_keeps_apart(tmp_path):
    """`Math` and `math` are one file on macOS's and Windows' file systems: each keeps the first 8 hex digits of its
    name's sha256 (computed here: sha256('/m/Math') starts 727ba811, sha256('/m/math') 3fb20899)."""
    from featcal_llm.generation.store import generated_set_paths

    paths = generated_set_paths(tmp_path / "out", ["/m/Math", "/m/math", "/m/code"])
    assert {name: samples.name for name, (samples, _) in paths.items()} == {
        "/m/Math": "Math-727ba811.jsonl", "/m/math": "math-3fb20899.jsonl", "/m/code": "code.jsonl"}


def test_every_expert_gets_a_generated_set_of_its_own(tmp_path):
    from featcal_llm.generation.store import generated_set_paths

    for experts in (["/m/math v1", "/m/math_v1"], ["/x/a", "/y/a", "/z/x_a"]):
        paths = generated_set_paths(tmp_path / "out", experts)
        assert len({samples for samples, _ in paths.values()}) == len(experts), paths
