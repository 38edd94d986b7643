"""A re-fitted head on a tied model is served by every runtime: the output is untied whatever the merged files held (issue 56).

mergekit writes `lm_head.weight` whenever an input stores it and copies `tie_word_embeddings: true`. A runtime that
honours the flag (vLLM's Llama loader skips `lm_head.*` when the config ties) would then serve the embedding as the
head. The test loads the output that way and with transformers: both must give the calibrated logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_exactness import read_weights

from featcal_llm.io.checkpoint import head_needs_untying
from featcal_llm.pipeline import run_recipe


def store_head(directory) -> None:
    """The checkpoint with `lm_head.weight` (the embedding's copy) written beside a config that still says tied."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def vllm_like(directory) -> torch.nn.Module:
    """As vLLM loads a Llama: from config.json, skipping `lm_head.*` when the config ties the head to the embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    tensors = read_weights(directory)
    if config.tie_word_embeddings:
        tensors = {name: tensor for name, tensor in tensors.items() if not name.startswith("lm_head.")}
        model.lm_head.weight = model.model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert config.tie_word_embeddings or not missing  # untied: the head is read from the files
    return model


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied Llama whose merge stores `lm_head.weight` with `tie_word_embeddings: true`, as mergekit writes it."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path_factory.mktemp("tied-stored"), experts=2, layers=1, samples=8, words=(4, 10),
                              dtype="float64", tie_word_embeddings=True)
    run_recipe(scenario.write_recipe(scenario.root / "first.yaml", output=str(scenario.root / "first")), progress=False)  # merges
    store_head(scenario.root / "merged")
    assert json.loads((scenario.root / "merged" / "config.json").read_text())["tie_word_embeddings"] is True
    return scenario


def test_a_tied_merge_that_stores_its_head_is_written_untied_and_served_alike(tied, tmp_path):
    output = run_recipe(tied.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), dtype="float64", head=True), progress=False)
    config = json.loads((output / "config.json").read_text())
    ours, merged = read_weights(output), read_weights(tied.root / "merged")
    assert config["tie_word_embeddings"] is False
    assert set(ours) == set(merged)  # both tensors: the embedding unchanged, the head calibrated
    assert torch.equal(ours["model.embed_tokens.weight"], merged["model.embed_tokens.weight"])
    assert not torch.equal(ours["lm_head.weight"], merged["lm_head.weight"])
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 40, 33, 8, 21, 60]])
    served = vllm_like(output)
    loaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float64).eval()
    with torch.no_grad():
        features = served.model(input_ids=ids).last_hidden_state
        expected = features @ ours["lm_head.weight"].T  # the calibrated head on the final norm's outputs
        assert torch.allclose(served(input_ids=ids).logits, expected, atol=1e-10)
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-10)
    card = (output / "README.md").read_text()
    assert "it was tied to the input embeddings and is now a tensor of its own, config `tie_word_embeddings: false`" in card


@pytest.mark.parametrize(
    ("replaced", "ties", "stored", "untie"),
    [
        (True, True, True, True),  # mergekit's tied merge with the head stored: the case vLLM served wrong
        (True, True, False, True),  # tied, no head tensor: transformers would tie it back
        (True, False, False, True),
        (True, False, True, False),  # an untied model keeps its config
        (False, True, True, False),  # the head kept: nothing to untie
        (False, True, False, False),
    ],
)
def test_which_outputs_are_untied(replaced, ties, stored, untie):
    assert head_needs_untying(replaced, ties, stored) is untie
