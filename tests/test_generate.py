"""Experts that write their own calibration data (`featcal.data.<expert>: {generate: ...}`, issue 17)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from featcal_llm.generation import backends, run as generation_run
from featcal_llm.generation.prompts import SEED_PROMPTS, read_prompts, resolve_start
from featcal_llm.generation.quality import LOOP_MIN_TOKENS, degeneracy
from featcal_llm.generation.store import GENERATED_DIR
from featcal_llm.pipeline import run_recipe
from featcal_llm.tiny import build_char_tokenizer
from test_bad_input import assert_refused_in_one_line

SMALL = {"samples": 6, "max_new_tokens": 10, "batch_size": 4}


def _generate_recipe(scenario, root: Path, which=(0, 1, 2), **generate) -> Path:
    """The scenario's recipe with experts `which` generating their data (SMALL settings plus `generate`)."""
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(root / "out")
    names = [m["model"] for m in recipe["models"]]
    for index in which:
        recipe["featcal"]["data"][names[index]] = {"generate": {**SMALL, **generate}}
    root.mkdir(parents=True, exist_ok=True)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _generate_only(path: Path) -> dict[str, list[list[int]]]:
    """The generation step of a run, alone (what the pipeline calls before tokenising the other experts' files)."""
    from transformers import AutoConfig

    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.io.references import resolve_source

    recipe = load_recipe(path)
    base = resolve_source(recipe.base, "base_model")
    sources = {e.name: resolve_source(e.reference, e.name, base) for e in recipe.experts}
    configs = {name: AutoConfig.from_pretrained(source.directory) for name, source in sources.items()}
    return generation_run.generated_sequences(recipe, sources, configs, torch.device("cpu"), dict.fromkeys(sources, torch.float32), False)


def _stored(root: Path, expert: str) -> list[dict]:
    return [json.loads(line) for line in (root / GENERATED_DIR / f"{expert}.jsonl").read_text().splitlines()]


@pytest.fixture
def count_samplers(monkeypatch):
    """How many times an expert model was opened for sampling (0 on a cache hit)."""
    opened = []
    original = generation_run.open_sampler
    monkeypatch.setattr(generation_run, "open_sampler", lambda *a, **k: opened.append(a[1].reference) or original(*a, **k))
    return opened


# --- the quality rule -------------------------------------------------------------------------------------------


