"""Builds a tiny, fully local merging scenario for the tests: base, experts, data, recipe."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from featcal_llm.tiny import (
    build_char_tokenizer,
    new_tiny_llama,
    perturbed_copy,
    save_model,
    tiny_llama_config,
)

WORDS = "the merge of experts loses skill calibration restores features layer by layer with ridge regression".split()


@dataclass
class Scenario:
    root: Path
    base: Path
    experts: dict[str, Path]
    data: dict[str, Path]
    recipe: Path
    featcal: dict = field(default_factory=dict)

    def write_recipe(self, path: Path | None = None, **featcal_overrides) -> Path:
        recipe = yaml.safe_load(self.recipe.read_text())
        recipe["featcal"].update(featcal_overrides)
        target = path or self.recipe
        target.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return target


def random_texts(seed: int, count: int, min_words: int = 1, max_words: int = 12) -> list[str]:
    """Words and random character runs, so that every character occurs and layer-0 features span the space."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation

    def word() -> str:
        return rng.choice(WORDS) if rng.random() < 0.5 else "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7)))

    return [" ".join(word() for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


def build_scenario(
    root: Path,
    experts: int = 3,
    layers: int = 3,
    samples: int = 16,
    noise: float = 0.2,
    shard_size: str | int = "40KB",
    family: str = "llama",
    **config_overrides,
) -> Scenario:
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    if family == "qwen2":
        from transformers import Qwen2Config

        settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0)
        settings.update(config_overrides)
        config = Qwen2Config(**settings)
        config.architectures = ["Qwen2ForCausalLM"]
    else:
        config = tiny_llama_config(len(tokenizer), num_hidden_layers=layers, **config_overrides)
    base_model = new_tiny_llama(config, seed=0)
    base = save_model(base_model, tokenizer, root / "base", max_shard_size=shard_size)
    expert_paths, data_paths = {}, {}
    for index in range(experts):
        name = f"expert{index}"
        expert_paths[name] = save_model(perturbed_copy(base_model, seed=100 + index, scale=noise), tokenizer, root / name, max_shard_size=shard_size)
        data_paths[name] = root / f"data_{name}.jsonl"
        with data_paths[name].open("w") as handle:
            for text in random_texts(seed=index, count=samples + 4):
                handle.write(json.dumps({"text": text}) + "\n")
    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in expert_paths.values()],
        "dtype": "float32",
        "featcal": {
            "merged": str(root / "merged"),
            "output": str(root / "featcal"),
            "data": {str(expert_paths[n]): {"path": str(data_paths[n]), "format": "text", "text": "text"} for n in expert_paths},
            "samples": samples,
            "max_length": 64,
            "lambda": 1.0e-3,
            "alpha": 0.3,
            "rho": 0.5,
            "eps": 1.0e-8,
            "device": "cpu",
            "batch_tokens": 256,
        },
    }
    recipe_path = root / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return Scenario(root, base, expert_paths, data_paths, recipe_path)
