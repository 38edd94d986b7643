"""`refine:`'s precision rule (bf16 autocast where the device computes it natively) and its memory model (the CPU
measured against it, the 8B promise, `validate`'s plan line)."""

from __future__ import annotations

import torch


def test_precision_auto_is_bf16_autocast_where_the_device_computes_it_natively(monkeypatch):
    """refine.precision: float32 masters always (float64 in a float64 run); bf16 autocast when asked, or under auto where
    the device has native bf16 (a CPU's AVX512-BF16 or AMX flags, a GPU's support), never float16."""
    import featcal_llm.engine.refine as refine_module

    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(refine_module, "native_bf16", lambda device, native=native: native)
        assert refine_module.refine_dtypes("auto", torch.float32, cpu) == (torch.float32, torch.bfloat16 if native else None)
        assert refine_module.refine_dtypes("bfloat16", torch.float16, cpu) == (torch.float32, torch.bfloat16)
        assert refine_module.refine_dtypes("float32", torch.bfloat16, cpu) == (torch.float32, None)
        assert refine_module.refine_dtypes("bfloat16", torch.float64, cpu) == (torch.float64, None)


def test_one_rule_says_whether_a_cpu_computes_bf16_natively(monkeypatch):
    """The layers' `dtype: auto` and refine's `precision: auto` ask the same question of a CPU, and get one answer."""
    from featcal_llm.engine import devices

    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(devices, "native_bf16_matmul", lambda native=native: native)
        assert devices.native_bf16(cpu) is native
        assert (devices.resolve_dtype("auto", cpu, torch.bfloat16) == torch.bfloat16) is native
    assert not devices.native_bf16(torch.device("meta"))


def test_memory_model_is_an_upper_bound_of_a_measured_cpu_run(tmp_path):
    """engine/refine_memory.py against the refine stage's measured peak anonymous memory (20 M parameters, params full):
    never below it, and within 2.5× (measured: 1.45×)."""
    from featcal_llm.benchmark.refine_memory import measure

    result = measure(hidden=512, layers=4, vocab=8192, params="full", steps=2, workdir=tmp_path)
    print(f"predicted {result['predicted']['peak'] / 2**20:.0f} MiB, measured {result['measured'] / 2**20:.0f} MiB")
    assert 1.0 <= result["ratio"] <= 2.5


def test_memory_model_at_8b_fits_40_gb():
    """The promise written in docs/refine.md: Llama-3.1-8B, three experts × 256 × 2048 tokens, params auto (adapter)."""
    from featcal_llm.engine.refine_memory import resolve_params
    from featcal_llm.engine.refine_memory import Shape, refine_memory

    shape = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False)
    assert round(shape.parameters() / 1e9, 2) == 8.03
    assert resolve_params("auto", shape.parameters(), 80 * 10**9) == "adapter"
    assert resolve_params("auto", 135 * 10**6, 16 * 2**30) == "full"
    memory = refine_memory(shape, "adapter", 16, 8192, 2048, 64, 3 * 256 * 2048, 2, cpu=False)
    assert memory["peak"] <= 40 * 10**9
    assert round(memory["peak"] / 2**30, 1) == 33.0


def test_validate_plans_the_refine_stage():
    """`validate`'s memory plan gains a refine line: the memory model at the recipe's shapes (8B: adapter, 35.4 GB)."""
    from featcal_llm.benchmark.estimate import memory_plan
    from featcal_llm.io.block import FeatCalConfig

    config = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    data = {f"e{i}": {"path": f"d{i}.jsonl"} for i in range(3)}
    block = {"merged": "m", "output": "o", "data": data, "device": "cuda", "max_length": 2048}
    lines = memory_plan(config, FeatCalConfig(**block, refine=True), 3, True).lines()
    assert lines[-1] == "  refine      ~35.4 GB GPU peak (params adapter, rank 16; ~5.2 GB more on the host; docs/refine.md)"
    assert not any("refine" in line for line in memory_plan(config, FeatCalConfig(**block), 3, True).lines())
