"""What a run will need (GPU memory, host RAM, disk), estimated from the base model's config.json and the recipe.

An estimate, not a measurement: it counts the big buffers of the layer loop for a
dense decoder (Llama-style projection names) and adds a fixed allowance for the
process itself. Measured on the 8B shapes on a CPU (docs/benchmark.md) the peak
host RSS was 22 GB; this model gives about 20 GB there.

    weights window   (2 + experts) models x 2 layers (current and prefetched), stored dtype
    statistics       one task's Grams, crosses and moments (`costs.statistics_bytes`), statistics dtype
    group systems    every group's float64 system and right-hand side, + 3 copies of the largest d x d (solve)
    decoder layers   2 layers in the compute dtype on the compute device
    activations      batch_tokens x (4 hidden + 3 intermediate) in the compute dtype
    hidden streams   every calibration token x hidden x 2 (calibrated and expert stream; the token-weight pass before
                     the loop holds the same two, merged and expert), compute dtype, or the
                     coverage pass's (1 + experts) x its sample's tokens x hidden when larger (they never coexist);
                     RAM up to host_memory_gb (default half the machine), the rest spills to disk
    disk             what the run writes: the merge (when not yet written) + the output checkpoint + the staged layers
                     + spill; the base and the experts it reads ((1 + experts) full checkpoints at most, fewer bytes for
                     LoRA experts) are a separate figure, since they may already sit on this disk or in the Hub cache
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from featcal_llm.benchmark.costs import Group, LayerShape, statistics_bytes
from featcal_llm.hardware import machine_ram, stream_budget
from featcal_llm.io.names import parameter_count

GB = 1e9  # `host_memory_gb` counts these too
PROCESS_ALLOWANCE = 1.5 * GB  # Python, torch and the libraries, resident
CUDA_CONTEXT = 0.5 * GB
BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    layers: int
    gpu_bytes: float | None  # None: a CPU run
    host_bytes: float
    disk_bytes: float
    spilled_bytes: float
    device: str
    inputs_bytes: float = 0.0  # the base and the experts the run reads, as full checkpoints: not in disk_bytes
    inputs: str = ""  # what inputs_bytes counts, in words ("the base and 3 experts")
    merge_written: bool = True  # whether disk_bytes counts writing the merge
    refine: str = ""  # the `refine:` stage's line (engine/refine_memory.plan_line), when the recipe refines
    stacked: bool = False  # a stack: disk_bytes counts the first stage's output and staged layers as well

    def lines(self) -> list[str]:
        """The plan as printed by `featcal-llm validate`, labelled as an estimate."""
        gb = size_text
        lines = [f"memory plan (estimate from the configs, not a measurement): {parameter_count(self.parameters)} parameters, {self.layers} layers, {self.device}"]
        if self.gpu_bytes is not None:
            lines.append(f"  GPU memory  ~{gb(self.gpu_bytes)}")
        lines.append(f"  host RAM    ~{gb(self.host_bytes)}")
        parts = (["the merge"] if self.merge_written else []) + ["the output checkpoint", "the staged layers"]
        if self.stacked:
            parts.append("the first stage's output and staged layers, kept until the stack finishes")
        if self.spilled_bytes:
            parts.append(f"{gb(self.spilled_bytes)} of hidden states spilled beyond the RAM budget")
        read = f"; not counted: {self.inputs} it reads, ~{gb(self.inputs_bytes)} as full checkpoints" if self.inputs else ""
        lines.append(f"  disk        ~{gb(self.disk_bytes)} written by the run ({', '.join(parts)}){read}")
        return lines + ([self.refine] if self.refine else [])


def size_text(value: float) -> str:
    """Bytes as GB (MB below 1 GB)."""
    return f"{value / GB:.1f} GB" if value >= GB else f"{value / 1e6:.0f} MB"


def layer_shape_from_config(config: dict, modules: list[str] | None) -> LayerShape:
    """A dense decoder layer's projection groups from config.json (no model class needed)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    groups = [
        Group("attention", hidden, {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}),
        Group("o_proj", heads * head_dim, {"o_proj": hidden}),
        Group("mlp", hidden, {"gate_proj": inter, "up_proj": inter}),
        Group("down_proj", inter, {"down_proj": hidden}),
    ]
    linear = sum(g.input_dim * m for g in groups for m in g.outputs.values())
    if modules:
        groups = [Group(g.name, g.input_dim, {p: m for p, m in g.outputs.items() if p in modules}) for g in groups]
        groups = [g for g in groups if g.outputs]
    return LayerShape(tuple(groups), linear, heads * head_dim)


