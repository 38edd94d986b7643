"""`generate:` with no other key: each expert's start is measured (BOS for raw-text experts, chat for chat-tuned ones),
recorded, cached, overridable; a close runner-up changes nothing; look-alike generated sets are warned about."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from featcal_llm.generation import alike, choose, run as generation_run
from featcal_llm.generation.store import GENERATED_DIR
from featcal_llm.io.run_record import read_run_record
from studies.tiny_kinds import build_kinds, kinds_recipe
from test_bad_input import assert_refused_in_one_line
from test_generate import _generate_only


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """A tiny base with a chat template, a raw-text expert, a chat-tuned expert and a copy of the raw one."""
    return build_kinds(tmp_path_factory.mktemp("kinds"), steps=50)




def _record(root: Path, expert: str) -> dict:
    return json.loads((root / GENERATED_DIR / f"{expert}.json").read_text())


@pytest.fixture
def probes(monkeypatch):
    """How many times the start was measured."""
    calls = []
    original = generation_run.choose_start
    monkeypatch.setattr(generation_run, "choose_start", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


# --- the measure ------------------------------------------------------------------------------------------------


def test_kl_rows_match_an_independent_computation():
    torch.manual_seed(0)
    logits_e, logits_r = torch.randn(5, 7), torch.randn(5, 7)
    p, q = torch.softmax(logits_e.double(), -1).tolist(), torch.softmax(logits_r.double(), -1).tolist()
    expected = [sum(pi * math.log(pi / qi) for pi, qi in zip(pr, qr)) for pr, qr in zip(p, q)]
    got = choose.kl_rows(torch.log_softmax(logits_e, -1), logits_r)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.double), atol=1e-6)
    assert torch.allclose(choose.kl_rows(torch.log_softmax(logits_e, -1), logits_e), torch.zeros(5, dtype=torch.double), atol=1e-6)
    # a reference with two added tokens: the KL is over the 7 shared ids, renormalised
    wider = torch.cat([logits_r, torch.randn(5, 2)], dim=1)
    assert torch.allclose(choose.kl_rows(torch.log_softmax(logits_e, -1), wider), got, atol=1e-6)
    # an expert with two added tokens: likewise, its distribution renormalised over the shared ids
    expert_wider = torch.cat([logits_e, torch.randn(5, 2)], dim=1)
    assert torch.allclose(choose.kl_rows(torch.log_softmax(expert_wider, -1), logits_r), got, atol=1e-6)


def test_overlap_and_look_alike_rule():
    a, b = Counter({(1, 2): 3, (2, 3): 1}), Counter({(1, 2): 1, (4, 5): 1})
    assert alike.overlap(a, b) == pytest.approx(min(3 / 4, 1 / 2) + 0)  # only (1, 2) is shared
    assert alike.overlap(a, a) == pytest.approx(1.0) and alike.overlap(a, Counter()) == 0.0
    one = [[1, 2, 3, 4, 5]] * 4
    other = [[9, 8, 7, 6]] * 4
    assert alike.alikeness(one, one) == (1.0, 1.0)
    assert alike.look_alike({"x": one, "y": list(one), "z": other}) == [("x", "y", 1.0, 1.0)]
    assert alike.alikeness(one[:3], one) is None  # too few samples to tell


# --- the choice -------------------------------------------------------------------------------------------------


def test_raw_text_experts_start_at_bos_and_chat_tuned_ones_answer_prompts(kinds, tmp_path, capsys, probes):
    path = kinds_recipe(kinds, tmp_path)
    sequences = _generate_only(path)
    err = capsys.readouterr().err
    raw, chat = _record(tmp_path, "raw"), _record(tmp_path, "chat")
    assert raw["start_mode"] == "bos" and raw["start"] == "BOS token"
    assert chat["start_mode"] == "chat" and chat["start"] == "shipped seed prompts"
    for record in (raw, chat):  # the winner scored highest, and the log line says so
        measured = record["start_choice"]["scores"]
        assert all(values["score"] == min(values["base"], values["merged"]) for values in measured.values())  # departs from both
        scores = {mode: values["score"] for mode, values in measured.items()}
        assert set(scores) == {"bos", "chat", "empty"} and max(scores, key=scores.get) == record["start_mode"]
        assert scores[record["start_mode"]] > 2 * min(scores.values())  # a clear margin, not a coin toss
    assert f"expert {kinds['raw']}: chose BOS token (KL vs base " in err and "; shipped seed prompts " in err
    assert f"expert {kinds['chat']}: chose shipped seed prompts (KL vs base " in err
    bos = 1
    assert all(s[0] == bos and s[1] != bos for s in sequences[str(kinds["raw"])])
    assert all(s[:3] == [bos, *s[1:3]] and len(s) > 10 for s in sequences[str(kinds["chat"])])
    assert len(probes) == 2
    # the probe cost: at most 3 starts × 8 samples × min(64, max_new_tokens) tokens
    assert raw["start_choice"]["probe_tokens"] <= 3 * choose.PROBE_SAMPLES * 24


def test_a_start_whose_prompts_fill_max_length_is_left_out_of_the_measurement(kinds, tmp_path, capsys, probes):
    """At max_length 64 the seed prompts through the chat template (62-118 tokens) leave no room for what the expert
    writes: the chat-tuned expert had chosen them all the same, and every record was prompt alone (a warning said so
    after). The measurement now chooses among the starts that leave room, and says which it left out."""
    path = kinds_recipe(kinds, tmp_path, experts=("chat",))
    recipe = yaml.safe_load(path.read_text())
    recipe["featcal"]["max_length"] = 64
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    sequences = _generate_only(path)
    err = " ".join(capsys.readouterr().err.split())
    chat = _record(tmp_path, "chat")
    assert chat["start_mode"] in ("bos", "empty") and set(chat["start_choice"]["scores"]) == {"bos", "empty"}
    left_out = re.search(rf"expert {re.escape(str(kinds['chat']))}: shipped seed prompts left out of the start's measurement: "
                         r"(\d+) of its 60 prompts fill featcal.max_length 64, so their records would hold none of what the "
                         r"expert writes", err)
    assert left_out and int(left_out.group(1)) > 30
    assert "fill featcal.max_length 64, so their records hold none" not in err  # the warning after the choice: not needed
    prompt = 1 if chat["start_mode"] == "bos" else 23  # the BOS token, or the empty request through the template
    assert all(len(s) > prompt for s in sequences[str(kinds["chat"])]) and len(probes) == 1


def test_the_choice_is_cached_recorded_and_in_the_set_key(kinds, tmp_path, probes, monkeypatch):
    path = kinds_recipe(kinds, tmp_path, experts=("raw",))
    first = _generate_only(path)
    assert len(probes) == 1
    assert _generate_only(path) == first and len(probes) == 1  # the choice and the set reused
    # another choice (here: the stored one edited) gives another set, from the other start
    stored = tmp_path / GENERATED_DIR / "raw.start.json"
    record = json.loads(stored.read_text())
    record["choice"]["mode"] = "chat"
    record["choice"]["scores"]["chat"]["score"] = 10.0  # a clear winner: no mix of the two starts
    stored.write_text(json.dumps(record))
    opened = []
    original = generation_run.open_sampler
    monkeypatch.setattr(generation_run, "open_sampler", lambda *a, **k: opened.append(1) or original(*a, **k))
    second = _generate_only(path)
    assert len(probes) == 1 and opened == [1]  # not measured again, but sampled again
    assert _record(tmp_path, "raw")["start_mode"] == "chat" and second != first


def test_the_card_and_saved_recipe_name_the_chosen_start(kinds, tmp_path):
    from featcal_llm.pipeline import run_recipe

    path = kinds_recipe(kinds, tmp_path)
    run_recipe(path, progress=False)
    card = (tmp_path / "featcal" / "README.md").read_text()
    starts = read_run_record(tmp_path / "featcal")["generation_starts"]
    assert starts[Path(kinds["raw"]).name]["mode"] == "bos" and starts[Path(kinds["chat"]).name]["mode"] == "chat"  # the card names models without local paths
    raw = starts[Path(kinds["raw"]).name]
    assert raw["chosen_by"] == "measurement" and set(raw["scores"]) == {"bos", "chat", "empty"}
    assert "written by the expert from the BOS token (chosen by measurement)" in card
    saved = (tmp_path / "featcal" / "featcal_recipe.yml").read_text()
    assert f"# generate: {kinds['chat']} began its samples from the shipped seed prompts (chosen by measurement)" in saved
    data = yaml.safe_load(saved)["featcal"]["data"]  # the measured starts forced, so a later version's measurement cannot move them
    assert data[str(kinds["raw"])]["generate"]["chat_template"] == "off" and data[str(kinds["chat"])]["generate"]["chat_template"] == "on"


@pytest.mark.parametrize(
    "expert, forced, mode, source",
    [("chat", {"chat_template": "off"}, "bos", "BOS token"), ("raw", {"chat_template": "on"}, "chat", "shipped seed prompts"),
     ("raw", {"start": "</s>"}, "start token", "start token </s>"), ("raw", {"chat_template": "empty"}, "empty", "empty request")],
)
def test_the_recipe_still_forces_a_start(kinds, tmp_path, monkeypatch, expert, forced, mode, source):
    monkeypatch.setattr(generation_run, "choose_start", lambda *a, **k: pytest.fail("measured a forced start"))
    _generate_only(kinds_recipe(kinds, tmp_path, experts=(expert,), **forced))
    record = _record(tmp_path, expert)
    assert record["start_mode"] == mode and record["start"] == source and record["start_choice"] is None
    if mode == "empty":  # every sample answers one user turn with nothing in it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(kinds[expert])
        request = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)["input_ids"]
        samples = [json.loads(line) for line in (tmp_path / GENERATED_DIR / f"{expert}.jsonl").read_text().splitlines()]
        assert samples and all(s["token_ids"][: s["prompt_length"]] == list(request) for s in samples)


def test_default_new_tokens_stop_at_max_length(kinds, tmp_path):
    from featcal_llm.io.recipe import load_recipe

    path = kinds_recipe(kinds, tmp_path, experts=("raw",))
    recipe = yaml.safe_load(path.read_text())
    recipe["featcal"]["data"][str(kinds["raw"])]["generate"].pop("max_new_tokens")
    for max_length, expected in ((64, 64), (4096, 512)):
        recipe["featcal"]["max_length"] = max_length
        path.write_text(yaml.safe_dump(recipe))
        assert generation_run.settings_of(load_recipe(path), str(kinds["raw"]))["max_new_tokens"] == expected


def test_a_close_runner_up_still_leaves_every_sample_to_the_winner(kinds, tmp_path, capsys, monkeypatch):
    """Measured on real experts, drawing half the samples from a close runner-up recovered less than the winner
    alone: a close call changes nothing, and is no warning (the log line gives every score)."""
    def close_choice(candidates, *args, **kwargs):
        scores = {"bos": {"base": 0.7, "merged": 0.233, "score": 0.233}, "chat": {"base": 0.6, "merged": 0.231, "score": 0.231},
                  "empty": {"base": 0.5, "merged": 0.2, "score": 0.2}}
        return choose.Choice("bos", scores, {m: candidates[m].source for m in scores}, probe_tokens=1, references=["base", "merged"])

    monkeypatch.setattr(generation_run, "choose_start", close_choice)
    path = kinds_recipe(kinds, tmp_path, experts=("chat",), samples=8)
    sequences = _generate_only(path)
    err = capsys.readouterr().err
    assert "warning" not in err, err
    assert f"expert {kinds['chat']}: chose BOS token (KL vs base 0.7, vs merged 0.233; shipped seed prompts 0.231; empty request 0.2)" in err
    record = _record(tmp_path, "chat")
    assert record["start_mode"] == "bos" and record["start"] == "BOS token"
    samples = [json.loads(line) for line in (tmp_path / GENERATED_DIR / "chat.jsonl").read_text().splitlines()]
    assert len(samples) == len(sequences[str(kinds["chat"])]) == 8
    assert all(s["prompt_length"] == 1 and s["token_ids"][0] == 1 for s in samples)


# --- look-alike sets --------------------------------------------------------------------------------------------


def test_look_alike_sets_are_warned_about(kinds, tmp_path, capsys):
    """Twins draw 32 samples each: at 16 the two draws of one model overlapped 0.99 × as much as a set's halves with
    AVX-512 kernels but under the 0.9 × bound with AVX2's; at 32, 1.00 × and 0.95 × (the two kinds: 0.06 ×, 0.07 ×)."""
    _generate_only(kinds_recipe(kinds, tmp_path / "twins", experts=("raw", "raw_twin"), chat_template="off", samples=32))
    err = capsys.readouterr().err
    assert err.count("featcal-llm: warning:") == 1, err
    warning = next(line for line in err.splitlines() if "warning" in line)
    assert f"the generated sets of {kinds['raw']} and {kinds['raw_twin']} are nearly the same text" in warning
    _generate_only(kinds_recipe(kinds, tmp_path / "kinds", experts=("raw", "chat"), samples=32))  # each from its own start
    assert "nearly the same text" not in capsys.readouterr().err


