"""`merge_options:`: mergekit's options for the merge a run makes; random merges re-merge to the same weights (issue 45)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from test_exactness import read_weights

from featcal_llm.errors import FeatCalError
from featcal_llm.io.merge import ensure_merged
from featcal_llm.io.merge_identity import MARKER
from featcal_llm.io.recipe import load_recipe


def _dare(scenario, path, merged, **options):
    raw = yaml.safe_load(scenario.recipe.read_text())
    raw["merge_method"] = "dare_ties"
    for model in raw["models"]:
        model["parameters"] = {"weight": 0.5, "density": 0.5}
    raw["featcal"]["merged"] = str(merged)
    if options:
        raw["featcal"]["merge_options"] = options
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_recipe(path)


def test_a_random_merge_is_merged_again_to_the_same_weights_and_another_seed_merges_again(scenario, tmp_path):
    first = read_weights(ensure_merged(_dare(scenario, tmp_path / "a.yaml", tmp_path / "a"), tmp_path / "a", "cpu"))
    second = read_weights(ensure_merged(_dare(scenario, tmp_path / "b.yaml", tmp_path / "b"), tmp_path / "b", "cpu"))
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    assert json.loads((tmp_path / "a" / MARKER).read_text())["random_seed"] == 0  # the block's seed, by default
    seeded = _dare(scenario, tmp_path / "c.yaml", tmp_path / "a", random_seed=7, out_shard_size="20K")
    ensure_merged(seeded, tmp_path / "a", "cpu")  # featcal-llm's own merge, drawn with seed 0: merged again
    other = read_weights(tmp_path / "a")
    assert json.loads((tmp_path / "a" / MARKER).read_text())["random_seed"] == 7
    assert any(not torch.equal(first[n], other[n]) for n in first)
    assert len(list((tmp_path / "a").glob("*.safetensors"))) > len(list((tmp_path / "b").glob("*.safetensors")))


@pytest.mark.parametrize("options, message", [
    ({"out_shard_size": "lots"}, r"featcal\.merge_options\.out_shard_size: .*expected a positive parameter count such as 5B"),
    ({"out_shard_size": 0}, r"featcal\.merge_options\.out_shard_size: .*expected a positive parameter count such as 5B.*got 0"),
    ({"out_shard_size": -5}, r"featcal\.merge_options\.out_shard_size: .*expected a positive parameter count such as 5B.*got -5"),
    ({"out_shard_size": "0M"}, r"featcal\.merge_options\.out_shard_size: .*expected a positive parameter count such as 5B.*got '0M'"),
    ({"random_seed": "x"}, r"featcal\.merge_options\.random_seed"),
    ({"seed": 3}, r"featcal\.merge_options\.seed"),
])
def test_bad_merge_options_are_one_line(scenario, tmp_path, options, message):
    with pytest.raises(FeatCalError, match=message) as error:
        _dare(scenario, tmp_path / "r.yaml", tmp_path / "m", **options)
    assert "\n" not in str(error.value).strip()


def test_a_shard_size_is_counted_as_mergekit_counts_it():
    """featcal-llm reads `out_shard_size` itself (to refuse a bad one before the merge): the count it gives mergekit is
    the count mergekit's own parser makes of what the recipe wrote, in each unit and case."""
    from mergekit.common import parse_kmb

    from featcal_llm.io.names import parse_parameter_count

    for value in ("20K", "20k", "500M", "5B", "5b", "1000000", 7, 300):
        assert parse_parameter_count(value) == parse_kmb(value), value
    assert parse_parameter_count(" 2m ") == 2 * 10**6 and parse_parameter_count("1.5B") == 1_500_000_000
