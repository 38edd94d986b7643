"""One run's shared state, threaded through the layer loop instead of a dozen arguments per function.

Built once by the pipeline (or the benchmark) before the first layer and
dropped after the last: the checkpoints it reads, what it calibrates and by
which objective, the layer runner, where hidden states live, the resume
staging area, the token batches and their hidden-state streams, the probe
records and the timer. Per-layer data (tensors, statistics, systems) is not
here: it lives for one layer only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featcal_llm.engine.distributed import Single
from featcal_llm.engine.drift import Heads, Probe
from featcal_llm.engine.plan import CalibrationPlan
from featcal_llm.engine.profiling import NullTimer, PhaseTimer
from featcal_llm.engine.progress import NullProgress, TokenProgress
from featcal_llm.engine.record import StatisticsWorkspace
from featcal_llm.engine.resume import StagingArea
from featcal_llm.engine.streams import HostStore, TokenBatch
from featcal_llm.family.layers import LayerRunner
from featcal_llm.io.checkpoint import CheckpointReader

Streams = dict[str, list[torch.Tensor]]  # task → one host tensor per batch


@dataclass
class Models:
    merged: CheckpointReader
    base: CheckpointReader
    experts: dict[str, CheckpointReader]  # task name → expert checkpoint


@dataclass
class RunContext:
    models: Models
    plan: CalibrationPlan
    runner: LayerRunner
    store: HostStore
    staging: StagingArea
    batches: dict[str, list[TokenBatch]]  # task → its calibration batches
    probe: Probe | None = None  # records the drift is measured on (a tuned run's held-out records)
    timer: NullTimer | PhaseTimer = field(default_factory=NullTimer)
    cal: Streams = field(default_factory=dict)  # h_cal per task, advanced through each calibrated layer
    expert: Streams = field(default_factory=dict)  # h_exp,i of expert i on its own task
    token_roots: dict[str, list[torch.Tensor]] | None = None  # √(token weight) per task and batch (`token_weights: expert_lead`)
    teachers: dict[str, tuple[str, float, float]] = field(default_factory=dict)  # `teachers: best`: expert → (the expert
    # that teaches its records in its place, its mean lead over the expert there, two standard errors)
    head: torch.Tensor | None = None  # the calibrated LM head (`head:`), once solved
    heads: Heads | None = None  # final norm + LM head per model, for the `output` tuning criterion
    workspace: StatisticsWorkspace = field(default_factory=StatisticsWorkspace)
    comm: Single = field(default_factory=Single)  # the ranks of a torchrun world (no-ops in one process)
    owners: dict[str, int] = field(default_factory=dict)  # this layer's input group → the rank that solves it
    progress: NullProgress | TokenProgress = field(default_factory=NullProgress)  # set by calibrate() for its loop