def test_a_prompt_every_expert_shares_does_not_make_their_sets_look_alike(kinds, tmp_path, capsys, monkeypatch):
    """Both experts answer the shipped seed prompts: only what they write is compared, not the prompts they share
    (each sample's tokens after its prompt, up to max_length, as the stored samples record them)."""
    from featcal_llm.generation.store import generated_set_paths
    from featcal_llm.io.recipe import load_recipe

    compared, original = {}, generation_run._warn_look_alike
    monkeypatch.setattr(generation_run, "_warn_look_alike", lambda recipe, sets: compared.update(sets) or original(recipe, sets))
    path = kinds_recipe(kinds, tmp_path / "seeds", experts=("raw", "chat"), chat_template="on", samples=16)
    _generate_only(path)
    assert "nearly the same text" not in capsys.readouterr().err
    recipe = load_recipe(path)
    stored = generated_set_paths(Path(recipe.featcal.output), [expert.name for expert in recipe.experts])
    assert set(compared) == set(stored)
    for name, (samples, _) in stored.items():
        records = [json.loads(line) for line in samples.read_text().splitlines()]
        assert all(record["prompt_length"] > 0 for record in records)  # the seed prompts' tokens are there to leave out
        assert compared[name] == [record["token_ids"][record["prompt_length"]:recipe.featcal.max_length] for record in records]


