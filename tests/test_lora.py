"""LoRA experts (issue 16): `base+adapter` and plain PEFT adapter directories, against peft's own merge_and_unload.

Each adapter is built with peft on the float64 test base, with seeded non-zero
A, B (and modules_to_save copies); peft's `merge_and_unload` of it, saved as a
full checkpoint, is the expert it must be equivalent to.
"""

from __future__ import annotations

import json
import shutil
import warnings

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_exactness import delta_error, read_weights
from transformers import AutoModelForCausalLM

from featcal_llm.errors import FeatCalError
from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.io.merge import ensure_merged
from featcal_llm.io.recipe import load_recipe
from featcal_llm.pipeline import run_recipe
from featcal_llm.io.run_record import read_run_record

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name → LoraConfig settings and how the expert is written in the recipe
ADAPTERS = {
    "plain": ({"r": 4, "lora_alpha": 16, "target_modules": PROJECTIONS}, "plus"),
    # rslora α/√r, per-module rank and alpha, fan_in_fan_out (peft ignores it on nn.Linear), LoRA on the embedding,
    # and a trained lm_head copy (modules_to_save); written as a plain adapter directory
    "rslora": (
        {"r": 6, "lora_alpha": 12, "use_rslora": True, "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"q_proj": 3},
         "fan_in_fan_out": True, "target_modules": PROJECTIONS + ["embed_tokens"], "modules_to_save": ["lm_head"]},
        "directory",
    ),
}


def _build_adapter(scenario, name: str, settings: dict):
    """Adapter directory and peft's merge_and_unload of it saved as a full float64 checkpoint."""
    from peft import LoraConfig, get_peft_model

    root = scenario.root
    model = AutoModelForCausalLM.from_pretrained(scenario.base, dtype=torch.float64)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **settings))
    generator = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for parameter_name, parameter in peft_model.named_parameters():
            if not parameter.requires_grad:
                continue
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            if "lora_" in parameter_name:
                parameter.copy_(0.1 * noise)
            else:  # a modules_to_save copy: a fine-tuned version of the base module
                parameter.add_(0.05 * noise * parameter.abs().mean())
    adapter = root / f"adapter_{name}"
    peft_model.save_pretrained(adapter)
    if settings.get("fan_in_fan_out"):  # peft saves False after overriding it for nn.Linear; keep the user's True in the file
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    merged = peft_model.merge_and_unload()
    full = root / f"peft_merged_{name}"
    merged.save_pretrained(full)
    for item in scenario.base.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(item, full / item.name)
    return adapter, full


@pytest.fixture(scope="module")
def lora_scenario(tmp_path_factory):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path_factory.mktemp("lora"), experts=2, layers=2, samples=12, words=(4, 10), dtype="float64")
    scenario.adapters = {name: _build_adapter(scenario, name, settings) for name, (settings, _) in ADAPTERS.items()}
    return scenario


