"""Probes of the data-free path (`generate:`) as a demanding user runs it: what is refused, what sampling runs, the
cache and the saved recipe's replay (the defects found, each pinned by a test)."""

from __future__ import annotations

import pytest
import yaml


def test_a_shared_generate_block_pins_each_experts_own_measured_start():
    """A YAML anchor shared by several `generate:` entries must not carry one expert's measured start to the others:
    the saved recipe forces each expert's own (BOS for one, the empty request for the other)."""
    from featcal_llm.io.saved_recipe import with_sampling_pinned

    text = ("featcal:\n  data:\n    a: {generate: &g {samples: 4}}\n    b: {generate: *g}\n    c: &d {generate: {samples: 2}}\n"
            "    d: *d\n")
    settings = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "min_p": 0.0, "seed": 0, "batch_size": 32}
    starts = {"a": {"mode": "bos", "chosen_by": "measurement"}, "b": {"mode": "empty", "chosen_by": "measurement"},
              "c": {"mode": "chat", "chosen_by": "measurement"}, "d": {"mode": "bos", "chosen_by": "measurement"}}
    data = yaml.safe_load(with_sampling_pinned(text, dict.fromkeys("abcd", settings), starts))["featcal"]["data"]
    assert {name: data[name]["generate"]["chat_template"] for name in "abcd"} == {"a": "off", "b": "empty", "c": "on", "d": "off"}
    assert data["a"]["generate"]["samples"] == 4 and data["d"]["generate"]["samples"] == 2
