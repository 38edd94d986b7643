"""`tokenizer_source` / `tokenizer:` recipes (issue 16): the identity mapping, checked, or a refusal by name.

The merge runs first, so calibration texts are tokenised by the tokenizer
mergekit built (a union here). Every expert is then fed those same ids: that is
exact when each expert's own tokenizer gives every token the union's id and its
embedding has a row for every id in its own calibration text, and refused
otherwise, naming the expert and the token.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_recipe_forms import assert_matches_brute_force, refused, write_recipe
from transformers import AutoModelForCausalLM, AutoTokenizer

from featcal_llm.pipeline import run_recipe


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """expert1 with an added token <x> (id 100, one more embedding row), and expert1 with <y> instead."""
    from scenario import build_scenario

    root = tmp_path_factory.mktemp("tok")
    scenario = build_scenario(root, experts=2, layers=2, samples=4, words=(3, 8), dtype="float64")
    for token in ("x", "y"):
        model = AutoModelForCausalLM.from_pretrained(scenario.experts["expert1"], dtype=torch.float64)
        tokenizer = AutoTokenizer.from_pretrained(scenario.experts["expert1"])
        tokenizer.add_tokens([f"<{token}>"])
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[-1].normal_(0, 0.02, generator=torch.Generator().manual_seed(7))
        model.save_pretrained(root / f"expert_{token}")
        tokenizer.save_pretrained(root / f"expert_{token}")
    for name, text in (("with_x", "calibrate <x> the merge"), ("plain", "calibrate the merge")):
        lines = [json.dumps({"text": f"{text} {i}"}) for i in range(6)]
        (root / f"data_{name}.jsonl").write_text("\n".join(lines) + "\n")
    return scenario


def recipe_with(tok, tmp_path, name: str, second: str, data: tuple[str, str]):
    experts = [str(tok.experts["expert0"]), str(tok.root / second)]
    merge = {"merge_method": "task_arithmetic", "base_model": str(tok.base), "tokenizer_source": "union",
             "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts]}
    path = write_recipe(tok, tmp_path, name, merge, experts, [tok.root / f"data_{source}.jsonl" for source in data])
    return path, experts


def test_union_tokenizer_calibrates_exactly_with_the_identity_mapping(tok, tmp_path, monkeypatch):
    """Experts with the base's vocabulary: the union is that vocabulary, ids map to themselves, the run is exact. The
    merge's tokenizer is built once before the merge, though run checks its rows as validate does and again before
    merging."""
    from featcal_llm.io import merge_vocabulary

    builds = []
    build = merge_vocabulary._merge_tokenizer
    monkeypatch.setattr(merge_vocabulary, "_BUILT", {})
    monkeypatch.setattr(merge_vocabulary, "_merge_tokenizer", lambda *args: builds.append(args) or build(*args))
    recipe, experts = recipe_with(tok, tmp_path, "union", "expert1", ("plain", "plain"))
    output = run_recipe(recipe, progress=False)
    assert len(builds) == 1
    assert len(AutoTokenizer.from_pretrained(tmp_path / "merged_union")) == 100
    worst = assert_matches_brute_force(tok, recipe, output, {e: tok.root / e.rsplit("/", 1)[-1] for e in experts})
    print(f"union tokenizer: worst ΔW relative error {worst:.1e}")


def test_an_added_token_in_an_expert_without_it_is_refused(tok, tmp_path):
    """<x> in expert0's calibration text, beside an expert that adds it (the union: 101 rows, expert0 100): id 100 has
    no row in expert0's embedding, which the vocabulary's size says before any record is tokenised or merged."""
    recipe, experts = recipe_with(tok, tmp_path, "union", "expert_x", ("with_x", "plain"))
    line = refused(recipe)
    assert f"{experts[0]}/config.json: vocabulary of 100 rows, the merge mergekit makes" in line and "has 101" in line
    assert not (tmp_path / "merged_union").exists()


def test_an_expert_vocabulary_other_than_the_merges_is_refused(tok, tmp_path):
    """The union has 101 rows, expert0 100: refused by name before the merge (mergekit's own builder makes the union
    first, as validate does), in the words run used after it."""
    recipe, experts = recipe_with(tok, tmp_path, "union", "expert_x", ("plain", "with_x"))
    line = refused(recipe)
    assert (f"{experts[0]}/config.json: vocabulary of 100 rows, the merge mergekit makes (its tokenizer's vocabulary from "
            "tokenizer source union) has 101") in line
    assert not (tmp_path / "merged_union").exists() and not (tmp_path / "merged_union.merging").exists()


def test_an_expert_with_added_tokens_is_refused_before_the_merge(tok, tmp_path):
    """Without tokenizer_source the merge keeps the base's vocabulary: refused before anything is written."""
    experts = [str(tok.experts["expert0"]), str(tok.root / "expert_x")]
    merge = {"merge_method": "task_arithmetic", "base_model": str(tok.base), "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts]}
    recipe = write_recipe(tok, tmp_path, "added", merge, experts)
    line = refused(recipe)
    assert f"{experts[1]}/config.json: vocabulary of 101 rows, the base model has 100" in line  # validate's check, run first
    assert not (tmp_path / "merged_added").exists()
    import featcal_llm  # validate refuses it too, from the configs, in run's words

    [problem] = [str(p) for p in featcal_llm.validate(recipe)]
    assert problem.startswith(f"{recipe}: models: {experts[1]}: {experts[1]}/config.json: vocabulary of 101 rows, the "
                              "base model has 100: experts whose vocabulary differs from the merge"), problem
    merge["tokenizer_source"] = "union"  # the union's size, from mergekit's own builder: expert0 is the one short of it
    [problem] = [str(p) for p in featcal_llm.validate(write_recipe(tok, tmp_path, "added-union", merge, experts))]
    assert f"{experts[0]}/config.json: vocabulary of 100 rows, the merge mergekit makes" in problem and "has 101" in problem


def test_experts_that_give_a_token_another_id_are_refused(tok, tmp_path):
    """expert_x says <x> = 100, expert_y says <y> = 100: the merge's tokenizer (expert_x's, 101 rows as each expert
    has) cannot match both."""
    experts = [str(tok.root / "expert_x"), str(tok.root / "expert_y")]
    merge = {"merge_method": "task_arithmetic", "base_model": str(tok.base), "tokenizer_source": experts[0],
             "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts]}
    line = refused(write_recipe(tok, tmp_path, "clash", merge, experts))
    assert "tokenizer maps '<" in line and "the calibration tokenizer to 10" in line


@pytest.fixture(scope="module")
def padded(tok):
    """The base and expert0 with 128 embedding rows for their tokenizer's 100 tokens (as Qwen2 keeps 151,936 rows for
    151,665 tokens): mergekit re-lays such an embedding out over the tokenizer it builds."""
    for name, source in (("padded_base", tok.base), ("padded_expert0", tok.experts["expert0"]), ("padded_expert1", tok.experts["expert1"])):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64)
        model.resize_token_embeddings(128, mean_resizing=False)
        model.save_pretrained(tok.root / name)
        AutoTokenizer.from_pretrained(source).save_pretrained(tok.root / name)
    return tok.root


@pytest.mark.parametrize("tokenizer, expected", [
    ({}, 128),  # the base's rows, copied
    ({"tokenizer_source": "base"}, 100),  # the base's tokenizer: its 100 tokens, whatever its config counts
    ({"tokenizer": {"source": "base", "pad_to_multiple_of": 48}}, 144),
    ({"tokenizer": {"source": "base", "pad_to_multiple_of": 50}}, 100),  # a multiple already: not padded a further 50
    ({"tokenizer_source": "union"}, 101),  # expert_x's <x> joins
    ({"tokenizer": {"source": "base", "tokens": {"<z>": {"source": {"kind": "zero"}}}}}, 101),
])
def test_the_merge_s_vocabulary_is_known_before_merging_as_mergekit_writes_it(padded, tmp_path, tokenizer, expected):
    """merge_vocabulary's rows against the embedding a real mergekit merge writes, for each way a recipe sets the
    tokenizer: validate and run refuse an expert of another size before the merge on these numbers."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    from safetensors import safe_open

    from featcal_llm.io.merge_vocabulary import merge_vocabulary

    experts = [str(padded / "padded_expert0"), str(padded / ("expert_x" if tokenizer else "padded_expert1"))]  # mergekit
    # copies rows only where every model has as many
    config = MergeConfiguration.model_validate({
        "merge_method": "task_arithmetic", "base_model": str(padded / "padded_base"), "dtype": "float32", **tokenizer,
        "models": [{"model": expert, "parameters": {"weight": 0.5}} for expert in experts]})
    predicted = merge_vocabulary(config, None, 128, trust_remote_code=False)
    run_merge(config, str(tmp_path / "merged"), options=MergeOptions(copy_tokenizer=True, write_model_card=False, quiet=True))
    [shard] = (tmp_path / "merged").glob("*.safetensors")
    with safe_open(shard, "pt") as weights:
        rows = weights.get_slice("model.embed_tokens.weight").get_shape()[0]
    assert predicted.rows == rows == expected
    assert predicted.what == "the base model" if not tokenizer else "the merge mergekit makes" in predicted.what


def test_run_refuses_an_expert_short_of_the_merge_s_tokenizer_before_merging_on_its_own(tok, tmp_path, monkeypatch):
    """run's own check (for a caller past validate): `tokenizer: {source: base, pad_to_multiple_of: 64}` makes 128
    rows, each expert has 100; refused by expert before mergekit writes anything, validate's check set aside."""
    from featcal_llm.io import validate_models

    monkeypatch.setattr(validate_models, "merge_vocabulary", lambda *args: None)  # validate: not known
    experts = [str(tok.experts["expert0"]), str(tok.experts["expert1"])]
    merge = {"merge_method": "task_arithmetic", "base_model": str(tok.base), "tokenizer": {"source": "base", "pad_to_multiple_of": 64},
             "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts]}
    line = refused(write_recipe(tok, tmp_path, "padded", merge, experts))
    assert f"error: expert {experts[0]}: vocabulary of 100 rows, the merge mergekit makes" in line and "has 128" in line
    assert not (tmp_path / "merged_padded").exists() and not (tmp_path / "merged_padded.merging").exists()


def test_the_merge_s_vocabulary_is_not_known_from_a_base_config_without_its_size():
    """The base's config.json without `vocab_size` and the base's tokenizer kept: no rows to check the experts against
    (None), not a vocabulary of None rows that every expert would differ from."""
    from mergekit.config import MergeConfiguration

    from featcal_llm.io.merge_vocabulary import merge_vocabulary

    config = MergeConfiguration.model_validate({"merge_method": "task_arithmetic", "base_model": "/nowhere/base",
                                                "models": [{"model": "/nowhere/expert", "parameters": {"weight": 0.5}}]})
    assert merge_vocabulary(config, None, None, trust_remote_code=False) is None
    assert merge_vocabulary(config, None, 100, trust_remote_code=False).rows == 100


def test_building_the_merge_s_tokenizer_leaves_mergekit_s_logging_as_it_was(padded):
    """mergekit's logger is silenced while its builder runs, and set back to the caller's level after."""
    import logging

    from mergekit.config import MergeConfiguration

    from featcal_llm.io.merge_vocabulary import merge_vocabulary

    config = MergeConfiguration.model_validate({
        "merge_method": "task_arithmetic", "base_model": str(padded / "padded_base"), "tokenizer_source": "union",
        "models": [{"model": str(padded / name), "parameters": {"weight": 0.5}} for name in ("padded_expert0", "expert_x")]})
    logger = logging.getLogger("mergekit")
    level = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert merge_vocabulary(config, None, 128, trust_remote_code=False).rows == 101
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(level)


def test_the_merge_s_tokenizer_is_built_again_once_its_files_change(padded, tmp_path, monkeypatch):
    """The rows are remembered by the configuration and the models' files: the same files, no second build; a token
    added to the base's tokenizer since, the new count."""
    import shutil

    from mergekit.config import MergeConfiguration

    from featcal_llm.io import merge_vocabulary

    monkeypatch.setattr(merge_vocabulary, "_BUILT", {})
    for name in ("padded_base", "padded_expert0", "padded_expert1"):
        shutil.copytree(padded / name, tmp_path / name)
    config = MergeConfiguration.model_validate({
        "merge_method": "task_arithmetic", "base_model": str(tmp_path / "padded_base"), "tokenizer_source": "base",
        "models": [{"model": str(tmp_path / name), "parameters": {"weight": 0.5}} for name in ("padded_expert0", "padded_expert1")]})
    assert merge_vocabulary.merge_vocabulary(config, None, 128, trust_remote_code=False).rows == 100
    assert merge_vocabulary.merge_vocabulary(config, None, 128, trust_remote_code=False).rows == 100
    assert len(merge_vocabulary._BUILT) == 1
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "padded_base")
    tokenizer.add_tokens(["<w>"])
    tokenizer.save_pretrained(tmp_path / "padded_base")
    assert merge_vocabulary.merge_vocabulary(config, None, 128, trust_remote_code=False).rows == 101
    assert len(merge_vocabulary._BUILT) == 2


def test_a_tokenizer_source_is_named_as_the_recipe_wrote_it():
    """A model reference with a LoRA keeps its `+adapter` in the refusal's words (the model alone named another
    source); 'base' and 'union' as written."""
    from mergekit.common import ModelReference

    from featcal_llm.io.merge_vocabulary import _named

    assert _named(ModelReference.parse("/models/base+/adapters/chat")) == "/models/base+/adapters/chat"
    assert _named(ModelReference.parse("/models/base")) == "/models/base"
    assert [_named(word) for word in ("base", "union")] == ["base", "union"]
def test_library_silenced_hides_a_library_s_log_lines_its_children_s_and_its_bar_then_restores_them(capsys):
    """Every record of the library's logger tree (CRITICAL included) is dropped inside, reaches its handler after
    (its level set back even when the work raises); with `printed`, what it writes to stderr is dropped too."""
    import logging
    import sys

    import pytest

    from featcal_llm import runlog

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root, child = logging.getLogger("featcal_probe_lib"), logging.getLogger("featcal_probe_lib.builder")
    handler = Keep(level=logging.DEBUG)
    root.addHandler(handler)
    try:
        root.setLevel(logging.INFO)
        with pytest.raises(RuntimeError):
            with runlog.library_silenced("featcal_probe_lib", printed=True):
                root.critical("inside critical")
                child.error("inside child")
                print("inside bar", file=sys.stderr)
                raise RuntimeError("the library's own error")
        assert root.level == logging.INFO
        with runlog.library_silenced("featcal_probe_lib"):
            print("not a bar", file=sys.stderr)
        root.warning("after")
        child.warning("child after")
        assert seen == ["after", "child after"]
        assert capsys.readouterr().err == "not a bar\n"
    finally:
        root.removeHandler(handler)
        root.setLevel(logging.NOTSET)
