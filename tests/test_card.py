"""The model card as the Hub reads it: huggingface_hub's ModelCard parses the front matter; the body says what was done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import save_file

from featcal_llm.io.card import point_usage_at, write_card
from featcal_llm.io.recipe import load_recipe
from featcal_llm.io.references import ModelSource

CALIBRATED = {"projections": ["mlp.down_proj"], "every_projection": True, "norms": False, "biases": True, "head": None}


def _recipe(tmp_path: Path, **featcal) -> Path:
    (tmp_path / "local-expert").mkdir(parents=True)
    (tmp_path / "code.jsonl").write_text('{"text": "x"}\n')
    block = {"merged": str(tmp_path / "merged"), "output": str(tmp_path / "my-merge"), "data": {
        "org/math@v2": {"path": "MergeBench/math_val", "format": "alpaca", "instruction": "query"},
        "org/code+org/code-lora": {"path": str(tmp_path / "code.jsonl")},
        str(tmp_path / "local-expert"): {"generate": {}},
    }, **featcal}
    recipe = {"merge_method": "task_arithmetic", "base_model": "meta-llama/Llama-3.2-3B",
              "models": [{"model": name, "parameters": {"weight": 0.3}} for name in block["data"]],
              "dtype": "bfloat16", "featcal": block}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _card(tmp_path: Path, bias: bool = False, **featcal) -> tuple[Path, str]:
    """A card written for a recipe with hub experts, a base whose card says llama3.2, and raw float NLLs."""
    recipe = load_recipe(_recipe(tmp_path, **featcal))
    base = tmp_path / "base-snapshot"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: llama3.2\n---\n# Llama\n")
    output = tmp_path / "checkpoint"
    output.mkdir()
    tensors = {"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}
    if bias:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(2)
    save_file(tensors, output / "model.safetensors")
    names = [expert.name for expert in recipe.experts]
    coverage = {"base": {name: 4.607189019958311 for name in names}, **{name: {other: 3.1234567891 for other in names} for name in names}}
    write_card(output, recipe, str(tmp_path / "merged"), {name: 100 for name in names}, precisions={"dtype": torch.float32},
               sources={"base_model": ModelSource("meta-llama/Llama-3.2-3B", base)}, calibrated=CALIBRATED,
               weights={name: 1.0 + index / 3 for index, name in enumerate(names)}, coverage=coverage,
               advantage={name: {"tokens_ahead": 0.4567891, "lead": 0.2071234567} for name in names})
    return output, (output / "README.md").read_text(encoding="utf-8")


def test_the_hub_reads_the_lineage_license_datasets_and_task(tmp_path):
    output, text = _card(tmp_path)
    data = ModelCard.load(output / "README.md").data
    assert data.base_model == ["meta-llama/Llama-3.2-3B", "org/math", "org/code", "org/code-lora"]  # every hub model, no revision
    assert data.base_model_relation == "merge"
    assert data.license == "llama3.2"  # the base's, from its card on this machine
    assert data.datasets == ["MergeBench/math_val"]  # the local file and the generated texts are no hub datasets
    assert (data.pipeline_tag, data.library_name, data.tags) == ("text-generation", "transformers", ["merge", "mergekit", "featcal"])
    front = yaml.safe_load(text.split("---")[1])
    assert front["featcal"]["coverage_nll"]["base"]["org/math@v2"] == 4.6072  # rounded in the front matter...
    assert front["featcal"]["expert_weights"]["org/math@v2"] == 1.0 and front["featcal"]["expert_lead"]["org/math@v2"] == {"tokens_ahead": 0.4568, "lead": 0.2071}
    assert "4.607189" not in text and "3.12345" not in text and "1.3333333" not in text
    exact = json.loads((output / "featcal_weights.json").read_text())  # ...and exact beside it
    assert exact["coverage_nll"]["base"]["org/math@v2"] == 4.607189019958311


def test_a_license_key_wins_and_a_base_without_a_card_gives_none(tmp_path):
    output, _ = _card(tmp_path / "a", license="apache-2.0")
    assert ModelCard.load(output / "README.md").data.license == "apache-2.0"
    recipe = load_recipe(_recipe(tmp_path / "b"))
    (tmp_path / "b" / "out").mkdir()
    write_card(tmp_path / "b" / "out", recipe, "merged", {expert.name: 1 for expert in recipe.experts}, calibrated=CALIBRATED)
    assert ModelCard.load(tmp_path / "b" / "out" / "README.md").data.license is None


def test_the_body_is_plain_sentences_with_usage_and_citation(tmp_path):
    output, text = _card(tmp_path)
    body = text.split("---", 2)[2]
    assert body.startswith("\n\n# my-merge\n\nThis model is a merge of 3 experts fine-tuned from `meta-llama/Llama-3.2-3B`")
    assert "into the merged model (`merged`)" in body and "to the merged model." in body
    assert "Every linear projection of every decoder layer was re-fitted. The norms keep the merged model's scales." in body
    assert "bias" not in body.lower()  # the checkpoint has none: nothing to say about them
    assert "in forward order" not in body and "also updated:" not in body
    assert 'model_id = "my-merge"' in body and "AutoModelForCausalLM.from_pretrained(model_id" in body
    assert "FeatCal: Feature Calibration for Post-Merging Models" in body and "Gu, Yanggan and Cai, Shuo and Wang, Zihao and Wang, Wenjun" in body
    assert body.index("## Usage") < body.index("## Recipe") < body.index("## Citation")
    point_usage_at(output, "me/my-merge")
    assert 'model_id = "me/my-merge"' in (output / "README.md").read_text()


@pytest.mark.parametrize("biases", [True, False])
def test_biases_are_named_only_for_a_model_that_has_them(tmp_path, biases):
    _, text = _card(tmp_path, bias=biases)
    body = text.split("---", 2)[2]
    assert ("The projections' biases were updated with their weights." in body) is biases
    assert ("biases" in yaml.safe_load(text.split("---")[1])["featcal"]["settings"]) is biases
