"""The real-model study's pure parts: record building and splitting, prompts, recipes, gap-recovered arithmetic.

The real model is not run here (minutes of CPU); these checks use a character tokenizer.
"""

from __future__ import annotations

import random

import pytest
import yaml

from studies import real_data as rd
from studies.real_text import _parser, recipe_text
from featcal_llm.errors import FeatCalError


class CharTokenizer:
    """One token per character: token counts and windows can be checked by hand."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


TOK = CharTokenizer()
DOCS = [(f"doc{i:02d}", "".join(chr(97 + (i + j) % 26) for j in range(10 + 7 * i))) for i in range(12)]


def test_windows_are_contiguous_exact_and_drop_the_tail():
    assert rd.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rd.windows(list(range(3)), 4) == []


def test_split_matches_a_hand_walk_of_the_seeded_document_order():
    sizes = rd.SplitSizes(train=5, cal=2, test=2, per_document=1)
    splits = rd.split_records(DOCS, TOK, sizes, record_tokens=8, seed=3)
    order = list(DOCS)
    random.Random(3).shuffle(order)  # the documented contract: documents shuffled by the seed
    expected = {"test": [], "cal": [], "train": []}
    for name, text in order:  # test and cal take one 8-character window per document, train all of them
        split = next((s for s, n in (("test", 2), ("cal", 2), ("train", 5)) if len(expected[s]) < n), None)
        if split is None:
            break
        cap = len(text) // 8 if split == "train" else 1
        for k in range(cap):
            if len(expected[split]) < dict(test=2, cal=2, train=5)[split]:
                expected[split].append({"text": text[8 * k:8 * k + 8], "source": name})
    assert splits == expected


def test_split_is_deterministic_disjoint_and_sized():
    sizes = rd.SplitSizes(train=20, cal=4, test=3, per_document=2)
    first = rd.split_records(DOCS, TOK, sizes, 8, seed=0)
    assert first == rd.split_records(DOCS, TOK, sizes, 8, seed=0)
    assert first != rd.split_records(DOCS, TOK, sizes, 8, seed=1)
    sources = {s: {r["source"] for r in records} for s, records in first.items()}
    assert not (sources["test"] & sources["cal"]) and not (sources["test"] & sources["train"])
    assert not (sources["cal"] & sources["train"])
    assert {s: len(r) for s, r in first.items()} == {"test": 3, "cal": 4, "train": 20}
    texts = dict(DOCS)
    for records in first.values():
        for r in records:
            assert len(r["text"]) == 8 and r["text"] in texts[r["source"]]
    for split in ("test", "cal"):  # at most per_document records from one document
        names = [r["source"] for r in first[split]]
        assert max(names.count(n) for n in names) <= 2
    capped = rd.split_records(DOCS, TOK, rd.SplitSizes(train=20, cal=4, test=3, per_document=2, train_per_document=3),
                              8, seed=0)
    names = [r["source"] for r in capped["train"]]
    assert len(names) == 20 and max(names.count(n) for n in names) == 3
    assert capped["test"] == first["test"] and capped["cal"] == first["cal"]


def test_not_enough_text_is_refused_naming_the_split():
    with pytest.raises(FeatCalError, match=r"records: not enough text for train \d+/100 records of 8 tokens"):
        rd.split_records(DOCS[:4], TOK, rd.SplitSizes(train=100, cal=1, test=1, per_document=1), 8, seed=0)


def test_prompts_are_the_records_first_tokens():
    records = [{"text": "abcdefgh"}, {"text": "xyz"}]
    assert rd.prompt_records(records, TOK, 4) == [{"prompt": "abcd"}, {"prompt": "xyz"}]


def test_licence_banner_is_dropped_other_leading_comments_kept():
    licensed = "/* Foo.\n   Copyright (C) 1991 FSF.  */\n\n#ifndef X\n"
    assert rd._strip_licence(licensed) == "#ifndef X\n"
    assert rd._strip_licence("/* ISO C99 */\n#ifndef X\n") == "/* ISO C99 */\n#ifndef X\n"


def test_unknown_kind_is_refused():
    with pytest.raises(FeatCalError, match="kind 'poetry': expected one of code, prose, c"):
        rd.documents("poetry")


def test_prose_from_a_folder_of_rest_sources(tmp_path):
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "os.rst.txt").write_text("The os module.")
    (tmp_path / "tutorial.rst").write_text("An informal introduction.")
    (tmp_path / "index.html").write_text("<p>not a source</p>")
    assert rd.documents("prose", prose_dir=tmp_path) == [
        ("library/os.rst.txt", "The os module."), ("tutorial.rst", "An informal introduction.")]
    assert rd.documents("code", prose_dir=tmp_path)[0][0].endswith(".py")  # only prose comes from the folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatCalError, match="empty: expected reStructuredText sources"):
        rd.documents("prose", prose_dir=tmp_path / "empty")


def test_too_little_prose_names_the_kind_and_points_to_prose_dir(tmp_path, monkeypatch):
    from studies import real_text

    monkeypatch.setattr(rd, "documents", lambda kind, prose_dir=None: DOCS[:2] if kind == "prose" else DOCS)
    small = ["--workdir", str(tmp_path), "--base", "b", "--record-tokens", "8", "--train-records", "4",
             "--cal-records", "1", "--test-records", "1"]
    with pytest.raises(FeatCalError, match=r"^data/prose: records: not enough text for train \d/4 .*pass --prose-dir"):
        real_text._data(tmp_path, TOK, _parser().parse_args(small), log=lambda _: None)
    with pytest.raises(FeatCalError, match=r"train \d/4 records of 8 tokens$"):  # a folder given: no hint
        real_text._data(tmp_path, TOK, _parser().parse_args(small + ["--prose-dir", "p"]), log=lambda _: None)


def test_gap_recovered_by_hand():
    assert rd.gap_recovered(nll_expert=1.0, nll_merged=2.0, nll_calibrated=1.5) == pytest.approx(0.5)
    assert rd.gap_recovered(1.2, 1.6, 1.7) == pytest.approx(-0.25)  # worse than the merge
    assert rd.gap_recovered(1.5, 1.5, 1.4) is None  # no gap
    assert rd.gap_recovered(1.6, 1.5, 1.4) is None  # the merge is better than the expert: nothing to recover
    nll = {"expert:code": {"code": 1.0}, "expert:prose": {"prose": 2.0}, "expert:c": {"c": 0.5},
           "merged": {"code": 1.4, "prose": 2.5, "c": 1.0},
           "featcal:real": {"code": 1.2, "prose": 2.4, "c": 0.6}}
    rec = rd.recovery(nll, rd.KINDS, "featcal:real")
    # code (1.4-1.2)/(1.4-1.0) = 0.5; prose (2.5-2.4)/(2.5-2.0) = 0.2; c (1.0-0.6)/(1.0-0.5) = 0.8
    assert rec["per_kind"] == pytest.approx({"code": 0.5, "prose": 0.2, "c": 0.8})
    assert rec["mean"] == pytest.approx(0.5)
    nll["merged"]["prose"] = 1.9  # below the prose expert: prose has no gap and leaves the mean
    rec = rd.recovery(nll, rd.KINDS, "featcal:real")
    assert rec["per_kind"]["prose"] is None and rec["mean"] == pytest.approx((0.5 + 0.8) / 2)


def test_recipes_hold_each_settings_data_spec():
    args = _parser().parse_args(["--workdir", "w", "--base", "b"])
    real, bos, prompts = (yaml.safe_load(recipe_text("/m/base", s, args)) for s in ("real", "bos", "prompts"))
    assert real["merge_method"] == "task_arithmetic" and real["base_model"] == "/m/base"
    assert [m["model"] for m in real["models"]] == ["experts/code", "experts/prose", "experts/c"]
    assert real["featcal"]["data"]["experts/c"] == {"path": "data/c/cal.jsonl", "format": "text"}
    assert bos["featcal"]["data"]["experts/code"] == {
        "generate": {"samples": 64, "max_new_tokens": 160, "chat_template": "off", "seed": 0, "temperature": 1.0}}
    assert prompts["featcal"]["data"]["experts/prose"]["generate"]["prompts"] == "data/prose/prompts.jsonl"
    assert prompts["featcal"]["data"]["experts/prose"]["generate"]["max_new_tokens"] == 128
    assert {k: real["featcal"][k] for k in ("samples", "max_length", "lambda", "alpha", "rho")} == {
        "samples": 64, "max_length": 160, "lambda": 1e-3, "alpha": 0.5, "rho": 1.0}
    assert prompts["featcal"]["output"] == "runs/prompts/featcal"
    redraw = _parser().parse_args(["--workdir", "w", "--base", "b", "--seed", "0", "--generate-seed", "1"])
    redrawn = yaml.safe_load(recipe_text("/m/base", "bos", redraw))["featcal"]["data"]["experts/c"]["generate"]
    assert redrawn["seed"] == 1
    assert [m["parameters"]["weight"] for m in real["models"]] == [0.333333] * 3
    quarter = _parser().parse_args(["--workdir", "w", "--base", "b", "--merge-weight", "0.25"])
    assert [m["parameters"]["weight"] for m in yaml.safe_load(recipe_text("/m/base", "bos", quarter))["models"]] == [0.25] * 3
    cooler = _parser().parse_args(["--workdir", "w", "--base", "b", "--temperature", "0.7"])
    for setting in ("bos", "prompts"):
        spec = yaml.safe_load(recipe_text("/m/base", setting, cooler))["featcal"]["data"]["experts/c"]["generate"]
        assert spec["temperature"] == 0.7


def test_state_saves_merge_what_two_runs_wrote(tmp_path):
    from studies.real_text import State

    first, second = State(tmp_path / "state.json"), State(tmp_path / "state.json")
    first.data["nll"]["base"] = {"code": 1.0}
    first.save()
    second.data["nll"]["base"] = {"c": 2.0}
    second.data["timings"]["run:bos"] = 3.0
    second.save()
    assert State(tmp_path / "state.json").data == {
        "timings": {"run:bos": 3.0}, "training": {}, "nll": {"base": {"code": 1.0, "c": 2.0}}}


def test_token_kl_by_hand():
    import math

    import torch

    from studies.real_models import token_kl

    ref = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
    model = torch.log(torch.tensor([[[0.25, 0.75], [0.9, 0.1]]]))
    first = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # second position: identical, KL 0
    assert token_kl(ref, model, torch.tensor([[1.0, 1.0]])) == (pytest.approx(first), 2)
    assert token_kl(ref, model, torch.tensor([[0.0, 1.0]])) == (pytest.approx(0.0, abs=1e-7), 1)


def test_record_nlls_match_a_float64_cross_entropy_per_record_on_a_large_vocabulary():
    """Each record's summed NLL and token count, padding ignored, to float32 accuracy against float64 (a 49k-wide
    softmax summed along a strided axis drifted 1.5e-4 nats a token on SmolLM2, 2.4-3.5e-5 here; the flattened one is
    0.5e-6 with AVX-512 kernels and 4.1e-6 with AVX2's, as on CI: ATEN_CPU_CAPABILITY=avx2 shows it)."""
    import torch

    from studies.real_models import record_nlls

    torch.manual_seed(0)
    vocab, pad = 49152, 0
    rows = [([5, 17, 9, 300, 2048, 7], 1), ([8, 40000, 3], 1), ([11, 12, 13, 14], 1)]
    embed, head = torch.randn(vocab, 16), torch.randn(16, vocab) * 0.75  # logits of spread 3, as a real LM's

    class Logits(torch.nn.Module):  # a bigram model: what record_nlls needs of a causal LM is `.logits`
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": embed[input_ids] @ head})

    model = Logits()
    got = record_nlls(model, rows, pad, batch_size=2)
    for (ids, start), (total, count) in zip(rows, got):
        logits = model(torch.tensor([ids]), None).logits[0].double()
        expected = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).sum()
        assert count == len(ids) - 1
        assert abs(total - expected.item()) / count < 1e-5  # nats a token
