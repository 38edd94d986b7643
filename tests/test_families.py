"""Families beyond the exactness matrix: mixture-of-experts refusal, a tied Llama end to end, mergekit's methods."""

from __future__ import annotations

import pytest
import torch
import yaml
from test_exactness import read_weights
from transformers import AutoModelForCausalLM, AutoTokenizer

from featcal_llm.family.architectures import architecture_for
from featcal_llm.errors import FeatCalError
from featcal_llm.pipeline import run_recipe


def test_mixture_of_experts_is_a_one_line_error():
    from transformers import MixtralConfig

    config = MixtralConfig(architectures=["MixtralForCausalLM"])
    with pytest.raises(FeatCalError, match=r"^base: architecture \['MixtralForCausalLM'\] is a mixture of experts; FeatCal calibrates dense decoder layers only$"):
        architecture_for(config, "base")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied-embedding Llama (as Llama-3.2-3B, SmolLM2): one layer, two experts, no lm_head tensor anywhere."""
    from scenario import build_scenario

    return build_scenario(tmp_path_factory.mktemp("tied"), experts=2, layers=1, samples=8, tie_word_embeddings=True)


def test_tied_model_end_to_end(tied, tmp_path):
    """Bug 9: the output keeps the tied tensor set, loads with transformers and generates."""
    output = run_recipe(tied.write_recipe(tmp_path / "r.yaml", merged=str(tmp_path / "merged"), output=str(tmp_path / "out")), progress=False)
    ours, merged = read_weights(output), read_weights(tmp_path / "merged")
    assert set(ours) == set(merged) and "lm_head.weight" not in ours
    assert any(not torch.equal(ours[n], merged[n]) for n in ours if "proj" in n)
    model = AutoModelForCausalLM.from_pretrained(output)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.model.embed_tokens.weight, merged["model.embed_tokens.weight"])
    ids = AutoTokenizer.from_pretrained(output)("the merge", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)


def _with_method(recipe: dict, method: str) -> dict:
    """The recipe rewritten for a mergekit method, with the method's own parameters."""
    base, experts = recipe["base_model"], [m["model"] for m in recipe["models"]]
    recipe["merge_method"] = method
    parameters = {  # slerp is refused since issue 16 (its base_model is an interpolation endpoint): nuslerp is the base-aware SLERP
        "nuslerp": {"weight": 0.5},
        "linear": {"weight": 0.5},
        "ties": {"weight": 0.5, "density": 0.6},
        "dare_ties": {"weight": 0.5, "density": 0.6},
        "della": {"weight": 0.5, "density": 0.6, "epsilon": 0.1},
    }[method]
    recipe["models"] = [{"model": e, "parameters": dict(parameters)} for e in experts]
    if method == "linear":  # mergekit's linear merges the base too when base_model is set (FeatCal needs it set)
        recipe["models"].append({"model": base, "parameters": {"weight": 0.0}})
    if method == "della":
        recipe["parameters"] = {"lambda": 1.0}
    return recipe


@pytest.mark.parametrize("method", ["ties", "dare_ties", "linear", "nuslerp", "della"])
def test_mergekit_method_is_merged_then_calibrated(tied, tmp_path, method):
    """FeatCal is a post-merge stage for any merge: mergekit merges the recipe (no `merged` yet), then we calibrate."""
    from mergekit.config import MergeConfiguration

    recipe = _with_method(yaml.safe_load(tied.recipe.read_text()), method)
    recipe["featcal"].update(merged=str(tmp_path / "merged"), output=str(tmp_path / "out"))
    MergeConfiguration.model_validate(recipe)  # what mergekit-yaml validates, featcal block included
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(path, progress=False)
    merged = read_weights(tmp_path / "merged")
    assert "featcal:" in (tmp_path / "merged" / "mergekit_config.yml").read_text()
    assert f"merge_method: {method}" in (tmp_path / "merged" / "mergekit_config.yml").read_text()
    ours = read_weights(output)
    assert set(ours) == set(merged)
    changed = {n for n in ours if not torch.equal(ours[n], merged[n])}
    assert changed and all(".layers.0." in n for n in changed)
