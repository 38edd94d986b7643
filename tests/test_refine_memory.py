"""`refine:`'s precision rule (bf16 autocast where the device computes it natively) and its memory model (the CPU
measured against it, the 8B promise, `validate`'s plan line)."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("params, checkpointing", [("full", "true"), ("adapter", "false")])
def test_memory_model_is_an_upper_bound_of_a_measured_cpu_run(tmp_path, params, checkpointing):
    """engine/refine_memory.py against the refine stage's measured peak anonymous memory (20 M parameters), in a process
    of its own: never below it, and within 2.5× (docs/refine.md: 1.11-1.58× over params full and adapter, with
    gradient checkpointing and without)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "featcal_llm.benchmark.refine_memory", "--params", params, "--gradient-checkpointing",
                    checkpointing, "--workdir", str(tmp_path), "--json", str(out)], check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["params"] == params and result["gradient_checkpointing"] is (checkpointing == "true")
    print(f"predicted {result['predicted']['peak'] / 2**20:.0f} MiB, measured {result['measured'] / 2**20:.0f} MiB")
    assert 1.0 <= result["ratio"] <= 2.5


def test_gradient_checkpointing_is_off_only_where_the_stage_fits_half_the_memory_without_it():
    """auto: SmolLM2-135M's shape in full on a 24 GB machine keeps its activations; Llama-3.1-8B's adapter run on an
    80 GB GPU recomputes them (its activations alone would be tens of GB); true and false are obeyed."""
    from featcal_llm.engine.refine_memory import Shape, refine_memory, resolve_checkpointing

    small = Shape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied=True)
    large = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False)
    small_without = refine_memory(small, "full", 16, 8 * 129, 129, 64, 3 * 64 * 128, 4, cpu=True, checkpointing=False)
    small_with = refine_memory(small, "full", 16, 8 * 129, 129, 64, 3 * 64 * 128, 4, cpu=True)
    large_without = refine_memory(large, "adapter", 16, 8192, 2048, 64, 3 * 256 * 2048, 2, cpu=False, checkpointing=False)
    large_with = refine_memory(large, "adapter", 16, 8192, 2048, 64, 3 * 256 * 2048, 2, cpu=False)
    assert small_with["activations"] < small_without["activations"] and small_with["logits"] <= small_without["logits"]
    assert not resolve_checkpointing("auto", small_without["peak"], 24 * 10**9)
    assert resolve_checkpointing("auto", small_without["peak"], 2 * small_without["peak"] - 2)  # just over half: on
    assert resolve_checkpointing("auto", large_without["peak"], 80 * 10**9) and large_without["peak"] > 80 * 10**9
    assert large_with["peak"] <= 40 * 10**9
    assert resolve_checkpointing(True, 1, 10**12) and not resolve_checkpointing(False, 10**12, 1)


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
    assert round(memory["peak"] / 2**30, 1) == 32.2
    tiny = Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=100, tied=True)
    above = refine_memory(tiny, "full", 16, 512, 64, 128, 1000, 4, cpu=True)  # top_k above the vocabulary keeps 100
    at_vocabulary = refine_memory(tiny, "full", 16, 512, 64, 100, 1000, 4, cpu=True)
    assert above["teachers' store (host)"] == at_vocabulary["teachers' store (host)"] == 1000 * (100 * 6 + 4)


def test_validate_plans_the_refine_stage():
    """`validate`'s memory plan gains a refine line: the memory model at the recipe's shapes (8B: adapter, 34.6 GB)."""
    from featcal_llm.benchmark.estimate import memory_plan
    from featcal_llm.io.block import FeatCalConfig

    config = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    data = {f"e{i}": {"path": f"d{i}.jsonl"} for i in range(3)}
    block = {"merged": "m", "output": "o", "data": data, "device": "cuda", "max_length": 2048}
    lines = memory_plan(config, FeatCalConfig(**block, refine=True), 3, True).lines()
    assert lines[-1] == ("  refine      ~34.6 GB GPU peak (params adapter, rank 16, gradient checkpointing on; ~5.2 GB more on the host; "
                         "docs/refine.md)")
    assert not any("refine" in line for line in memory_plan(config, FeatCalConfig(**block), 3, True).lines())


@pytest.mark.parametrize("params, autocast", [("full", False), ("full", True), ("adapter", True)])
def test_a_layers_saved_tensors_fit_the_memory_models_count(params, autocast):
    """Shape.saved_for_backward against what one real Llama decoder layer keeps for its backward pass, counted by
    PyTorch's saved-tensor hooks (distinct storages; the weights and their bf16 casts left out, the memory model counts
    them apart): never below it, and not more than twice it."""
    from transformers import LlamaConfig

    from featcal_llm.engine.refine_memory import Shape
    from featcal_llm.tiny import new_tiny_llama

    config = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    model = new_tiny_llama(config, seed=0).train()
    if params == "adapter":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                                     "gate_proj", "up_proj", "down_proj"]))
    weights = {p.numel() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        if tensor.numel() not in weights:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    layer = (model.base_model.model if params == "adapter" else model).model.layers[1]
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
    layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    rows, length = 3, 41
    ids = torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids).logits.float().sum().backward()
    shape = Shape.of(config, tied=False)
    attention_scores = rows * shape.heads * length * length * 4
    counted = rows * length * shape.saved_for_backward(2 if autocast else 4, 4) + attention_scores
    measured = sum(storages.values())
    print(f"{params}, autocast {autocast}: counted {counted} bytes, measured {measured}")
    assert counted >= measured and counted <= 2 * measured


