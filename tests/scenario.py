"""Builds a tiny, fully local merging scenario for the tests: base, experts, data, recipe."""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from families import randomize_small_parameters, tiny_config
from featcal_llm.tiny import (
    build_char_tokenizer,
    new_tiny_llama,
    perturbed_copy,
    save_model,
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
    words: tuple[int, int] = (1, 12),
    dtype: str = "float32",
    **config_overrides,
) -> Scenario:
    """`family` picks the config class (families.tiny_config); every norm and bias is non-zero and differs per expert.

    `words` bounds the words per calibration text (a word is 2-7 characters); `dtype` is the
    checkpoints' and the merge's (float64 lets tests resolve updates to 1e-8).
    """
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = tiny_config(family, len(tokenizer), layers, **config_overrides)
    base_model = randomize_small_parameters(new_tiny_llama(config, seed=0), seed=1)
    base = save_model(base_model, tokenizer, root / "base", max_shard_size=shard_size, dtype=getattr(torch, dtype))
    expert_paths, data_paths = {}, {}
    for index in range(experts):
        name = f"expert{index}"
        expert_paths[name] = save_model(
            perturbed_copy(base_model, seed=100 + index, scale=noise), tokenizer, root / name, max_shard_size=shard_size, dtype=getattr(torch, dtype)
        )
        data_paths[name] = root / f"data_{name}.jsonl"
        with data_paths[name].open("w") as handle:
            for text in random_texts(seed=index, count=samples + 4, min_words=words[0], max_words=words[1]):
                handle.write(json.dumps({"text": text}) + "\n")
    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in expert_paths.values()],
        "dtype": dtype,
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
            "expert_weights": "equal",  # the maths' tests compare against the brute force at weight 1; test_coverage covers the default
            "token_weights": "equal",  # every token 1, likewise; test_token_weights covers the default
            "head": False,  # the layers only (every expert here changes its head); test_head covers the default, auto
            "trailing_experts": "keep",  # every expert teaches its records, as in the brute force; test_trailing covers the default, merge
            "teachers": "own",  # likewise (a random expert may predict another's records better); test_best_teachers covers best
            "device": "cpu",
            "batch_tokens": 256,
        },
    }
    recipe_path = root / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return Scenario(root, base, expert_paths, data_paths, recipe_path)