# --- bad input --------------------------------------------------------------------------------------------------


def test_an_unknown_chat_template_setting_is_one_line(merged_scenario, tmp_path):
    def mutate(recipe, _):
        recipe["featcal"]["data"][recipe["models"][0]["model"]] = {"generate": {"chat_template": "sometimes"}}

    assert_refused_in_one_line(merged_scenario, tmp_path, mutate, ["generate.chat_template", "'auto', 'on', 'off' or 'empty'"])


def test_a_choice_measured_in_one_dtype_is_not_reused_in_another(kinds, tmp_path, probes):
    """The choice's key holds dtype, device, backend and remote code, as the sample set's does (issue 45)."""
    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.io.references import resolve_source
    from transformers import AutoConfig

    path = kinds_recipe(kinds, tmp_path, experts=("raw",))
    recipe = load_recipe(path)
    base = resolve_source(recipe.base, "base_model")
    sources = {e.name: resolve_source(e.reference, e.name, base) for e in recipe.experts}
    configs = {name: AutoConfig.from_pretrained(source.directory) for name, source in sources.items()}

    def generate(dtype):
        return generation_run.generated_sequences(recipe, sources, configs, torch.device("cpu"), dict.fromkeys(sources, dtype), False)

    generate(torch.float32)
    generate(torch.float32)
    assert len(probes) == 1  # same dtype: the choice is reused
    generate(torch.float64)
    assert len(probes) == 2  # another dtype: measured again


