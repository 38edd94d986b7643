"""The refine stage's memory model: what it holds at its peak, by part, from the model's shape and the stage's settings.

docs/refine.md writes it out for Llama-3.1-8B; `featcal_llm.benchmark.refine_memory` checks it against a measured CPU
run at small shapes. Every part is an upper estimate of what PyTorch allocates for it:

- frozen weights: the parameters that do not train, in the compute dtype under autocast, else in the master dtype
  (float32, or float64 for a float64 run);
- trained weights: 16 bytes a trained parameter (float32 master, gradient, AdamW's two moments);
- autocast copies: under bf16 autocast, 2 bytes a trained parameter (its bf16 cast, cached through the forward), and
  2 bytes a frozen one not already bf16 (`params: adapter` on a CPU, whose frozen weights are float32);
- saved states: the best state and the copy saved at each check, float32 (host memory; the device's own on a CPU);
- activations: with gradient checkpointing, each decoder layer's input for a micro-batch (`batch_tokens` padded tokens)
  kept in the residual stream's dtype, plus one layer recomputed in the backward (what it saves for its backward,
  `Shape.saved_for_backward`, in the activation dtype: bf16 under autocast, else the compute dtype) with its gradients,
  and the attention scores of one layer in float32 (the math kernel's worst case); without it, what every layer saves
  and its attention scores, and one layer's gradients;
- logits: one chunk of the judged tokens' logits in float32 and four buffers of its size (log-softmax, the masked copy
  for the rest's mass, their gradients); without checkpointing, every chunk of the micro-batch's judged tokens;
- teacher: during the teachers' pass (before the student exists), one whole teacher in the student's precision (the
  compute dtype under autocast, else the master dtype) with one micro-batch's activations;
- teachers' store: the top-k log-probs (float16), ids (int32) and rest (float32) of every judged token, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL_STATE_BYTES = 16  # a trained parameter: float32 master, gradient, AdamW's two moments
ASSUMED_GPU = 80 * 10**9  # the GPU `validate` plans for when it cannot see one (the product's promise: one 80 GB GPU)


def resolve_params(requested: str, parameters: int, memory: int) -> str:
    """`auto`: full when every parameter's AdamW training state fits a quarter of the device's memory, else adapter."""
    if requested != "auto":
        return requested
    return "full" if FULL_STATE_BYTES * parameters <= memory // 4 else "adapter"


@dataclass(frozen=True)
class Shape:
    """What the model's memory depends on (from its config)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: Any, tied: bool) -> "Shape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, config.vocab_size, tied)

    def layer_parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def embedding(self) -> int:
        return self.vocab * self.hidden

    def parameters(self) -> int:
        return self.layers * self.layer_parameters() + self.embedding() * (1 if self.tied else 2) + self.hidden

    def lora_parameters(self, rank: int) -> int:
        """A rank-r LoRA on q, k, v, o, gate, up and down of every layer: r · (fan_in + fan_out) each."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        pairs = [(self.hidden, q_out), (self.hidden, kv_out), (self.hidden, kv_out), (q_out, self.hidden),
                 (self.hidden, self.intermediate), (self.hidden, self.intermediate), (self.intermediate, self.hidden)]
        return self.layers * rank * sum(a + b for a, b in pairs)

    def saved_for_backward(self, activation_bytes: int, residual_bytes: int) -> int:
        """Bytes a token that one decoder layer keeps for its backward pass: each RMSNorm's input and output (the residual
        stream's dtype), each projection's input (cast apart for each under autocast; under a LoRA, its A keeps it and
        the frozen projection does not), q and k before and after the rotary embedding, v and the attention's output, and
        the MLP's gate, up and activation outputs (tests/test_refine_memory.py counts a real layer's)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        norms = 2 * 2 * self.hidden * residual_bytes
        inputs = (5 * self.hidden + q_out + self.intermediate) * activation_bytes
        attention = (3 * q_out + 3 * kv_out) * activation_bytes
        return norms + inputs + attention + 3 * self.intermediate * activation_bytes

    def one_dimensional(self) -> int:
        return (2 * self.layers + 1) * self.hidden


def resolve_checkpointing(requested: str | bool, peak_without: int, memory: int) -> bool:
    """`gradient_checkpointing: auto`: off when the stage's peak without it (refine_memory(..., checkpointing=False))
    fits half the device's memory, else on. Recomputing every layer in the backward costs 5-20 % of a step:
    a small model on a CPU need not pay it; an 8B model on an 80 GB GPU must (121 GiB of activations without it)."""
    if requested != "auto":
        return bool(requested)
    return peak_without > memory // 2


