"""Drift diagnostics: how far each layer's output of the merged and of the calibrated model is from expert i's.

Measured on probe records per expert: the held-out records of a tuned run, or a
fixed, evenly spaced subsample of the calibration records otherwise (so the
merged model's extra stream costs a few percent of a run). Per layer and expert
the relative drift ‖H − H_exp‖_F / ‖H_exp‖_F over the task's non-padding
tokens; at the end the mean next-token KL(expert ‖ model) through each model's
own final norm and LM head. Written as featcal_drift.json and featcal_drift.png.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from featcal_llm.io.names import short_names  # noqa: F401  (the drift report's legend)
from featcal_llm.io.checkpoint import CheckpointReader
from featcal_llm.family.layers import LayerRunner, norm_epsilon
from featcal_llm.engine.streams import HostStore, TokenBatch

DRIFT_JSON = "featcal_drift.json"
DRIFT_PNG = "featcal_drift.png"
TUNING_JSON = "featcal_tuning.json"
SAMPLE_SHARE = 1 / 16  # of each expert's calibration records, in fixed runs
SAMPLE_MOST = 64
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
KL_CHUNK = 1024  # tokens per log-softmax: 1024 × 128k float64 logits is 1 GiB

Streams = dict[str, list[torch.Tensor]]


def spaced_sample(records: list, count: int) -> list:
    """`count` evenly spaced records, deterministic (the first one included)."""
    step = len(records) / count
    return [records[int(i * step)] for i in range(count)]


def drift_sample(sequences: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """An evenly spaced, deterministic subsample of each expert's calibration records."""
    return {task: spaced_sample(seqs, min(SAMPLE_MOST, max(1, math.ceil(len(seqs) * SAMPLE_SHARE))))
            for task, seqs in sequences.items()}


@dataclass
class Probe:
    """Probe records per expert and their three hidden-state streams (cal, expert, merged)."""

    batches: dict[str, list[TokenBatch]]
    source: str  # "held-out records" or "calibration subsample"
    cal: Streams = field(default_factory=dict)
    expert: Streams = field(default_factory=dict)
    merged: Streams = field(default_factory=dict)
    divergence: dict | None = None  # the final output divergence, set by calibrate()


def outputs(runner: LayerRunner, layer: torch.nn.Module, batches: list[TokenBatch], stream: list[torch.Tensor], store: HostStore) -> list[torch.Tensor]:
    """`layer` applied to every batch of `stream`, as a new host stream."""
    result = []
    for batch, host in zip(batches, stream):
        hidden = host.to(runner.device, non_blocking=True)
        result.append(store.store(runner.forward(layer, hidden, runner.context(batch, hidden)), batch.keep))
    return result


def drift_sums(stream: list[torch.Tensor], reference: list[torch.Tensor], batches: list[TokenBatch], device: torch.device | None = None) -> tuple[float, float]:
    """(‖H − H_ref‖²_F, ‖H_ref‖²_F) over the non-padding tokens (padding is stored as zeros in both): sums, so ranks can add theirs."""
    error = total = 0.0
    for host, ref in zip(stream, reference):
        h, r = host.to(device=device, dtype=torch.float64), ref.to(device=device, dtype=torch.float64)
        error += float((h - r).pow(2).sum())
        total += float(r.pow(2).sum())
    return error, total


def drift_ratio(error: float, total: float) -> float:
    return math.sqrt(error / max(total, 1e-300))


def relative_drift(stream: list[torch.Tensor], reference: list[torch.Tensor], batches: list[TokenBatch], device: torch.device | None = None) -> float:
    """‖H − H_ref‖_F / ‖H_ref‖_F over the non-padding tokens, summed on `device`."""
    return drift_ratio(*drift_sums(stream, reference, batches, device))


def reduced_drifts(comm, streams: Streams, references: Streams, batches: dict[str, list[TokenBatch]], device: torch.device | None = None) -> dict[str, float]:
    """relative_drift per task over every rank's records: each rank's sums are added (`comm.sum_floats`) before the ratio."""
    sums = comm.sum_floats([value for task, b in batches.items() for value in drift_sums(streams[task], references[task], b, device)])
    return {task: drift_ratio(sums[2 * i], sums[2 * i + 1]) for i, task in enumerate(batches)}