def test_a_head_the_closed_form_untied_is_counted_by_the_refinements_choices(tmp_path, monkeypatch):
    """A tied merge whose head the closed form re-fitted (a staged lm_head.weight of its own): the student trains that
    head apart from the embedding, so `params: auto` counts its parameters and `gradient_checkpointing: auto` plans the
    untied model's peak, not the merge's tied layout."""
    from types import SimpleNamespace

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    import featcal_llm.engine.refine as refine_module
    import featcal_llm.engine.refine_student as refine_student
    from featcal_llm.engine.refine_memory import Shape, refine_memory
    from featcal_llm.io.block_sections import RefineSpec
    from featcal_llm.io.checkpoint import CheckpointReader

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    merged = tmp_path / "merged"
    merged.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(1000, 64), "model.norm.weight": torch.ones(64)}, merged / "model.safetensors")
    save_file({"lm_head.weight": torch.zeros(1000, 64)}, tmp_path / "head.safetensors")
    job = SimpleNamespace(merged=CheckpointReader(merged, "merged"), replacements={"lm_head.weight": tmp_path / "head.safetensors"},
                          head_tied_only=False, config=config, spec=RefineSpec(), batch_tokens=512, device=torch.device("cpu"),
                          compute_dtype=torch.float32)
    names = refine_student.student_names(job)
    assert "lm_head.weight" in names and refine_student.student_parameters(job, names) == 2 * 1000 * 64 + 64
    kept_tied = SimpleNamespace(**{**vars(job), "head_tied_only": True})  # Gemma-2: the head trains as the embedding
    assert "lm_head.weight" not in refine_student.student_names(kept_tied)
    records = {"a": [list(range(1, 33))] * 4}
    peaks = {tied: refine_memory(Shape.of(config, tied=tied), "full", 16, 512, 32, 64, 4 * 32, 4, cpu=True, autocast=False,
                                 checkpointing=False, step_records=8)["peak"] for tied in (True, False)}
    assert peaks[False] > peaks[True]
    monkeypatch.setattr(refine_module, "device_memory", lambda device: peaks[True] + peaks[False])  # half of it: between the two
    assert refine_module.checkpointing_for(job, "full", False, records)
    assert not refine_module.checkpointing_for(kept_tied, "full", False, records)


def test_validate_plans_a_head_the_closed_form_may_untie():
    """Llama-3.2-3B ties its head; `head: auto` (the default) may re-fit it as a tensor of its own, which then trains
    apart from the embedding: the plan counts it untied and says so. `head: false` and Gemma-2 keep it tied."""
    from featcal_llm.benchmark.estimate import memory_plan
    from featcal_llm.io.block import FeatCalConfig

    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 28, "hidden_size": 3072, "intermediate_size": 8192,
              "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
    data = {f"e{i}": {"path": f"d{i}.jsonl"} for i in range(3)}
    block = {"merged": "m", "output": "o", "data": data, "device": "cuda", "max_length": 2048, "refine": {"params": "full"}}
    peak = lambda line: float(line.split("~")[1].split(" GB")[0])  # noqa: E731
    auto = memory_plan(config, FeatCalConfig(**block), 3, True).lines()[-1]
    kept = memory_plan(config, FeatCalConfig(**block, head=False), 3, True).lines()[-1]
    gemma = memory_plan({**config, "architectures": ["Gemma2ForCausalLM"]}, FeatCalConfig(**block), 3, True).lines()[-1]
    assert "the LM head untied, as the closed form may re-fit it" in auto
    assert "untied" not in kept and "untied" not in gemma
    # the head's float32 master, gradient and AdamW moments, and its bf16 autocast copy: 128256 × 3072 × 18 B = 7.1 GB
    assert peak(auto) - peak(kept) == pytest.approx(128256 * 3072 * 18 / 1e9, abs=0.1)


def test_the_memory_models_choices_at_their_boundaries():
    """`params: auto` is full exactly while 16 bytes a parameter fit a quarter of the memory; a step of few short
    records holds only their tokens (validate's plan had counted the whole batch_tokens); a CPU's adapter run under
    autocast casts its float32 frozen weights to bf16 as well as the trained ones."""
    from featcal_llm.engine.refine_memory import Shape, refine_memory, resolve_params

    memory = 64 * 10**9
    assert resolve_params("auto", memory // 4 // 16, memory) == "full"
    assert resolve_params("auto", memory // 4 // 16 + 1, memory) == "adapter"
    assert resolve_params("full", 10**12, 1) == "full" and resolve_params("adapter", 1, 10**12) == "adapter"
    small = Shape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied=True)
    whole = refine_memory(small, "full", 16, 8192, 129, 64, 1000, 4, cpu=True, checkpointing=False)
    few = refine_memory(small, "full", 16, 8192, 129, 64, 1000, 4, cpu=True, checkpointing=False, step_records=8)
    assert few["activations"] * 8192 // (8 * 129) == pytest.approx(whole["activations"], rel=0.02)
    assert few["logits"] == 5 * 8 * 129 * small.vocab * 4 < whole["logits"]
    adapter = refine_memory(small, "adapter", 16, 1032, 129, 64, 1000, 4, cpu=True, autocast=True)
    trained = small.lora_parameters(16) + small.one_dimensional() + small.embedding()
    frozen = small.parameters() - small.embedding() - small.one_dimensional()
    assert adapter["autocast copies"] == (trained + frozen) * 2
    on_gpu = refine_memory(small, "adapter", 16, 1032, 129, 64, 1000, 2, cpu=False, autocast=True)
    assert on_gpu["autocast copies"] == trained * 2  # bf16 frozen weights need no copy