def logit_chunk(vocab: int, budget_bytes: int = 2**28) -> int:
    """Tokens per logits chunk: a float32 (tokens × vocab) block of at most `budget_bytes` (523 tokens at a 128k vocabulary);
    the stage computes its logits in such chunks, and the memory model counts one."""
    return max(1, budget_bytes // (4 * max(vocab, 1)))


def refine_memory(shape: Shape, params: str, rank: int, batch_tokens: int, record_length: int, top_k: int, judged_tokens: int,
                  compute_bytes: int, cpu: bool, autocast: bool = True, checkpointing: bool = True,
                  step_records: int | None = None) -> dict[str, int]:
    """Bytes by part at the stage's peak (see the module's docstring); `peak` is the device's, `host` the host's extra.
    `autocast`: the student computes under bf16 autocast (refine.precision; engine/refine.refine_dtypes);
    `checkpointing`: each decoder layer and logits chunk recomputed in the backward (refine.gradient_checkpointing);
    `step_records`: records a step (refine.batch_records): a training micro-batch holds no more than their tokens."""
    total = shape.parameters()
    if params == "full":
        trained, frozen = total, 0
    else:
        head = shape.embedding()
        trained = shape.lora_parameters(rank) + shape.one_dimensional() + head
        frozen = total - head - shape.one_dimensional()
    master_bytes = max(compute_bytes, 4)  # engine/refine.refine_dtypes: float32, or float64 for a float64 run
    frozen_bytes = compute_bytes if autocast else master_bytes  # without autocast everything computes in the master dtype
    activation_bytes = 2 if autocast else master_bytes
    # the residual stream is in the embedding's dtype: the master where it trains, else the frozen weights'
    residual_bytes = frozen_bytes if params == "adapter" and not shape.tied else master_bytes
    tokens = batch_tokens if step_records is None else min(batch_tokens, step_records * record_length)
    rows = max(1, tokens // max(record_length, 1))
    layer = tokens * shape.saved_for_backward(activation_bytes, residual_bytes)
    scores = rows * shape.heads * record_length * record_length * 4
    kept_layers = 1 if checkpointing else shape.layers  # layers whose saved tensors and scores the backward holds at once
    inputs = shape.layers * tokens * shape.hidden * residual_bytes if checkpointing else 0  # each layer's input, kept
    logits = lambda count: 5 * count * shape.vocab * 4  # noqa: E731
    chunk = logit_chunk(shape.vocab)
    parts = {
        "frozen weights": frozen * frozen_bytes,
        "trained weights + gradients + AdamW": trained * 16,
        # a bf16 cast of each trained weight, and of each frozen one not already in bf16 (a CPU's float32 frozen weights)
        "autocast copies": (trained + (frozen if compute_bytes != 2 else 0)) * 2 if autocast else 0,
        "activations": inputs + (kept_layers + 1) * layer + kept_layers * scores,  # + 1: the gradients of one layer's
        "logits": logits(min(chunk, tokens) if checkpointing else tokens),
    }
    saved = 2 * trained * 4
    # the teachers' pass computes no gradient: its micro-batches hold `batch_tokens`, its logits one chunk
    teacher_bytes = compute_bytes if autocast else master_bytes  # engine/refine._teachers: the student's precision
    teacher = total * teacher_bytes + 2 * batch_tokens * shape.intermediate * 3 * teacher_bytes + logits(min(chunk, batch_tokens))
    store = judged_tokens * (min(top_k, shape.vocab or top_k) * 6 + 4)  # a teacher keeps no more tokens than it has
    training = sum(parts.values())
    peak = max(training + (saved if cpu else 0), teacher) + (store if cpu else 0)
    return {**parts, "saved states": saved, "teacher (its pass)": teacher, "teachers' store (host)": store,
            "peak": peak, "host": (0 if cpu else saved + store)}


def autocasts(precision: str, native_bf16: bool) -> bool:
    """Whether `refine.precision` trains under bf16 autocast on a device that does (`native_bf16`) or does not compute
    bf16 natively: the one rule engine/refine.refine_dtypes and the memory plan share."""
    return precision == "bfloat16" or (precision == "auto" and native_bf16)


def plan_line(config: dict, refine: Any, batch_tokens: int, max_length: int, tokens: int, cpu: bool, memory: float,
              head_may_untie: bool = False) -> str:
    """`validate`'s memory-plan line for `refine:` (config.json as a dict; `memory`: the device's bytes). A head the
    closed form may untie (`head_may_untie`) is planned untied: the larger of the two students."""
    heads = config["num_attention_heads"]
    shape = Shape(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads,
                  config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads,
                  config.get("vocab_size") or 0, bool(config.get("tie_word_embeddings")) and not head_may_untie)
    params = resolve_params(refine.params, shape.parameters(), int(memory))
    if cpu:
        from featcal_llm.hardware import native_bf16_matmul

        native = native_bf16_matmul()  # the rule engine/devices.native_bf16 applies to a CPU, without torch
    else:  # the GPU it will run on may not be this machine's: planned as one with bf16, as every GPU that fits 8B has
        native = True
    autocast = autocasts(refine.precision, native)
    plan = lambda checkpointing: refine_memory(shape, params, refine.rank, min(batch_tokens, 8192), max_length, refine.top_k,  # noqa: E731
                                               tokens, 4 if cpu else 2, cpu, autocast, checkpointing, refine.batch_records)
    without = plan(False)
    checkpointing = resolve_checkpointing(refine.gradient_checkpointing, without["peak"], int(memory))
    bytes_ = plan(True) if checkpointing else without
    where = "RAM" if cpu else "GPU"
    return (f"  refine      ~{bytes_['peak'] / 1e9:.1f} GB {where} peak (params {params}"
            + (f", rank {refine.rank}" if params == "adapter" else "")
            + (", the LM head untied, as the closed form may re-fit it" if head_may_untie else "")
            + f", gradient checkpointing {'on' if checkpointing else 'off'}"
            + (f"; ~{bytes_['host'] / 1e9:.1f} GB more on the host" if not cpu else "")
            + "; docs/refine.md)")


__all__ = ["ASSUMED_GPU", "FULL_STATE_BYTES", "Shape", "autocasts", "plan_line", "refine_memory", "resolve_checkpointing",
           "resolve_params"]
