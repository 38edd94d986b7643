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
    import featcal_llm.streams as streams

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