def _recipe(scenario, tmp_path, second_expert: str, merged, output: str, **overrides):
    """The scenario's recipe with expert1 replaced by `second_expert` (data keyed by it) and a given merged model."""
    recipe = yaml.safe_load(scenario.recipe.read_text())
    first, second = (str(p) for p in scenario.experts.values())
    recipe["models"][1]["model"] = second_expert
    data = recipe["featcal"]["data"]
    data[second_expert] = data.pop(second)
    recipe["featcal"].update(merged=str(merged), output=str(tmp_path / output), dtype="float64", batch_tokens=150, **overrides)
    path = tmp_path / f"{output}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _written(scenario, name: str) -> str:
    adapter, _ = scenario.adapters[name]
    return f"{scenario.base}+{adapter}" if ADAPTERS[name][1] == "plus" else str(adapter)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_reader_equals_peft_merge_and_unload(lora_scenario, name):
    """Every tensor the reader builds equals peft's merged checkpoint (embedding, lm_head copy and rslora scales included)."""
    from featcal_llm.io.lora import LoraReader

    adapter, full = lora_scenario.adapters[name]
    reader = LoraReader(CheckpointReader(lora_scenario.base, "base"), adapter, "expert")
    expected = read_weights(full)
    assert set(reader.names()) == set(expected)
    worst = 0.0
    for tensor_name, value in expected.items():
        ours = reader.get(tensor_name)
        assert ours.dtype == value.dtype
        worst = max(worst, float((ours - value).abs().max() / value.abs().max()))
    print(f"{name}: worst relative difference to merge_and_unload {worst:.1e}")
    assert worst <= 1e-12
    changed = {n for n in expected if not torch.equal(expected[n], reader.base.get(n))}
    assert any("down_proj" in n for n in changed)
    if name == "rslora":
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= changed


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_expert_calibrates_like_its_merged_checkpoint(lora_scenario, tmp_path, name):
    """The headline: a LoRA expert gives the calibrated weights of the same expert merged by peft (float64, ΔW ≤ 1e-8)."""
    adapter, full = lora_scenario.adapters[name]
    merged = lora_scenario.root / f"merged_{name}"
    ensure_merged(load_recipe(_recipe(lora_scenario, tmp_path, str(full), merged, "for_merge")), merged, "cpu")
    as_full = run_recipe(_recipe(lora_scenario, tmp_path, str(full), merged, "full"), progress=False)
    as_lora = run_recipe(_recipe(lora_scenario, tmp_path, _written(lora_scenario, name), merged, "lora"), progress=False)
    ours, reference, merged_weights = read_weights(as_lora), read_weights(as_full), read_weights(merged)
    changed = [n for n in reference if not torch.equal(reference[n], merged_weights[n])]
    assert len(changed) >= 14
    errors = {n: delta_error(ours[n], reference[n], merged_weights[n]) for n in changed}
    worst = max(errors, key=errors.get)
    print(f"{name}: worst ΔW relative error {errors[worst]:.2e} at {worst}")
    assert errors[worst] <= 1e-8
    drift = [json.loads((d / "featcal_drift.json").read_text())["output_divergence"] for d in (as_lora, as_full)]
    values = [[v for model in ("merged", "calibrated") for v in d[model].values()] for d in drift]  # expert order
    assert values[0] == pytest.approx(values[1], rel=1e-8)  # the LM head (lm_head copy for rslora) is the expert's
    (expert,) = [model for model in read_run_record(as_lora)["models"].values() if "lora_adapter" in model]
    assert not Path(expert["lora_adapter"]).is_absolute() and str(adapter).endswith("/" + expert["lora_adapter"])  # a short name


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_expert_merged_by_mergekit(lora_scenario, tmp_path, name):
    """Without a merged model, mergekit merges the LoRA expert itself (a plain directory spelled `base+adapter` for it;
    scratch LoRA cache removed) into the merge of the peft-merged checkpoint, and the run completes."""
    merged = tmp_path / "merged"
    output = run_recipe(_recipe(lora_scenario, tmp_path, _written(lora_scenario, name), merged, "out"), progress=False)
    assert (output / "model.safetensors.index.json").is_file() or (output / "model.safetensors").is_file()
    assert not (tmp_path / ".merged.lora-cache").exists()
    reference = tmp_path / "reference"
    ensure_merged(load_recipe(_recipe(lora_scenario, tmp_path, str(lora_scenario.adapters[name][1]), reference, "ref")), reference, "cpu")
    ours, theirs = read_weights(merged), read_weights(reference)
    assert max(float((ours[n] - theirs[n]).abs().max()) for n in theirs) <= 1e-6


