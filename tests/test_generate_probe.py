"""Probes of the data-free path (`generate:`) as a demanding user runs it: what is refused, what sampling runs, the
cache and the saved recipe's replay (the defects found, each pinned by a test)."""

from __future__ import annotations

import pytest
import yaml


def test_a_shared_generate_block_pins_each_experts_own_measured_start():
    """A YAML anchor shared by several `generate:` entries must not carry one expert's measured start to the others:
    the saved recipe forces each expert's own (BOS for one, the empty request for the other)."""
    from featcal_llm.io.saved_recipe import with_sampling_pinned

    text = ("featcal:\n  data:\n    a: {generate: &g {samples: 4}}\n    b: {generate: *g}\n    c: &d {generate: {samples: 2}}\n"
            "    d: *d\n")
    settings = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "min_p": 0.0, "seed": 0, "batch_size": 32}
    starts = {"a": {"mode": "bos", "chosen_by": "measurement"}, "b": {"mode": "empty", "chosen_by": "measurement"},
              "c": {"mode": "chat", "chosen_by": "measurement"}, "d": {"mode": "bos", "chosen_by": "measurement"}}
    data = yaml.safe_load(with_sampling_pinned(text, dict.fromkeys("abcd", settings), starts))["featcal"]["data"]
    assert {name: data[name]["generate"]["chat_template"] for name in "abcd"} == {"a": "off", "b": "empty", "c": "on", "d": "off"}
    assert data["a"]["generate"]["samples"] == 4 and data["d"]["generate"]["samples"] == 2


def test_a_prompt_does_not_end_with_the_eos_a_tokenizer_appends():
    """A tokenizer whose post-processor appends EOS (`add_eos_token`) must not close the prompt the expert continues:
    the sample continues the prompt's text (BOS kept at the front, once)."""
    from tokenizers import processors
    from transformers import LlamaConfig

    from featcal_llm.generation.prompts import resolve_start
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    assert tokenizer("hi")["input_ids"] == [1, *tokenizer.convert_tokens_to_ids(["h", "i"]), 2]  # the tokenizer appends EOS
    raw = resolve_start(["hi"], "prompts", "off", tokenizer, config, "generate")
    assert raw.ids == ((1, *tokenizer.convert_tokens_to_ids(["h", "i"])),)
    for start in (resolve_start(["hi"], "prompts", "on", tokenizer, config, "generate"),
                  resolve_start(None, "", "empty", tokenizer, config, "generate")):
        assert start.ids[0][-1] != tokenizer.eos_token_id and start.ids[0].count(tokenizer.bos_token_id) == 1


def test_a_set_replaced_while_its_record_is_written_is_not_reused_under_this_key(tmp_path, monkeypatch):
    """Two runs whose outputs share a folder share `featcal_generated/`: when the other run's samples land between this
    run's samples and its record, the record must not vouch for them (a later run with this key regenerates)."""
    from featcal_llm.generation import store

    samples_path, record_path = tmp_path / "e.jsonl", tmp_path / "e.json"
    mine, theirs = [{"token_ids": [1, 5, 6]}], [{"token_ids": [1, 7, 8]}]
    original = store._write_atomically

    def other_run_lands(path, text):
        original(path, text)
        if path == samples_path:  # the other run's samples, renamed into place just after ours
            original(path, "".join(__import__("json").dumps(s) + "\n" for s in theirs))

    monkeypatch.setattr(store, "_write_atomically", other_run_lands)
    store.store_samples(samples_path, record_path, mine, {"key": "mine"})
    monkeypatch.setattr(store, "_write_atomically", original)
    cached = store.cached_samples(samples_path, record_path, "mine")
    assert cached is None or cached[0] == mine


def test_greedy_sampling_from_one_start_says_its_samples_are_copies(merged_scenario, tmp_path, capsys):
    from test_generate import _generate_only, _generate_recipe

    sets = _generate_only(_generate_recipe(merged_scenario, tmp_path, which=(0,), temperature=0, chat_template="off", samples=4))
    (only,) = sets.values()
    assert len({tuple(ids) for ids in only}) == 1  # greedy from BOS: one continuation, four times
    err = capsys.readouterr().err
    assert "temperature 0" in err and "3 of 4 samples" in err