def final_norm(runner: LayerRunner, reader: CheckpointReader, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model's final norm as the family's own class (its epsilon, Gemma's 1 + w scale), on the compute device, in `dtype` (default: the compute dtype)."""
    template = runner.front.model.norm  # on the meta device: its class and epsilon
    norm = type(template)(runner.config.hidden_size, eps=norm_epsilon(template))
    norm.load_state_dict({"weight": reader.get(FINAL_NORM).to(dtype or runner.dtype)}, assign=True)
    return norm.to(runner.device)


def head_dtype(compute: torch.dtype) -> torch.dtype:
    """The precision of the final norm and the logits: float32 at least.

    Where an expert and the merge predict a token about equally well, bf16
    logits (8 bits of mantissa) turn rounding into an advantage for one of
    them, and the token weights, coverage and KL reports would follow it.
    """
    return torch.promote_types(compute, torch.float32)


class Head:
    """A model's final norm and LM head (the family's own final-norm class), giving next-token log-probabilities.

    Both run in float32 or wider (`head_dtype`), whatever the layers' compute dtype.
    """

    def __init__(self, runner: LayerRunner, reader: CheckpointReader, weight: torch.Tensor | None = None):
        dtype = head_dtype(runner.dtype)
        self.norm = final_norm(runner, reader, dtype)
        if weight is None:  # `weight`: another head on the same features (a calibrated one)
            weight = reader.get(LM_HEAD if LM_HEAD in reader.names() else runner.architecture.embed_tokens)
        self.weight = weight.to(device=runner.device, dtype=dtype)
        self.device = runner.device
        self.softcap = getattr(runner.config, "final_logit_softcapping", None)  # Gemma-2 caps its logits: tanh(z / c) · c

    @torch.inference_mode()
    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(self.norm(hidden.to(device=self.device, dtype=self.weight.dtype)), self.weight).to(torch.float64)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class Heads:
    """The heads of a run's models, keyed by role (an expert may be named anything, `merged` included)."""

    merged: Head
    experts: dict[str, Head]


def next_token_kl_sums(
    models: list[tuple[Head, list[torch.Tensor]]], expert_head: Head, expert_stream: list[torch.Tensor], batches: list[TokenBatch]
) -> tuple[list[float], int]:
    """For each (head, stream): Σ over non-padding tokens of KL(p_expert ‖ p_model); and the token count.

    Chunks of tokens keep the float64 log-softmax over a large vocabulary
    bounded; the expert's log-probabilities are computed once per chunk and
    shared by every model compared with it.
    """
    totals, tokens = [0.0] * len(models), 0
    for index, batch in enumerate(batches):
        keep = batch.keep.to(expert_stream[index].device)
        chunks = [stream[index][keep].split(KL_CHUNK) for _, stream in models]
        for position, ref_rows in enumerate(expert_stream[index][keep].split(KL_CHUNK)):
            expert = expert_head.log_probs(ref_rows)
            p_expert = expert.exp()
            for slot, (head, _) in enumerate(models):
                totals[slot] += float((p_expert * (expert - head.log_probs(chunks[slot][position]))).sum())
            tokens += ref_rows.shape[0]
    return totals, tokens


def next_token_kls(
    models: list[tuple[Head, list[torch.Tensor]]], expert_head: Head, expert_stream: list[torch.Tensor], batches: list[TokenBatch], comm=None
) -> list[float]:
    """For each (head, stream): mean over non-padding tokens (of every rank, given `comm`) of KL(p_expert ‖ p_model)."""
    totals, tokens = next_token_kl_sums(models, expert_head, expert_stream, batches)
    if comm is not None:
        *totals, tokens = comm.sum_floats([*totals, float(tokens)])
    return [total / max(tokens, 1) for total in totals]


def next_token_kl(
    head: Head, stream: list[torch.Tensor], expert_head: Head, expert_stream: list[torch.Tensor], batches: list[TokenBatch], comm=None
) -> float:
    """Mean over non-padding tokens of KL(p_expert ‖ p_model) for one model."""
    return next_token_kls([(head, stream)], expert_head, expert_stream, batches, comm)[0]




REPORT_DIGITS = 12


def _significant(value):
    """Floats to 12 significant digits: a reduction's last bits can differ between a process that ran the weighting
    passes and one that resumed after them (the weights themselves are bit-identical), and a report has no use for them."""
    if isinstance(value, float):
        return float(f"{value:.{REPORT_DIGITS}g}")
    if isinstance(value, dict):
        return {key: _significant(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_significant(item) for item in value]
    return value


def write_report(directory: Path, report: dict) -> None:
    """featcal_drift.json and a line chart of per-layer drift (merged dashed, calibrated solid), byte-reproducible."""
    (directory / DRIFT_JSON).write_text(json.dumps(_significant(report), indent=1) + "\n", encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    layers = [row["layer"] for row in report["layers"]]
    labels = report.get("expert_labels") or short_names(report["experts"])
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for index, task in enumerate(report["experts"]):
        color = f"C{index}"
        axes.plot(layers, [row["merged"][task] for row in report["layers"]], "--", color=color, label=f"{labels[task]}: merged")
        axes.plot(layers, [row["calibrated"][task] for row in report["layers"]], "-o", color=color, markersize=3,
                  label=f"{labels[task]}: calibrated")
    axes.set_xlabel("decoder layer")
    axes.set_ylabel("‖h − h_expert‖ / ‖h_expert‖")
    divergence = report.get("output_divergence")
    title = f"Feature drift to each expert ({report['probe']})"
    if divergence:
        mean = {kind: sum(values.values()) / len(values) for kind, values in divergence.items()}
        title += f"\nnext-token KL to the experts: merged {mean['merged']:.3g}, calibrated {mean['calibrated']:.3g}"
    axes.set_title(title, fontsize=10)
    axes.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(directory / DRIFT_PNG, dpi=110, metadata={"Software": None})
    plt.close(figure)


def drift_report(probe: Probe, records: list[dict | None]) -> dict:
    """The featcal_drift.json payload from the per-layer records and the final divergence."""
    return {
        "metric": "per layer: ||H - H_expert||_F / ||H_expert||_F of the layer output over the expert's probe tokens; "
        "output_divergence: mean next-token KL(expert || model) through each model's final norm and LM head",
        "probe": probe.source,
        "experts": list(probe.batches),  # the recipe's names, which identify the models; keys of every per-expert field
        "expert_labels": short_names(list(probe.batches)),  # for display: the shortest distinct trailing path
        "probe_records": {task: sum(int(b.keep.shape[0]) for b in batches) for task, batches in probe.batches.items()},
        "probe_tokens": {task: sum(b.tokens for b in batches) for task, batches in probe.batches.items()},
        "layers": [{"layer": layer, **record["drift"]} for layer, record in enumerate(records)],
        "output_divergence": probe.divergence,
    }
