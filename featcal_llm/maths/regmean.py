"""RegMean and RegMean++ as objectives over the recorded Grams, beside FeatCal (same interface).

Definitions followed (uiuctml/MergeBench, read at commits 399ac2d / 48a5b15):

* the Gram of one linear input: ``merging/merging_methods/regmean_utils.py`` L33-86
  (`compute_grams`): a forward hook on every ``nn.Linear`` of the fine-tuned
  model keeps the running **per-token mean** G_i = (1/n) Σ_t x_t x_tᵀ over the
  task's tokens (L42-50); RegMean runs fine-tuned model i on its own task's
  data (L78-81, "For RegMean"), RegMean++ runs fine-tuned *layer* l on the
  inputs of the model being built, the merged layers < l applied to the
  merged embedding (L73-77 and ``regmean_plusplus.py`` `merge`, steps 1 and
  2.1: `compute_grams(None, finetuned_layer, task_inputs[...])`, step 2.3:
  `forward_layer` through the merged layer just solved);
* the reduction: ``regmean_utils.py`` L88-92 (`reduce_non_diag`): off-diagonal
  entries × r, diagonal kept: G̃ = r G + (1 − r) diag(G);
* the merge: ``regmean_plusplus.py`` `merge`, step 2.2: W* = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹,
  tasks summed with equal weight (no normalisation beyond the per-token mean);
  only ``.weight`` of a module with a Gram is regressed; biases and norms are
  the plain average of the fine-tuned models there.

Where we differ, deliberately and documented (docs/methods.md, "RegMean and RegMean++"):
padding tokens are masked (only real tokens count, as everywhere in
featcal-llm); biases, norms, embeddings and lm_head come from `merged` (a
`linear` merge with equal weights is MergeBench's average); the solve is a
float64 Cholesky of Σ G̃_i + eps I with a checked residual (MergeBench: a
float32 inverse, `pinv` above condition 1e8), and a failed solve is retried
with a small ridge toward the merged weights, with a warning.

Because G̃ is linear in r, both sums are kept as (full, diagonal) pairs —
`MixedTargets` with α := r for a fixed r, `SplitTargets` when r is chosen
per layer — so every candidate reduction is one lerp of the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from featcal_llm.errors import FeatCalError
from featcal_llm.maths.objective import LayerSettings, MixedTargets, SplitTargets, Targets
from featcal_llm.maths.solve import SOLVE_DTYPE, RidgeSolver
from featcal_llm.maths.stats import GroupStatistics

if TYPE_CHECKING:
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.engine.prefetch import LayerTensors
    from featcal_llm.engine.tuning import Search

GRAM = "gram"  # the lhs's name inside its Targets


@dataclass(frozen=True)
class RegMeanSetting:
    """One layer's RegMean hyper-parameters: the off-diagonal scaling r and the solve's diagonal shift eps."""

    reduction: float
    eps: float

    def values(self) -> dict[str, float]:
        return {"reduction": self.reduction}


@dataclass(frozen=True)
class GramRecording:
    """What a RegMean run records: one Gram per input group on expert i's layer, fed by `stream`.

    `expert`: h_exp,i, expert i's own hidden states on its own data (RegMean);
    `cal`: h_cal, the model being built (RegMean++). No crosses, no sums, no norm
    statistics, and no pass of the merged layer over the calibration records.
    """

    stream: Literal["expert", "cal"]


@dataclass
class RegMeanSystem:
    """One input group's sums over the tasks so far: Σ G̃_i and Σ W_i,p G̃_i, each as its (full, diagonal) pair."""

    gram: Targets
    targets: Targets
    tasks: int = 0


class RegMean(LayerSettings):
    """RegMean (`stream="expert"`) or RegMean++ (`stream="cal"`), with a fixed, per-layer or searched reduction."""

    def __init__(self, stream: Literal["expert", "cal"], setting: RegMeanSetting | Sequence[RegMeanSetting], search: "Search | None" = None):
        super().__init__(setting, search)
        self.recording = GramRecording(stream)
        self.name = "regmean" if stream == "expert" else "regmean++"
        self.split_targets = search is not None or not isinstance(setting, RegMeanSetting)

    def smallest_lambda(self) -> float:
        """No ridge: the Grams are solved as they are, so the statistics need full precision (`stats_dtype: auto` → float64)."""
        return 0.0

    def new_system(self, layer: int) -> RegMeanSystem:
        make = SplitTargets if self.split_targets else (lambda: MixedTargets(self.hyper(layer).reduction))
        return RegMeanSystem(gram=make(), targets=make())

    def fold_task(self, plan: "CalibrationPlan", layer: int, systems: dict[str, RegMeanSystem], stats: dict[str, GroupStatistics], expert_weights: dict[str, torch.Tensor]) -> None:
        """Add task i's reduced Gram and W_i G̃_i to every group's sums (equal task weights, MergeBench step 2.2)."""
        for group in plan.groups():
            group_stats = stats[group.name]
            if group_stats.tokens == 0:
                raise FeatCalError("internal: a task contributed no tokens")
            gram = group_stats.gram.to(SOLVE_DTYPE) / float(group_stats.tokens)  # per-token mean (compute_grams L46-49)
            diagonal = gram.diagonal().clone()
            system = systems.setdefault(group.name, self.new_system(layer))
            for projection in plan.selected(group):
                weight = expert_weights[f"{projection}.weight"].to(device=gram.device, dtype=SOLVE_DTYPE)
                system.targets.add(projection, weight @ gram, weight * diagonal, 1.0)  # W_i G and W_i diag(G)
            system.gram.add(GRAM, gram, torch.diag(diagonal), 1.0)
            system.tasks += 1

    def solve_layer(
        self, plan: "CalibrationPlan", layer: int, systems: dict[str, RegMeanSystem], tensors: "LayerTensors",
        hyper: RegMeanSetting | None = None, solver: RidgeSolver | None = None,
    ) -> dict[str, torch.Tensor]:
        """W*_p = (Σ_i W_i,p G̃_i)(Σ_i G̃_i + eps I)⁻¹ for every selected projection, in the merged checkpoint's dtypes.

        `solver` is ignored: Σ G̃ changes with every candidate r, so no factor can
        be kept across candidates (each solve factors its own).
        """
        hyper = hyper or self.hyper(layer)
        merged = tensors.merged
        solved: dict[str, torch.Tensor] = {}
        for group in plan.groups():
            selected = plan.selected(group)
            if not selected:
                continue
            system = systems[group.name]
            lhs = system.gram.at(hyper.reduction)[GRAM]
            rhs = system.targets.at(hyper.reduction)
            anchors = {p: merged[f"{p}.weight"].to(device=lhs.device, dtype=SOLVE_DTYPE) for p in selected}
            solutions = RidgeSolver().solve(group.name, lhs, {p: rhs[p] for p in selected}, anchors, 0.0, hyper.eps,
                                            where=f"layer {layer} {group.name}")
            for projection, weight in solutions.items():
                solved[f"{projection}.weight"] = weight
        for name, tensor in solved.items():
            if not bool(torch.isfinite(tensor).all()):
                raise FeatCalError(f"layer {layer}: solution for {name} has NaN/Inf")
            solved[name] = tensor.to(dtype=merged[name].dtype).cpu()
        return solved