def _edited_adapter(lora_scenario, tmp_path, **config_changes):
    adapter = tmp_path / "edited"
    shutil.copytree(lora_scenario.adapters["plain"][0], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(config_changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


REFUSALS = {
    "dora": ({"use_dora": True}, "use_dora: DoRA"),
    "ia3": ({"peft_type": "IA3"}, "peft_type IA3 adapters are not supported"),
    "pissa": ({"init_lora_weights": "pissa"}, "init_lora_weights: 'pissa' rewrites the base weights"),
    "trainable_tokens": ({"trainable_token_indices": [5, 6]}, "trainable_token_indices: trainable token indices"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    "rank not a number": ({"r": "four"}, "adapter_config.json: r: expected a positive number, got 'four'"),  # had been a TypeError
    "alpha zero": ({"lora_alpha": 0}, "adapter_config.json: lora_alpha: expected a positive number, got 0"),
    "rank pattern of text": ({"rank_pattern": {"q_proj": "x"}}, "adapter_config.json: rank_pattern: expected a mapping"),
}


def _refused_alike(recipe, tmp_path, expected: str) -> None:
    """run refuses in one line before any work, and validate says that line first."""
    from click.testing import CliRunner

    from featcal_llm.cli import main

    result = CliRunner().invoke(main, ["run", str(recipe)])
    error = [line for line in result.stderr.strip().splitlines() if not line.startswith("featcal-llm: warning")]
    assert result.exit_code == 2, (result.exit_code, error, result.exception)
    assert len(error) == 1 and error[0].startswith("featcal-llm: error: ") and expected in error[0], error
    assert not (tmp_path / "merged").exists() and not (tmp_path / "out").exists()
    validated = CliRunner().invoke(main, ["validate", str(recipe)])  # said before any work, in the same words
    assert validated.exit_code == 2 and error[0] in validated.stderr.splitlines(), validated.output


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_adapters_are_refused_by_name(lora_scenario, tmp_path, case):
    changes, expected = REFUSALS[case]
    adapter = _edited_adapter(lora_scenario, tmp_path, **changes)
    recipe = _recipe(lora_scenario, tmp_path, f"{lora_scenario.base}+{adapter}", tmp_path / "merged", "out")
    _refused_alike(recipe, tmp_path, expected)


def _wider_down_proj(weights: dict) -> str:
    key = next(k for k in weights if k.endswith("mlp.down_proj.lora_A.weight"))
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] + 8, dtype=torch.float64)  # intermediate 136
    return r"down_proj.weight has shape [64, 136], the base model's has [64, 128] (adapter trained on another base?)"


def _stray_tensor(weights: dict) -> str:
    weights["base_model.model.model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4, dtype=torch.float64)
    return "tensor base_model.model.model.layers.0.mlp.extra_proj.weight has no counterpart model.layers.0.mlp.extra_proj.weight in the base model"


def _one_matrix(weights: dict) -> str:
    del weights[next(k for k in weights if k.endswith("layers.1.self_attn.v_proj.lora_B.weight"))]
    return "layers.1.self_attn.v_proj has only one of the LoRA matrices A and B"


def _no_weights(weights: dict) -> str:
    weights.clear()
    return "adapter_model.safetensors is missing"


@pytest.mark.parametrize("edit", [_wider_down_proj, _stray_tensor, _one_matrix, _no_weights])
def test_adapter_weights_that_do_not_fit_the_base_are_refused(lora_scenario, tmp_path, edit):
    """What the adapter's tensors say of the base it was trained on (read from the headers): run and validate alike."""
    adapter = _edited_adapter(lora_scenario, tmp_path)
    weights = load_file(adapter / "adapter_model.safetensors")
    expected = edit(weights)
    (adapter / "adapter_model.safetensors").unlink()
    if weights:
        save_file(weights, adapter / "adapter_model.safetensors")
    recipe = _recipe(lora_scenario, tmp_path, f"{lora_scenario.base}+{adapter}", tmp_path / "merged", "out")
    _refused_alike(recipe, tmp_path, expected)


def test_plus_reference_to_a_non_adapter_is_refused(lora_scenario, tmp_path):
    expert = next(iter(lora_scenario.experts.values()))
    recipe = _recipe(lora_scenario, tmp_path, f"{lora_scenario.base}+{expert}", tmp_path / "merged", "out")
    with pytest.raises(FeatCalError, match="not a PEFT adapter"):
        run_recipe(recipe, progress=False)


def test_trained_biases_and_lora_bias_equal_peft(tmp_path):
    """Qwen2 (q/k/v biases): `bias: all` saves every trained bias, `lora_bias` adds scale·b_B; both as peft merges them."""
    from scenario import build_scenario

    from featcal_llm.io.lora import LoraReader

    scenario = build_scenario(tmp_path / "qwen2", experts=1, layers=2, samples=2, family="qwen2", dtype="float64")
    scenario.adapters = {}
    adapter, full = _build_adapter(scenario, "bias", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj"], "bias": "all", "lora_bias": True})
    reader = LoraReader(CheckpointReader(scenario.base, "base"), adapter, "expert")
    assert any(key.endswith(".bias") for key in reader.replacements) and any(key.endswith(".bias") for key in reader.deltas)
    expected = read_weights(full)
    worst = max(float((reader.get(n) - v).abs().max() / v.abs().max()) for n, v in expected.items())
    assert worst <= 1e-12, worst
    assert not torch.equal(reader.get("model.layers.0.self_attn.q_proj.bias"), reader.base.get("model.layers.0.self_attn.q_proj.bias"))
    llama = build_scenario(tmp_path / "llama", experts=0, layers=1, samples=1, dtype="float64")  # no biases: refused
    with pytest.raises(FeatCalError, match=r"(has no counterpart model.layers.0.self_attn.[qkv]_proj.bias|has no bias) in the base model"):
        LoraReader(CheckpointReader(llama.base, "base"), adapter, "expert")


def test_lora_base_model_calibrates_like_its_merged_checkpoint(lora_scenario, tmp_path):
    """base_model: base+adapter is read the same way (the anchor's W_base is the adapted base)."""
    adapter, full = lora_scenario.adapters["plain"]
    recipes = {}
    for name, base in (("full", str(full)), ("lora", f"{lora_scenario.base}+{adapter}")):
        recipe = yaml.safe_load(_recipe(lora_scenario, tmp_path, str(lora_scenario.experts["expert1"]), tmp_path / "merged", name).read_text())
        recipe["base_model"] = base
        recipes[name] = tmp_path / f"{name}-base.yaml"
        recipes[name].write_text(yaml.safe_dump(recipe, sort_keys=False))
    ensure_merged(load_recipe(recipes["full"]), tmp_path / "merged", "cpu")
    outputs = {name: read_weights(run_recipe(path, progress=False)) for name, path in recipes.items()}
    merged = read_weights(tmp_path / "merged")
    changed = [n for n in merged if not torch.equal(outputs["full"][n], merged[n])]
    assert len(changed) >= 14
    assert max(delta_error(outputs["lora"][n], outputs["full"][n], merged[n]) for n in changed) <= 1e-8


def test_plain_adapter_naming_another_base_warns(lora_scenario, tmp_path, capsys):
    from featcal_llm.io.recipe import load_recipe as load
    from featcal_llm.io.references import resolve_source

    adapter = _edited_adapter(lora_scenario, tmp_path, base_model_name_or_path="org/some-other-model")
    recipe = load(_recipe(lora_scenario, tmp_path, str(adapter), tmp_path / "merged", "out"))
    base = resolve_source(recipe.base, "base_model")
    source = resolve_source(recipe.experts[1].reference, "models: adapter", base)
    assert source.directory == lora_scenario.base and source.adapter == adapter
    assert "names org/some-other-model as its base; it is applied to the recipe's base_model" in capsys.readouterr().err


def test_lora_expert_generates_like_its_merged_checkpoint(lora_scenario):
    """`generate:` on base+adapter samples exactly what the peft-merged checkpoint samples for a seed (and not what the base does)."""
    from featcal_llm.generation.backends import TransformersSampler
    from featcal_llm.io.references import ModelSource
    from featcal_llm.tiny import build_char_tokenizer

    name = next(n for n, (_, form) in ADAPTERS.items() if form == "plus")
    adapter, full = lora_scenario.adapters[name]
    tokenizer = build_char_tokenizer()
    settings = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "max_new_tokens": 12}
    prompts = [(1,), (1, 40, 41, 42)]

    def sample(source):
        sampler = TransformersSampler(source, tokenizer, torch.device("cpu"), torch.float64, False)
        try:
            return sampler.sample(prompts, settings, seed=5)
        finally:
            sampler.close()

    with warnings.catch_warnings(record=True) as caught:  # peft's read of a deprecated transformers property: not ours to say
        warnings.simplefilter("always")
        lora = sample(ModelSource("base+adapter", lora_scenario.base, adapter))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
    assert lora == sample(ModelSource("peft-merged", full))
    assert lora != sample(ModelSource("base", lora_scenario.base))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_lora_equals_peft_bit_for_bit(lora_scenario, tmp_path, dtype):
    """In bf16 and fp16, every merged tensor equals peft's merge_and_unload bit for bit, per module type.

    peft merges a linear layer's float32 update and rounds once, but rounds an embedding's update to the
    base dtype first and adds in that dtype; one float32 sum rounded once differs in about a quarter of a
    bf16 embedding's entries.
    """
    from peft import LoraConfig, get_peft_model

    from featcal_llm.io.lora import LoraReader

    base_dir = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(lora_scenario.base, dtype=dtype).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj", "embed_tokens"]}
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **settings))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter_name, parameter in peft_model.named_parameters():
            if "lora_" in parameter_name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    expected = {k: v for k, v in peft_model.merge_and_unload().state_dict().items()}
    reader = LoraReader(CheckpointReader(base_dir, "base"), adapter, "expert")
    for module in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        ours, theirs = reader.get(module), expected[module]
        assert ours.dtype == theirs.dtype == dtype
        assert not torch.equal(theirs, reader.base.get(module))  # the adapter changed it
        assert torch.equal(ours, theirs), f"{module}: {(ours != theirs).float().mean():.1%} of the entries differ from peft's"


def test_an_adapter_that_trains_the_head_of_a_tied_base_is_refused_saying_the_head_is_tied(tmp_path):
    """Gemma-2 (or any base whose config ties the LM head) stores no lm_head.weight: an adapter with `modules_to_save:
    [lm_head]` unties it, which featcal-llm does not read. The one-line refusal says why, not only that the base lacks a
    tensor every user knows the model has."""
    from scenario import build_scenario

    from featcal_llm.io.lora import LoraReader

    scenario = build_scenario(tmp_path / "gemma2", experts=0, layers=1, samples=1, family="gemma2", dtype="float64")
    adapter, _ = _build_adapter(scenario, "head", {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})
    with pytest.raises(FeatCalError) as error:
        LoraReader(CheckpointReader(scenario.base, "base"), adapter, "expert")
    message = str(error.value)
    assert "\n" not in message and str(adapter / "adapter_model.safetensors") in message
    assert (f"tensor base_model.model.lm_head.weight: the base model {scenario.base} ties its LM head to its input "
            "embeddings (tie_word_embeddings) and stores no lm_head.weight; an adapter that trains lm_head unties it, "
            "which featcal-llm does not read (train embed_tokens, which the tie shares, instead)") in message
