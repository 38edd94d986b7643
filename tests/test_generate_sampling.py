"""What generated calibration data is made of (issue 17): the quality rule, where sampling starts (prompts, chat
templates, start tokens), and the samplers themselves (Gumbel draws, left-padded batches, vLLM's plumbing)."""

from __future__ import annotations

import json

import pytest
import torch

from featcal_llm.generation import backends
from featcal_llm.generation.backends import batch_seed
from featcal_llm.generation.prompts import SEED_PROMPTS, read_prompts, resolve_start
from featcal_llm.generation.quality import LOOP_MIN_TOKENS, degeneracy
from featcal_llm.tiny import build_char_tokenizer

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


# --- sampling ---------------------------------------------------------------------------------------------------


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


def test_a_chat_template_that_refuses_the_prompt_is_one_line():
    from featcal_llm.errors import FeatCalError
    from featcal_llm.generation.prompts import resolve_start
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(FeatCalError, match=r"^w: the expert's chat template refused a prompt \(Conversation roles must alternate"):
        resolve_start(["hi"], "p.txt", "on", tokenizer, None, "w")
    with pytest.raises(FeatCalError, match=r"^w: the expert's chat template refused a prompt"):
        resolve_start(None, "", "empty", tokenizer, None, "w")


def test_the_start_probes_logits_are_those_that_predict_each_written_token(tiny_model):
    """generation/choose.written_logits, rows of other lengths padded into one forward: row i's logits are the
    unpadded forward's at positions len(prompt) − 1 … len(prompt) + len(continuation) − 2."""
    from featcal_llm.generation.choose import written_logits

    rows = [((1, 5, 9), [4, 4, 7, 2]), ((3,), [8, 1]), ((2, 6, 6, 6, 1), [9])]
    found = written_logits(tiny_model, rows, torch.device("cpu"), chunk=3)
    for (prompt, continuation), logits in zip(rows, found):
        with torch.no_grad():
            alone = tiny_model(torch.tensor([[*prompt, *continuation]])).logits[0]
        assert torch.allclose(logits.double(), alone[len(prompt) - 1: len(prompt) - 1 + len(continuation)].float().double(), atol=1e-5)


def test_replacement_rounds_continue_the_prompts_and_draw_new_seeds():
    """Samples dropped by the quality rule are replaced by a new round that goes on through the prompts (sample i
    continues prompt i mod n) with seeds of its own: the same prompts under the same seeds would redraw the same
    degenerate samples."""
    from featcal_llm.generation.prompts import Start
    from featcal_llm.generation.run import _sample

    calls = []

    class Sampler:
        def sample(self, prompts, settings, seed):
            calls.append(([prompt[0] for prompt in prompts], seed))
            return [[] if len(calls) == 1 and index < 2 else [10 + index, 11, 12] for index in range(len(prompts))]  # round 1: two empty

    start = Start(tuple(f"p{i}" for i in range(5)), tuple((20 + i,) for i in range(5)), "prompts", chat=False)
    settings = {"samples": 4, "batch_size": 4, "seed": 7, "stream": 0}
    tally = _sample(Sampler(), "transformers", start, settings, build_char_tokenizer(), "e", False)
    assert [prompts for prompts, _ in calls] == [[20, 21, 22, 23], [24, 20]]  # round 2 goes on from prompt 4, then wraps
    assert calls[0][1] != calls[1][1]
    assert len(tally.kept) == 4 and tally.dropped == {"empty": 2}
    assert [sample["prompt"] for sample in tally.kept] == ["p2", "p3", "p4", "p0"]



def test_a_tail_with_exactly_the_loop_share_of_distinct_4_grams_is_kept():
    """"Fewer than" LOOP_DISTINCT_SHARE of the tail's 4-grams distinct is a loop; exactly that share is not. 46 tokens:
    the tail (the last 23) holds 20 4-grams, of which 6 distinct (0.3 × 20)."""
    from featcal_llm.generation.quality import LOOP_DISTINCT_SHARE, LOOP_NGRAM

    sample = list(range(100, 123)) + [1, 2, 3, 4, 5, 6] * 3 + [1, 2, 3, 4, 5]
    tail = sample[len(sample) // 2:]
    grams = [tuple(tail[i:i + LOOP_NGRAM]) for i in range(len(tail) - LOOP_NGRAM + 1)]
    assert (LOOP_NGRAM, LOOP_DISTINCT_SHARE, len(grams), len(set(grams))) == (4, 0.3, 20, 6)
    assert degeneracy(sample, set()) is None


def test_sets_whose_halves_share_no_bigram_are_not_alike():
    """Short or very varied samples: no bigram shared within either set, none between them. They are not 'nearly the
    same text' (0 ≥ 0.9 × 0 would have said so)."""
    from featcal_llm.generation.alike import alikeness, look_alike

    sets = {"a": [[1, 2], [3, 4], [5, 6], [7, 8]], "b": [[11, 12], [13, 14], [15, 16], [17, 18]]}
    assert alikeness(sets["a"], sets["b"]) == (0.0, 0.0)
    assert look_alike(sets) == []



def test_each_expert_s_replacement_rounds_draw_seeds_no_other_expert_draws():
    """Round r of expert stream k draws from round index k × MAX_ROUNDS + r: a replacement round (its first round's
    samples all dropped) never repeats a seed another expert's stream draws, or two similar experts would sample alike."""
    from types import SimpleNamespace

    from featcal_llm.generation.prompts import Start
    from featcal_llm.generation.run import MAX_ROUNDS, _sample

    class Recording:
        def __init__(self):
            self.seeds, self.calls = [], 0

        def sample(self, prompts, settings, seed):
            self.seeds.append(seed)
            self.calls += 1
            return [[] if self.calls == 1 else [5, 6, 7] for _ in prompts]  # the first batch empty: dropped, so a round 1

    start = Start(texts=("a",), ids=((1,),), source="BOS token", chat=False)
    tokenizer = SimpleNamespace(all_special_ids=[0, 1, 2], decode=lambda ids: " ".join(map(str, ids)))
    seeds = {}
    for stream in range(3):
        sampler = Recording()
        tally = _sample(sampler, "transformers", start, {"samples": 2, "batch_size": 2, "seed": 7, "stream": stream},
                        tokenizer, f"e{stream}", progress=False)
        assert len(tally.kept) == 2 and tally.dropped["empty"] == 2 and len(sampler.seeds) == 2  # rounds 0 and 1
        assert sampler.seeds == [batch_seed(7, stream * MAX_ROUNDS, 0), batch_seed(7, stream * MAX_ROUNDS + 1, 0)]
        seeds[stream] = set(sampler.seeds)
    assert not (seeds[0] & seeds[1]) and not (seeds[0] & seeds[2]) and not (seeds[1] & seeds[2]), seeds
