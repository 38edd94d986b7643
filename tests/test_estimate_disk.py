"""validate's disk figure says what it counts: what the run writes, and apart from it the base and experts it reads.

The plan once printed one disk figure that silently left out the base and the experts (for a 3B merge of three experts,
≈ 26 GB of checkpoints the run reads). The figures here are recomputed from the config by hand.
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


def test_a_merge_already_on_disk_is_not_counted_as_written():
    written = memory_plan(LLAMA_3B, _block(), 3, merged_exists=False)
    present = memory_plan(LLAMA_3B, _block(), 3, merged_exists=True)
    assert written.disk_bytes - present.disk_bytes == written.inputs_bytes / 4  # one checkpoint
    disk = next(line for line in present.lines() if line.startswith("  disk"))
    assert "written by the run (the output checkpoint, the staged layers)" in disk