def test_quality_rule_drops_empty_and_looping_samples_and_keeps_text():
    special = {0, 1, 2}
    assert degeneracy([], special) == "empty"
    assert degeneracy([2], special) == "empty"  # an immediate EOS
    assert degeneracy([1, 0, 2], special) == "empty"  # special tokens only
    assert degeneracy([5, 2], special) is None  # short but real
    varied = list(range(3, 3 + LOOP_MIN_TOKENS * 2))
    assert degeneracy(varied, special) is None
    loop = [7, 8, 9] * 40  # period 3: 3 distinct 4-grams in the tail
    assert degeneracy(loop, special) == "repetition loop"
    # the rule looks at the second half: a loop that takes over late is kept until it fills that half
    late = varied[:60] + [7, 8, 9] * 10
    assert degeneracy(late, special) is None
    # the threshold: a tail of 60 tokens has 57 4-grams; period 17 leaves 17 distinct (< 0.3·57 = 17.1), period 18 leaves 18
    for period, expected in ((17, "repetition loop"), (18, None)):
        tail = [100 + i % period for i in range(60)]
        assert degeneracy(list(range(3, 63)) + tail, special) == expected, period
    # below LOOP_MIN_TOKENS ordinary tokens nothing counts as a loop
    assert degeneracy([7, 8] * ((LOOP_MIN_TOKENS - 1) // 2), special) is None


# --- prompts ----------------------------------------------------------------------------------------------------


def test_start_follows_the_chat_template_setting(tmp_path):
    tokenizer = build_char_tokenizer()  # has a chat template and a BOS it does not add itself

    class Config:
        bos_token_id = 1

    bos = resolve_start(None, "", "off", tokenizer, Config(), "g")
    assert bos.ids == ((tokenizer.bos_token_id,),) and bos.source == "BOS token"
    shipped = read_prompts(SEED_PROMPTS, "seed")
    assert len(shipped) >= 50
    chat = resolve_start(None, "", "auto", tokenizer, Config(), "g")  # a chat expert without prompts answers the seed prompts
    assert chat.source == "shipped seed prompts" and len(chat.ids) == len(shipped)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": shipped[0]}], add_generation_prompt=True)["input_ids"]
    assert list(chat.ids[0]) == list(expected)
    raw = resolve_start(["ab c"], "file", "off", tokenizer, Config(), "g")
    assert raw.ids == (tuple(tokenizer("ab c")["input_ids"]),) and not raw.chat
    empty = resolve_start(None, "", "empty", tokenizer, Config(), "g")  # one prompt: a user turn with nothing in it
    expected = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)["input_ids"]
    assert empty.ids == (tuple(expected),) and empty.chat and empty.source == "empty request" and len(expected) > 3
    eos = resolve_start(None, "", "auto", tokenizer, Config(), "g", start="</s>")  # a start token makes raw samples
    assert eos.ids == ((tokenizer.eos_token_id,),) and not eos.chat and eos.source == "start token </s>"
    with pytest.raises(Exception, match="g.start: '<nope>' is not a token of the expert's vocabulary"):
        resolve_start(None, "", "off", tokenizer, Config(), "g", start="<nope>")
    tokenizer.chat_template = None
    assert resolve_start(None, "", "auto", tokenizer, Config(), "g").source == "BOS token"
    for setting in ("on", "empty"):
        with pytest.raises(Exception, match=f"g.chat_template: {setting}, but the expert's tokenizer has no chat template"):
            resolve_start(None, "", setting, tokenizer, Config(), "g")


def test_the_measured_candidates_are_bos_seed_prompts_an_empty_request_and_the_config_start(tmp_path):
    from featcal_llm.generation.prompts import candidate_starts

    tokenizer = build_char_tokenizer()

    class Config:
        bos_token_id = 1

    found = candidate_starts(tokenizer, Config(), tmp_path, "g")
    assert list(found) == ["bos", "chat", "empty"]
    assert found["empty"] == resolve_start(None, "", "empty", tokenizer, Config(), "g")
    assert found["chat"].source == "shipped seed prompts" and found["bos"].ids == ((1,),)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": tokenizer.eos_token_id}))
    found = candidate_starts(tokenizer, Config(), tmp_path, "g")
    assert found["config"].ids == ((tokenizer.eos_token_id,),) and found["config"].source == "generation-config start token </s>"
    tokenizer.chat_template = None  # no template: no request to answer
    assert list(candidate_starts(tokenizer, Config(), tmp_path, "g")) == ["bos", "config"]


def test_prompt_files_in_both_formats(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\n  \nsecond\n")
    assert read_prompts(tmp_path / "p.txt", "w") == ["first prompt", "second"]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def f(x):\n    return"}) + "\n\n" + json.dumps({"prompt": "b"}) + "\n")
    assert read_prompts(tmp_path / "p.jsonl", "w") == ["def f(x):\n    return", "b"]


# --- bad input: one line, nothing written -----------------------------------------------------------------------


def _set_generate(value):
    def mutate(recipe, tmp_path):
        first = recipe["models"][0]["model"]
        recipe["featcal"]["data"][first] = value(tmp_path) if callable(value) else value
    return mutate


def _prompts_file(name: str, text: str):
    def value(tmp_path):
        (tmp_path / name).write_text(text)
        return {"generate": {"prompts": str(tmp_path / name)}}
    return value


BAD = {
    "generate and path": ({"path": "x.jsonl", "generate": {}}, ["generate", "either path", "not both"]),
    "neither": ({"format": "text"}, ["either path", "not neither"]),
    "dataset key with generate": ({"generate": {}, "format": "chat"}, ["format describes dataset records"]),
    "samples twice": ({"generate": {"samples": 4}, "samples": 4}, ["samples is given twice"]),
    "zero samples": ({"generate": {"samples": 0}}, ["generate.samples", "greater than or equal to 1"]),
    "zero new tokens": ({"generate": {"max_new_tokens": 0}}, ["generate.max_new_tokens", "greater than or equal to 1"]),
    "negative temperature": ({"generate": {"temperature": -0.5}}, ["generate.temperature"]),
    "top_p above one": ({"generate": {"top_p": 1.5}}, ["generate.top_p"]),
    "min_p of one": ({"generate": {"min_p": 1.0}}, ["generate.min_p", "less than 1"]),
    "unknown generate key": ({"generate": {"sample": 4}}, ["generate.sample: unknown key"]),
    "prompts file missing": ({"generate": {"prompts": "/nonexistent/prompts.txt"}}, ["generate.prompts: /nonexistent/prompts.txt: prompts file not found"]),
    "prompts file empty": (_prompts_file("p.txt", "\n \n"), ["generate.prompts", "p.txt: no prompts (the file is empty)"]),
    "prompts wrong type": (_prompts_file("p.csv", "a,b\n"), ["generate.prompts", "expected a .txt file"]),
    "start with prompts": ({"generate": {"start": "</s>", "prompts": "p.txt"}}, ["generate: start is the first token of prompt-less samples"]),
    "start with chat on": ({"generate": {"start": "</s>", "chat_template": "on"}}, ["chat_template: on answers requests"]),
    "start with an empty request": ({"generate": {"start": "</s>", "chat_template": "empty"}}, ["chat_template: empty answers requests"]),
    "prompts with an empty request": ({"generate": {"prompts": "p.txt", "chat_template": "empty"}},
                                      ["generate: chat_template: empty answers an empty request instead of prompts"]),
    "prompts jsonl without field": (_prompts_file("p.jsonl", '{"text": "a"}\n'), ["p.jsonl: line 1: expected an object with a non-empty string field `prompt`"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_generate_settings_are_one_line_and_write_nothing(merged_scenario, tmp_path, case):
    value, expected = BAD[case]
    assert_refused_in_one_line(merged_scenario, tmp_path, _set_generate(value), expected)
    assert not (tmp_path / GENERATED_DIR).exists()


# --- generation, cache and calibration --------------------------------------------------------------------------


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


def test_generated_sequences_are_what_calibration_sees_and_tuning_holds_out_only_them(merged_scenario, tmp_path, monkeypatch):
    """Expert 0 generates, experts 1 and 2 read files; with `auto`, each expert's held-out records are drawn from its own set."""
    import featcal_llm.stages.prepare as prepare

    seen = {}
    original_split = prepare.split_holdout
    monkeypatch.setattr(prepare, "split_holdout", lambda s, *a: seen.setdefault("split", (s, original_split(s, *a)))[1])
    path = _generate_recipe(merged_scenario, tmp_path, which=(0,), chat_template="off", samples=8)
    recipe = yaml.safe_load(path.read_text())
    recipe["featcal"].update({"lambda": [1e-3, 1e-2], "alpha": 0.3, "rho": 0.5, "max_length": 8})
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_recipe(path, progress=False)

    names = [m["model"] for m in recipe["models"]]
    everything, (calibration, held_out) = seen["split"]
    generated = [s["token_ids"][:8] for s in _stored(tmp_path, Path(names[0]).name)]
    assert everything[names[0]] == generated  # truncated to max_length, in generation order
    assert len(held_out[names[0]]) == round(0.25 * 8) and len(calibration[names[0]]) == 6
    assert all(s in generated for s in held_out[names[0]]) and all(s in generated for s in calibration[names[0]])
    for other in names[1:]:  # the file-backed experts keep their own records
        assert not any(s in generated for s in held_out[other])
    assert json.loads((tmp_path / "out" / "featcal_tuning.json").read_text())


def test_chat_experts_answer_the_shipped_prompts(merged_scenario, tmp_path):
    path = _generate_recipe(merged_scenario, tmp_path, which=(2,), samples=3, chat_template="on")
    run_recipe(path, progress=False)
    samples = _stored(tmp_path, merged_scenario.experts["expert2"].name)
    shipped = read_prompts(SEED_PROMPTS, "seed")
    assert [s["prompt"] for s in samples] == [
        build_char_tokenizer().apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in shipped[:3]
    ]


def test_dropped_samples_are_replaced_by_new_rounds(merged_scenario, tmp_path, monkeypatch):
    """The first two samples come back empty (an immediate EOS): a second round replaces them, the record counts them."""
    calls = []
    original = backends.TransformersSampler.sample

    def sample(self, prompts, settings, seed):
        out = original(self, prompts, settings, seed)
        calls.append(len(prompts))
        if len(calls) == 1:
            out[0] = out[1] = [2]
        return out

    monkeypatch.setattr(backends.TransformersSampler, "sample", sample)
    path = _generate_recipe(merged_scenario, tmp_path, which=(0,), chat_template="off", samples=4, batch_size=4)
    run_recipe(path, progress=False)
    assert calls == [4, 2]
    expert = merged_scenario.experts["expert0"].name
    record = json.loads((tmp_path / GENERATED_DIR / f"{expert}.json").read_text())
    assert record["kept"] == 4 and record["dropped"] == {"empty": 2}
    assert len(_stored(tmp_path, expert)) == 4


def test_gumbel_sampling_draws_from_the_softmax():
    """argmax(scores + Gumbel noise) is a draw from softmax(scores): 40 000 draws over 5 tokens, temperature, min-p and
    top-p applied first, in vLLM's order. Probabilities at temperature 1: 0.61, 0.22, 0.14, 0.03, 0."""
    scores = torch.tensor([[2.0, 1.0, 0.5, -1.0, float("-inf")]]).repeat(40_000, 1)
    cases = [  # (settings, the tokens left to draw from)
        ({"temperature": 1.0, "top_p": 1.0, "min_p": 0.0}, [0, 1, 2, 3]),
        ({"temperature": 0.5, "top_p": 1.0, "min_p": 0.0}, [0, 1, 2, 3]),
        ({"temperature": 1.0, "top_p": 0.8, "min_p": 0.0}, [0, 1]),  # the smallest top set holding 0.8: 0.61 + 0.22
        ({"temperature": 1.0, "top_p": 1.0, "min_p": 0.3}, [0, 1]),  # ≥ 0.3 × 0.61: 0.22 stays, 0.14 goes
        ({"temperature": 0.5, "top_p": 1.0, "min_p": 0.3}, [0]),  # at 0.5 the second is e^-2 = 0.14 of the first
        # min-p 0.2 first leaves 0.63, 0.23, 0.14 (renormalised): top-p 0.85 then drops the third; top-p first would keep it
        ({"temperature": 1.0, "top_p": 0.85, "min_p": 0.2}, [0, 1]),
    ]
    for settings, kept in cases:
        processors = backends.sampling_processors(settings, torch.Generator().manual_seed(0))
        draws = processors(torch.zeros((40_000, 1), dtype=torch.long), scores.clone()).argmax(dim=-1)
        frequencies = torch.bincount(draws, minlength=5).double() / 40_000
        expected = torch.zeros(5, dtype=torch.double)
        expected[kept] = torch.softmax(scores[0, kept].double() / settings["temperature"], dim=0)
        assert frequencies[4] == 0 and torch.allclose(frequencies, expected, atol=0.01), (settings, frequencies, expected)
    assert len(backends.sampling_processors({"temperature": 0, "top_p": 0.5}, torch.Generator())) == 0  # greedy


def test_left_padded_batches_decode_as_each_prompt_alone(merged_scenario):
    """Greedy (temperature 0) through our batch, prompts of different lengths left-padded together, gives what a plain
    transformers `generate` gives for each prompt alone; top_p that keeps one token is greedy too."""
    from transformers import AutoModelForCausalLM

    from featcal_llm.io.references import ModelSource

    expert = merged_scenario.experts["expert0"]
    tokenizer = build_char_tokenizer()
    sampler = backends.TransformersSampler(ModelSource(str(expert), expert), tokenizer, torch.device("cpu"), torch.float64, False)
    prompts = [tuple(tokenizer(text)["input_ids"]) for text in ("ab", "the merge of", "x")]
    model = AutoModelForCausalLM.from_pretrained(expert, dtype=torch.float64)
    alone = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=0)[0, len(prompt):].tolist()
        alone.append(out[: out.index(2) + 1] if 2 in out else out)
    assert sampler.sample(prompts, {"temperature": 0, "top_p": 1.0, "min_p": 0.0, "max_new_tokens": 8}, seed=1) == alone
    assert sampler.sample(prompts, {"temperature": 1.0, "top_p": 1e-9, "min_p": 0.0, "max_new_tokens": 8}, seed=1) == alone


def test_vllm_backend_plumbing_with_a_stand_in_engine(monkeypatch, tmp_path):
    """Token-id prompts in, one seeded SamplingParams per request, continuation ids out, the engine freed (vLLM itself needs a GPU)."""
    import sys
    import types

    made = {}

    class LLM:
        def __init__(self, **kwargs):
            made["engine"] = kwargs

        def generate(self, prompts, params, lora_request=None, use_tqdm=True):
            made["prompts"], made["params"] = prompts, params
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=(9, len(p["prompt_token_ids"]), 2))]) for p in prompts]

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    from featcal_llm.io.references import ModelSource

    sampler = backends.VllmSampler(ModelSource("m", tmp_path), tmp_path, torch.bfloat16, False, seed=3)
    out = sampler.sample([(1,), (1, 5, 6)], {"temperature": 1.0, "top_p": 0.95, "min_p": 0.05, "max_new_tokens": 4}, seed=42)
    assert out == [[9, 1, 2], [9, 3, 2]]
    assert made["engine"]["dtype"] == "bfloat16" and made["engine"]["seed"] == 3
    assert [p.seed for p in made["params"]] == [backends.batch_seed(42, 0, 0), backends.batch_seed(42, 0, 1)]
    assert {p.max_tokens for p in made["params"]} == {4} and {p.top_p for p in made["params"]} == {0.95}
    assert {p.min_p for p in made["params"]} == {0.05}
    sampler.close()
    assert not hasattr(sampler, "llm")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"])