def _stored_bytes(config: dict) -> int:
    return BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), 2)


def _smallest(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, tuple):
        return min(value)
    per_layer = getattr(value, "per_layer", None)
    return min(per_layer) if per_layer else None


def head_may_untie(config: dict, featcal: Any) -> bool:
    """Whether the closed form may write a head of its own for a config that ties it (`head: auto` or true; not for
    RegMean, nor for a family vLLM serves only tied): the refinement's student then trains an untied head, which the
    plan counts, as `head: auto` learns only from the experts' tensors whether it re-fits."""
    from featcal_llm.family.architectures import ARCHITECTURES

    tied_only = any(ARCHITECTURES[name].head_tied_only for name in config.get("architectures") or [] if name in ARCHITECTURES)
    return bool(config.get("tie_word_embeddings")) and featcal.head is not None and not featcal.regmean and not tied_only


def memory_plan(config: dict, featcal: Any, experts: int, merged_exists: bool) -> MemoryPlan:
    """The estimate for calibrating a model with this config under the recipe's `featcal:` block."""
    shape = layer_shape_from_config(config, featcal.modules)
    layers, hidden, inter = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    vocab = config.get("vocab_size") or 0
    parameters = layers * shape.linear_params + vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    stored = _stored_bytes(config)
    cpu = featcal.device == "cpu"
    compute = BYTES[featcal.dtype] if featcal.dtype != "auto" else (4 if cpu else 2)
    if featcal.stats_dtype != "auto":
        stats = BYTES[featcal.stats_dtype]
    else:
        smallest = None if featcal.regmean else _smallest(featcal.lambda_)
        stats = 4 if smallest is not None and smallest >= 1e-2 else 8

    window = (2 + experts) * 2 * shape.linear_params * stored
    statistics = statistics_bytes(shape, stats)
    largest = max((g.input_dim for g in shape.groups), default=0)
    systems = statistics_bytes(shape, 8, moments=False) + 3 * largest**2 * 8
    decoder = 2 * shape.linear_params * compute
    tokens = sum(spec.records(featcal.samples) for spec in featcal.data.values()) * featcal.max_length
    activations = min(featcal.batch_tokens, tokens) * (4 * hidden + 3 * inter) * compute
    streams = tokens * hidden * 2 * compute
    if (featcal.balancing == "coverage" or featcal.teaching == "best") and experts > 1:  # before the loop: (1 + experts)
        # models on a sample of every expert's records (the coverage pass, which `teachers: best` reads too)
        from featcal_llm.maths.coverage import COVERAGE_RECORDS

        sample = sum(min(COVERAGE_RECORDS, spec.records(featcal.samples)) for spec in featcal.data.values()) * featcal.max_length
        streams = max(streams, (1 + experts) * sample * hidden * compute)
    budget = stream_budget(featcal.host_memory_gb)
    in_ram, spilled = min(streams, budget), max(0.0, streams - budget)

    work = statistics + systems + decoder + activations
    gpu = None if cpu else work + CUDA_CONTEXT
    host = window + in_ram + PROCESS_ALLOWANCE + (work if cpu else 0.0)
    model = parameters * stored
    staged = layers * shape.linear_params * stored
    disk = (0 if merged_exists else model) + model + staged + spilled
    stacked = bool(getattr(featcal, "stacked", False))
    if stacked:  # the first stage's output and staged layers stay until the second has finished (engine/stack.py)
        disk += model + staged
    device = "on the CPU" if cpu else "on one GPU (device auto: a GPU when there is one)" if featcal.device == "auto" else f"on {featcal.device}"
    inputs = f"the base and {experts} expert{'s' * (experts != 1)}"
    refine = ""
    if getattr(featcal, "refine", None) is not None:  # after the layers, on the same device: its own peak
        from featcal_llm.engine.refine_memory import ASSUMED_GPU, plan_line

        refine = plan_line(config, featcal.refine, featcal.batch_tokens, featcal.max_length, tokens, cpu, machine_ram() if cpu else ASSUMED_GPU,
                           head_may_untie=head_may_untie(config, featcal))
    return MemoryPlan(parameters, layers, gpu, host, disk, spilled, device, (1 + experts) * model, inputs, not merged_exists, refine,
                      stacked)
