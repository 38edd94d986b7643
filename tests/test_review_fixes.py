"""Issue 10's latent bugs 4-8, each with a test that failed before its fix."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.pipeline import run_recipe


def test_pinned_streams_count_power_of_two_blocks_and_the_allocator_cache(tmp_path, monkeypatch):
    """Bug 7: CUDA's pinned allocator holds power-of-two blocks and keeps freed ones; the budget counts that."""
    import featcal_llm.engine.streams as streams

    real_empty = torch.empty
    monkeypatch.setattr(streams.torch, "empty", lambda *args, pin_memory=False, **kwargs: real_empty(*args, **kwargs))  # no CUDA here
    store = streams.HostStore(budget_bytes=3000, spill_dir=tmp_path / "spill", pin=True)
    small = store.allocate((10, 10), torch.float32)  # 400 bytes → a 512-byte block
    large = store.allocate((20, 20), torch.float32)  # 1600 → 2048
    assert store.in_ram == 512 + 2048 and store.spilled == 0
    third = store.allocate((10, 10), torch.float32)  # 2560 + 512 > 3000: spilled (exact sizes, 2400, would not be)
    assert store.spilled == 400 and store.in_ram == 2560
    del small, third
    gc.collect()
    assert store.in_ram == 2560  # the freed block stays with the allocator
    again = store.allocate((8, 16), torch.float32)  # 512 bytes: reuses the cached block, in RAM
    assert store.in_ram == 2560 and store.spilled == 400 and again.shape == (8, 16)
    del large, again


def _run_cli(recipe_path):
    from click.testing import CliRunner

    from featcal_llm.cli import main

    result = CliRunner().invoke(main, ["run", str(recipe_path)])
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("featcal-llm: error: ")]
    return result.exit_code, errors, lines


def _copy(path, tmp_path, name):
    import shutil

    target = tmp_path / name
    shutil.copytree(path, target)
    return target


def _with_expert(scenario, tmp_path, expert):
    """The scenario's recipe with its last expert replaced by the model at `expert`."""
    recipe = yaml.safe_load(scenario.recipe.read_text())
    old = recipe["models"][-1]["model"]
    recipe["models"][-1]["model"] = str(expert)
    recipe["featcal"]["data"][str(expert)] = recipe["featcal"]["data"].pop(old)
    recipe["featcal"]["output"] = str(tmp_path / "out")
    return recipe


def _patch_json(path, **values):
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def _swap_tokens(directory, first, second):
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "patch, expected",
    [
        (lambda d: _patch_json(d / "config.json", rms_norm_eps=1e-6), "config rms_norm_eps = 1e-06 differs from the base model's 1e-05"),
        (lambda d: _patch_json(d / "config.json", sliding_window=4), "config sliding_window = 4 differs"),
        (lambda d: _patch_json(d / "config.json", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "config rope_parameters"),
        (lambda d: _swap_tokens(d, "a", "b"), "the calibration tokenizer to 1"),
        (lambda d: _patch_json(d / "tokenizer_config.json", eos_token="<unk>"), "tokenizer eos_token_id = 3 differs from the calibration tokenizer's 2"),
    ],
    ids=["norm epsilon", "sliding window", "rope", "vocabulary", "special ids"],
)
def test_an_expert_that_cannot_share_the_merged_config_or_tokenizer_is_one_line(merged_scenario, tmp_path, patch, expected):
    """Bug 5: experts run with the merged model's config and the calibration tokenizer's ids."""
    expert = _copy(next(iter(merged_scenario.experts.values())), tmp_path, "odd-expert")
    patch(expert)
    recipe = _with_expert(merged_scenario, tmp_path, expert)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, errors, lines = _run_cli(path)
    assert code == 2 and len(errors) == 1, lines
    assert "odd-expert" in errors[0] and expected in errors[0], errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.featcal-partial").exists()


def test_a_pad_id_beyond_the_embedding_is_no_error(merged_scenario, tmp_path):
    """Bug 4: padding is masked and never looked up, so its id needs no embedding row."""
    tokenizer_dir = _copy(merged_scenario.root / "merged", tmp_path, "tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"pad_token": "<extra-pad>"})
    assert tokenizer.pad_token_id >= json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    tokenizer.save_pretrained(tokenizer_dir)
    recipe = merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), tokenizer=str(tokenizer_dir), samples=4)
    assert run_recipe(recipe, progress=False).is_dir()


def test_a_merged_embedding_without_a_row_for_a_token_is_one_line(merged_scenario, tmp_path):
    """Bug 4: the merged embedding is checked like the experts' (it used to be a raw IndexError)."""
    from safetensors.torch import load_file, save_file

    merged = _copy(merged_scenario.root / "merged", tmp_path, "merged-copy")
    name = "model.embed_tokens.weight"
    index = merged / "model.safetensors.index.json"
    shard = merged / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")
    tensors = load_file(shard)
    tensors[name] = tensors[name][:20].clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    path = merged_scenario.write_recipe(tmp_path / "bad.yaml", merged=str(merged), output=str(tmp_path / "out"))
    code, errors, lines = _run_cli(path)
    assert code == 2 and len(errors) == 1, lines
    assert "merged model" in errors[0] and "embedding of 20 rows cannot embed calibration token id" in errors[0]
    assert not (tmp_path / ".out.featcal-partial").exists()


def test_chat_format_passes_a_fixed_date():
    """Bug 6: Llama-3.x templates print today's date unless given one; the tokens must not change at midnight."""
    from featcal_llm.io.data import CHAT_DATE, record_to_text
    from featcal_llm.io.block_sections import DataSpec
    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y %H:%M:%S.%f') %}{% endif %}"
        "Today Date: {{ date_string }}\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    spec = DataSpec(path="x.jsonl", format="chat")
    texts = {record_to_text({"prompt": "1+1", "response": "2"}, spec, tokenizer, "data", 0) for _ in range(3)}
    assert texts == {f"Today Date: {CHAT_DATE}\nuser: 1+1\nassistant: 2\n"}


def test_nan_in_the_calibrated_stream_is_caught_in_the_layer_that_makes_it(merged_scenario, tmp_path, monkeypatch, capsys):
    """Bug 8: NaN in the cal stream is named where it appears, not a layer later after six futile ridge retries."""
    from featcal_llm.engine.objectives import FeatCal

    real = FeatCal.solve_layer

    def overflowing(self, plan, layer, *args, **kwargs):
        solved = real(self, plan, layer, *args, **kwargs)
        if layer == 0:
            solved["mlp.down_proj.weight"] = torch.full_like(solved["mlp.down_proj.weight"], float("nan"))
        return solved

    monkeypatch.setattr(FeatCal, "solve_layer", overflowing)
    with pytest.raises(FeatCalError, match="^layer 0: calibrated layer produced NaN/Inf hidden states"):
        run_recipe(merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out")), progress=False)
    assert "retrying" not in capsys.readouterr().err
