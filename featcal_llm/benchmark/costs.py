"""Analytic FLOP and byte counts of one decoder layer of the FeatCal loop.

Counts follow the engine's algorithm (calibrate.py, stats.py, solve.py), from
the shapes of the projections (read off a meta-device decoder layer) and the
per-sequence token counts:

* forward: three passes per task over its tokens (cal recorded, expert,
  cal advanced through the updated layer); each is 2·params·T for the linear
  projections plus causal attention 2·T²·(heads·head_dim) per sequence
  (QKᵀ and AV are 4·T²·d for the full square; only the causal half is useful).
* statistics, per task: 2·n·d² per input group (Gram; on a CPU only the lower
  block triangle, `stats.gram_blocks`, so (k + 1)/2k of that) + 2·n·m·d per projection
  (cross); a group whose crosses would cost more than one d × d moment
  (`stats.cross_moment_pays`) costs 2·n·d² for the moment instead of its crosses.
* solve: per task and projection W_i·G_i (2·m·d², `objective.fold`), plus
  W_i·moment (2·m·d²) for a group that kept a moment; per group a Cholesky d³/3; per projection cholesky_solve
  2·m·d² and the sketched residual check (8 probe columns, negligible).
  Retries with a larger ridge are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    name: str
    input_dim: int
    outputs: dict[str, int]  # projection → output dim


@dataclass(frozen=True)
class LayerShape:
    groups: tuple[Group, ...]
    linear_params: int  # weights of every projection of the layer (calibrated or not)
    attention_dim: int  # heads · head_dim


def layer_shape(architecture, config, plan) -> LayerShape:
    """Projection shapes of one decoder layer, from a meta-device instance of the family's own class."""
    import torch  # here, so recipe validation can use the byte counts without importing torch

    with torch.device("meta"):
        layer = architecture.layer_class()(config, 0)
    linear_params = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    groups = []
    for group in plan.groups():
        first = layer.get_submodule(group.projections[0])
        outputs = {p: layer.get_submodule(p).out_features for p in plan.selected(group)}
        groups.append(Group(group.name, first.in_features, outputs))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return LayerShape(tuple(groups), linear_params, heads * head_dim)


def forward_flops(shape: LayerShape, sequence_lengths: list[int]) -> float:
    """One pass of one layer over the given sequences (non-padding tokens only)."""
    tokens = sum(sequence_lengths)
    attention = sum(2.0 * t * t * shape.attention_dim for t in sequence_lengths)
    return 2.0 * shape.linear_params * tokens + attention


def gram_flops(dim: int, tokens: int, symmetric: bool) -> float:
    """One Gram's FLOPs: the whole square, or (CPU) the lower block triangle `stats.accumulate_gram` multiplies."""
    from featcal_llm.maths.stats import gram_blocks

    blocks = gram_blocks(dim) if symmetric else 1
    edges = [i * dim // blocks for i in range(blocks + 1)]
    return sum(2.0 * tokens * (end - start) * end for start, end in zip(edges, edges[1:]))


def _uses_moment(group, tokens: int) -> bool:
    from featcal_llm.maths.stats import cross_moment_pays

    output_total = sum(group.outputs.values())
    return output_total > group.input_dim and cross_moment_pays(tokens, group.input_dim, output_total)


def statistics_flops(shape: LayerShape, tokens: int, symmetric: bool = True) -> float:
    total = 0.0
    for group in shape.groups:
        d = group.input_dim
        total += gram_flops(d, tokens, symmetric)
        if _uses_moment(group, tokens):
            total += 2.0 * tokens * d * d
        else:
            total += sum(2.0 * tokens * m * d for m in group.outputs.values())
    return total


def fold_flops(shape: LayerShape, tokens: int) -> float:
    """W_i G_i for one task (`objective.fold`), plus W_i · moment where a moment was kept."""
    total = 0.0
    for g in shape.groups:
        per_projection = 4.0 if _uses_moment(g, tokens) else 2.0
        total += sum(per_projection * m * g.input_dim**2 for m in g.outputs.values())
    return total


def ridge_flops(shape: LayerShape) -> float:
    """Cholesky + solve + residual check, once per layer."""
    total = 0.0
    for g in shape.groups:
        if not g.outputs:
            continue
        d = g.input_dim
        total += d**3 / 3.0
        total += sum(2.0 * m * d * d for m in g.outputs.values())
    return total


def layer_flops(shape: LayerShape, task_sequences: dict[str, list[int]], symmetric: bool = True) -> dict[str, float]:
    """Phase → FLOPs of one layer (`symmetric`: Grams from their lower block triangle, as on a CPU)."""
    forward = sum(3.0 * forward_flops(shape, lengths) for lengths in task_sequences.values())
    statistics = sum(statistics_flops(shape, sum(lengths), symmetric) for lengths in task_sequences.values())
    solve = sum(fold_flops(shape, sum(lengths)) for lengths in task_sequences.values()) + ridge_flops(shape)
    return {"forward": forward, "statistics": statistics, "solve": solve}


def statistics_bytes(shape: LayerShape, element_size: int, moments: bool = True) -> int:
    """One task's statistics of one layer (Grams + crosses, + with `moments` a moment per group wider out than in)."""
    return sum(
        (g.input_dim**2 * (2 if moments and sum(g.outputs.values()) > g.input_dim else 1) + sum(m * g.input_dim for m in g.outputs.values()))
        * element_size
        for g in shape.groups
    )