@pytest.mark.parametrize("suffix, text", [(".txt", "hello\nworld\n"), (".jsonl", '{"prompt": "hello"}\n{"prompt": "world"}\n')])
def test_a_prompts_file_saved_with_a_bom_reads_as_without(tmp_path, suffix, text):
    from featcal_llm.io.prompts import read_prompts

    path = tmp_path / f"p{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_prompts(path, "generate.prompts") == ["hello", "world"]


def test_no_file_of_one_expert_is_a_file_of_another(tmp_path):
    from featcal_llm.generation.store import choice_path, generated_set_paths

    paths = generated_set_paths(tmp_path / "out", ["org/m", "org/m.start"])
    files = [str(p).lower() for samples, record in paths.values() for p in (samples, record, choice_path(samples))]
    assert len(files) == len(set(files)), sorted(files)


def test_a_temperature_under_vllms_floor_samples_at_the_floor_with_transformers_too():
    """vLLM samples a temperature in (0, 0.01) at 0.01 (SamplingParams.__post_init__); transformers must too, and never at
    a temperature that overflows the scores (1e-44: ±inf, then NaN through min-p and top-p); 0 stays greedy."""
    import torch

    from featcal_llm.generation import backends

    scores = torch.tensor([[0.5, 3.0, 1.0, -2.0], [1.0, 0.9, 0.95, 0.0]])

    def drawn(temperature):
        processors = backends.sampling_processors({"temperature": temperature, "top_p": 0.9, "min_p": 0.1}, torch.Generator().manual_seed(0))
        return processors(torch.zeros((2, 1), dtype=torch.long), scores.clone())

    for temperature in (1e-6, 1e-44):
        assert torch.equal(drawn(temperature), drawn(0.01)), temperature
    assert len(backends.sampling_processors({"temperature": 0, "top_p": 0.9, "min_p": 0.1}, torch.Generator())) == 0


def test_a_prompts_path_written_with_a_tilde_says_it_is_not_expanded():
    from pathlib import Path

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.prompts import read_prompts

    with pytest.raises(FeatCalError) as refused:
        read_prompts(Path("~/featcal-no-such-prompts.txt"), "generate.prompts")
    assert str(refused.value).startswith("generate.prompts: ~/featcal-no-such-prompts.txt: prompts file not found")
    assert "`~` would be a folder of that name here" in str(refused.value)


def test_a_bare_generate_key_generates_with_the_defaults():
    from featcal_llm.io.block_sections import DataSpec, GenerateSpec

    spec = DataSpec.model_validate(yaml.safe_load("generate:\nweight: 0.5\n"))
    assert spec.generate == GenerateSpec() and spec.weight == 0.5


def test_the_only_start_left_is_not_said_to_be_the_recipes_choice_and_is_pinned(merged_scenario, tmp_path):
    from test_generate import _generate_only, _generate_recipe

    from featcal_llm.generation.run import sampling_records, start_records
    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.io.saved_recipe import with_sampling_pinned

    path = _generate_recipe(merged_scenario, tmp_path, which=(0,))
    path.write_text(path.read_text().replace("max_length: 64", "max_length: 8"))  # the chat starts fill it: BOS is left
    _generate_only(path)
    recipe = load_recipe(path)
    (name, start), = start_records(recipe).items()
    assert start["mode"] == "bos" and start["chosen_by"] != "recipe"
    saved = yaml.safe_load(with_sampling_pinned(recipe.text, sampling_records(recipe), start_records(recipe)))
    assert saved["featcal"]["data"][name]["generate"]["chat_template"] == "off"


def test_a_set_drawn_under_the_temperature_floor_is_keyed_by_the_temperature_it_samples_at(merged_scenario, tmp_path):
    """The resolved settings (the cache key, the record) hold 0.01 for a temperature below it: a set drawn before the
    floor, at the temperature as written, is not reused; 0 stays 0."""
    from test_generate import _generate_recipe

    from featcal_llm.generation.run import settings_of
    from featcal_llm.io.recipe import load_recipe

    for written, resolved in ((1e-44, 0.01), (0.005, 0.01), (0, 0), (0.7, 0.7)):
        recipe = load_recipe(_generate_recipe(merged_scenario, tmp_path / str(written), which=(0,), temperature=written))
        assert settings_of(recipe, recipe.experts[0].name)["temperature"] == resolved, written