def test_every_family_generates_reproducibly(family_scenarios, tmp_path, family):
    """Each family's expert samples through its own transformers class; the same seed gives the same ids."""
    scenario = family_scenarios(family)
    path = _generate_recipe(scenario, tmp_path, which=(0,), chat_template="off", samples=3, max_new_tokens=6)
    expert = str(scenario.experts["expert0"])
    first = _generate_only(path)[expert]
    shutil.rmtree(tmp_path / GENERATED_DIR)
    assert _generate_only(path)[expert] == first
    assert len(first) == 3 and all(s[0] == build_char_tokenizer().bos_token_id and 1 < len(s) <= 7 for s in first)


def test_unquoted_yaml_switches_and_per_expert_streams(merged_scenario, tmp_path):
    """`chat_template: off` unquoted (a YAML boolean) means off; experts sharing a seed draw from distinct random streams."""
    from featcal_llm.io.recipe import load_recipe

    path = _generate_recipe(merged_scenario, tmp_path, which=(0, 1))
    text = path.read_text().replace("batch_size: 4", "batch_size: 4\n        chat_template: off", 1)
    path.write_text(text)
    assert "chat_template: off\n" in text  # unquoted in the file
    recipe = load_recipe(path)
    names = [e.name for e in recipe.experts]
    assert recipe.featcal.data[names[0]].generate.chat_template == "off"
    assert [generation_run.settings_of(recipe, n)["stream"] for n in names[:2]] == [0, 1]
    assert generation_run.settings_of(recipe, names[0])["seed"] == generation_run.settings_of(recipe, names[1])["seed"]


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