def test_a_backend_that_fails_to_open_after_the_probe_is_reported_as_itself(kinds, tmp_path, probes, monkeypatch):
    """The probe's transformers sampler is closed before vLLM opens; when vLLM fails to start (too little free memory),
    its own error is what the run reports, not the probe sampler closed a second time (an AttributeError)."""
    from featcal_llm.errors import FeatCalError

    path = kinds_recipe(kinds, tmp_path)
    monkeypatch.setattr(generation_run, "choose_backend", lambda *args: "vllm")

    def fails(*args, **kwargs):
        raise FeatCalError("vllm could not start: 0.9 of the GPU's memory is not free")

    monkeypatch.setattr(generation_run, "open_sampler", fails)
    with pytest.raises(FeatCalError, match="vllm could not start"):
        _generate_only(path)
    assert probes  # the start was measured, so a probe sampler was open when vLLM was asked for


def test_the_probe_prompts_spread_over_the_starts_prompts():
    from featcal_llm.generation.choose import probe_prompts
    from featcal_llm.generation.prompts import Start

    start = Start(tuple(str(i) for i in range(16)), tuple((i,) for i in range(16)), "prompts", False)
    assert probe_prompts(start, 8) == [(i,) for i in range(0, 16, 2)]
    assert probe_prompts(Start(("",), ((1,),), "BOS token", False), 3) == [(1,)] * 3


def test_an_exact_tie_between_starts_goes_to_the_first_in_modes_order(monkeypatch):
    """Two starts whose probes score alike (the same prompts, say): the earlier in MODES is chosen, as documented."""
    from types import SimpleNamespace

    import featcal_llm.generation.choose as choose
    from featcal_llm.generation.prompts import Start

    monkeypatch.setattr(choose, "written_logits", lambda model, rows, device: [torch.zeros(2, 5) for _ in rows])
    monkeypatch.setattr(choose, "kl_rows", lambda log_probs, logits: torch.zeros(2))
    sampler = SimpleNamespace(sample=lambda prompts, settings, seed: [[1, 2]] * len(prompts), model=None)
    reference = {"merged": lambda: SimpleNamespace(model=None, close=lambda: None)}
    starts = {mode: Start(("",), ((1,),), mode, mode == "chat") for mode in ("chat", "empty", "bos")}
    settings = {"max_new_tokens": 8, "seed": 0, "stream": 0}
    assert choose.choose_start(starts, sampler, reference, settings, torch.device("cpu")).mode == "bos"
    assert choose.choose_start({m: starts[m] for m in ("empty", "chat")}, sampler, reference, settings, torch.device("cpu")).mode == "chat"
