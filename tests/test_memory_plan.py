"""validate's memory plan, recomputed by hand from the config: the layer shapes transformers builds, the host RAM
measured at 8B shapes, the records an expert generates, and the disk figure with what it counts.

The plan once printed one disk figure that silently left out the base and the experts (for a 3B merge of three experts,
≈ 26 GB of checkpoints the run reads).
"""

from __future__ import annotations

from featcal_llm.benchmark.estimate import memory_plan, size_text
from featcal_llm.io.block import FeatCalConfig

LLAMA_3B = {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": 28, "vocab_size": 128256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def _block() -> FeatCalConfig:
    data = {f"expert{i}": {"path": f"expert{i}.jsonl"} for i in range(3)}
    return FeatCalConfig.model_validate({"merged": "merged", "output": "output", "data": data, "host_memory_gb": 1000})


def test_the_disk_line_names_what_it_counts_and_what_it_reads():
    linear = 3072 * (3072 + 1024 + 1024) + 3072 * 3072 + 2 * 3072 * 8192 + 8192 * 3072  # q, k, v, o, gate, up, down
    model = (28 * linear + 128256 * 3072) * 2  # tied embedding, bf16
    plan = memory_plan(LLAMA_3B, _block(), 3, merged_exists=False)
    assert plan.disk_bytes == model + model + 28 * linear * 2  # the merge, the output, the staged layers (no spill)
    assert plan.inputs_bytes == 4 * model
    disk = next(line for line in plan.lines() if line.startswith("  disk"))
    assert disk == (f"  disk        ~{size_text(plan.disk_bytes)} written by the run (the merge, the output checkpoint, the staged "
                    f"layers); not counted: the base and 3 experts it reads, ~{size_text(4 * model)} as full checkpoints")


def test_a_stack_counts_its_first_stages_output_and_layers_kept_until_it_finishes():
    linear = 3072 * (3072 + 1024 + 1024) + 3072 * 3072 + 2 * 3072 * 8192 + 8192 * 3072
    model = (28 * linear + 128256 * 3072) * 2
    stack = FeatCalConfig.model_validate({**_block().model_dump(by_alias=True, exclude_unset=True), "method": ["regmean", "featcal"]})
    plan = memory_plan(LLAMA_3B, stack, 3, merged_exists=True)
    assert plan.disk_bytes == 2 * (model + 28 * linear * 2)  # each stage's output and staged layers
    disk = next(line for line in plan.lines() if line.startswith("  disk"))
    assert "(the output checkpoint, the staged layers, the first stage's output and staged layers, kept until the stack finishes)" in disk


def test_a_merge_already_on_disk_is_not_counted_as_written():
    written = memory_plan(LLAMA_3B, _block(), 3, merged_exists=False)
    present = memory_plan(LLAMA_3B, _block(), 3, merged_exists=True)
    assert written.disk_bytes - present.disk_bytes == written.inputs_bytes / 4  # one checkpoint
    disk = next(line for line in present.lines() if line.startswith("  disk"))
    assert "written by the run (the output checkpoint, the staged layers)" in disk


def test_the_memory_plan_reads_the_layer_shape_that_transformers_builds():
    """The estimate's projection shapes, from config.json alone, are those of transformers' own decoder layer."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from featcal_llm.benchmark.estimate import layer_shape_from_config

    config = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_hidden_layers=2, vocab_size=50)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(LlamaConfig(**config), 0)
    linears = {name.split(".")[-1]: module for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)}
    shape = layer_shape_from_config(config, None)
    assert shape.linear_params == sum(module.weight.numel() for module in linears.values())
    for group in shape.groups:
        for projection, outputs in group.outputs.items():
            assert (linears[projection].in_features, linears[projection].out_features) == (group.input_dim, outputs), projection
    restricted = layer_shape_from_config(config, ["q_proj", "down_proj"])
    assert [(g.name, list(g.outputs)) for g in restricted.groups] == [("attention", ["q_proj"]), ("down_proj", ["down_proj"])]


def test_the_memory_plan_is_near_the_measured_cpu_peak():
    """8B shapes, 3 experts x 512 tokens on a CPU, float64 statistics: 22.0 GB peak host RSS measured (docs/benchmark.md)."""
    from featcal_llm.benchmark.estimate import GB, memory_plan
    from featcal_llm.io.block import FeatCalConfig

    config = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256, torch_dtype="bfloat16")
    featcal = FeatCalConfig.model_validate(dict(
        merged="m", output="o", data={f"e{i}": {"path": "x.jsonl"} for i in range(3)}, samples=2, max_length=256,
        device="cpu", dtype="float32", stats_dtype="float64", batch_tokens=512, host_memory_gb=12.64,
    ))
    plan = memory_plan(config, featcal, experts=3, merged_exists=True)
    assert plan.gpu_bytes is None and 8.0e9 < plan.parameters < 8.1e9
    assert 0.85 * 22.03 < plan.host_bytes / GB < 1.15 * 22.03


def test_the_memory_plan_counts_the_samples_an_expert_generates():
    """Hidden-state streams scale with every calibration record, the generated ones included (generate.samples)."""
    from featcal_llm.benchmark.estimate import memory_plan
    from featcal_llm.io.block import FeatCalConfig

    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100, "torch_dtype": "float32"}

    def plan(data):
        featcal = FeatCalConfig(merged="m", output="o", data=data, samples=64, max_length=1024, device="cpu", host_memory_gb=1000)
        return memory_plan(config, featcal, experts=2, merged_exists=True)

    files = plan({"a": {"path": "a.jsonl"}, "b": {"path": "b.jsonl"}})
    generated = plan({"a": {"path": "a.jsonl"}, "b": {"generate": {"samples": 4096}}})
    streams = lambda records: records * 1024 * 64 * 2 * 4  # noqa: E731  tokens × hidden × (cal and expert) × float32
    assert generated.host_bytes - files.host_bytes == streams(64 + 4096) - streams(64 + 64)


def test_host_memory_gb_counts_the_gigabytes_the_plan_prints():
    from featcal_llm.benchmark.estimate import GB, size_text
    from featcal_llm.hardware import machine_ram, stream_budget

    assert stream_budget(2.5) == 2_500_000_000 and size_text(stream_budget(2.5)) == size_text(2.5 * GB)
    assert stream_budget(None) == int(machine_ram() / 2)
