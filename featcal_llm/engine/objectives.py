"""The methods as the layer loop drives them: how a task's statistics are folded into each input group's system
and how a layer is solved, for FeatCal and for RegMean/RegMean++ (the arithmetic itself is in `featcal_llm.maths`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Sequence

import torch

from featcal_llm.errors import FeatCalError, RunFailure
from featcal_llm.maths.objective import ExpertGroup, GroupSystem, Hyperparameters, MixedTargets, SplitTargets, fold, solve_bias, solve_norm
from featcal_llm.maths.regmean import GRAM, GramRecording, RegMeanSetting, RegMeanSystem
from featcal_llm.maths.solve import SOLVE_DTYPE, RidgeSolver, anchor
from featcal_llm.maths.stats import GroupStatistics

if TYPE_CHECKING:
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.engine.prefetch import LayerTensors
    from featcal_llm.engine.tuning import Search


class LayerSettings:
    """What every objective is parameterised by: one setting for all layers, one per layer (a replay), or a search's start."""

    def __init__(self, setting, search: "Search | None" = None):
        self._setting = tuple(setting) if isinstance(setting, (list, tuple)) else setting
        self.search = search

    @property
    def tuned(self) -> bool:
        return self.search is not None

    def hyper(self, layer: int):
        """The setting of `layer` in a run that does not search (a tuned run's start point otherwise)."""
        return self._setting[layer] if isinstance(self._setting, tuple) else self._setting

    def settings(self) -> tuple:
        return self._setting if isinstance(self._setting, tuple) else (self._setting,)

    @property
    def eps(self) -> float:
        return self.hyper(0).eps


class FeatCal(LayerSettings):
    """FeatCal with given hyper-parameters (one setting, or one per layer) or chosen per layer by a search."""

    name = "featcal"

    def __init__(self, hyper: Hyperparameters | Sequence[Hyperparameters], search: "Search | None" = None, split_targets: bool = False):
        super().__init__(hyper, search)
        self.split_targets = split_targets or search is not None  # a search needs every α; a replay folds as the search did

    def smallest_lambda(self) -> float:
        """The smallest λ the run may solve with: it decides the statistics' precision."""
        if self.search is not None:
            return min(self.search.values["lambda"])
        return min(h.lam for h in self.settings())

    def new_system(self, layer: int) -> GroupSystem:
        targets = (lambda: SplitTargets()) if self.split_targets else (lambda: MixedTargets(self.hyper(layer).alpha))
        return GroupSystem(lhs=None, targets=targets(), biases=targets())  # type: ignore[arg-type]

    def fold_task(self, plan: "CalibrationPlan", layer: int, systems: dict[str, GroupSystem], stats: dict[str, GroupStatistics], expert_weights: dict[str, torch.Tensor], task: str) -> None:
        """Add one task's statistics to every input group's system (so they can be freed)."""
        for group in plan.groups():
            selected = plan.selected(group)
            expert = ExpertGroup(
                weights={p: expert_weights[f"{p}.weight"] for p in selected},
                biases={p: expert_weights[f"{p}.bias"] for p in selected if plan.biases and f"{p}.bias" in expert_weights},
                norm=expert_weights.get(f"{group.norm}.weight") if group.norm else None,
            )
            if group.name not in systems:
                systems[group.name] = self.new_system(layer)
            fold(systems[group.name], stats[group.name], expert, self.eps, plan.task_weight(task))

    def solve_layer(
        self, plan: "CalibrationPlan", layer: int, systems: dict[str, GroupSystem], tensors: "LayerTensors",
        hyper: Hyperparameters | None = None, solver: RidgeSolver | None = None,
    ) -> dict[str, torch.Tensor]:
        """Calibrated tensors of one layer (names relative to the layer), in the merged checkpoint's dtypes.

        `hyper` defaults to the layer's setting; a tuned run passes each candidate
        and one `RidgeSolver(keep_lhs=True)` that keeps factors across them.
        """
        hyper = hyper or self.hyper(layer)
        solver = solver or RidgeSolver()
        merged, base = tensors.merged, tensors.base
        solved: dict[str, torch.Tensor] = {}
        for group in plan.groups():
            system = systems[group.name]
            device = system.lhs.device

            def anchored(name: str) -> torch.Tensor:
                return anchor(merged[name].to(device), base[name].to(device), hyper.rho)

            selected = plan.selected(group)
            if selected:
                rhs, bias_sums = system.targets.at(hyper.alpha), system.biases.at(hyper.alpha)
                solutions = solver.solve(
                    group.name, system.lhs, {p: rhs[p] for p in selected}, {p: anchored(f"{p}.weight") for p in selected},
                    hyper.lam, hyper.eps, where=f"layer {layer} {group.name}",
                )
                for projection, weight in solutions.items():
                    solved[f"{projection}.weight"] = weight
                    if projection in bias_sums:
                        solved[f"{projection}.bias"] = solve_bias(system, bias_sums[projection], weight, anchored(f"{projection}.bias"), hyper.lam)
            if plan.norms and group.norm:
                solved[f"{group.norm}.weight"] = solve_norm(system, anchored(f"{group.norm}.weight"), hyper.lam)
        return stored_solutions(layer, solved, merged, LAMBDA_REMEDY)


LAMBDA_REMEDY = "a larger featcal.lambda keeps the solution nearer its anchor"


def stored_solutions(layer: int, solved: dict[str, torch.Tensor], merged: dict[str, torch.Tensor],
                     remedy: str = "") -> dict[str, torch.Tensor]:
    """Each solution in its merged tensor's dtype, on the CPU: refused where it is not finite, as solved or as stored (a
    float16 merge holds at most 65504), so that no infinite weight is ever written."""
    stored = {}
    for name, tensor in solved.items():
        if not bool(torch.isfinite(tensor).all()):
            raise RunFailure(f"layer {layer}: solution for {name} has NaN/Inf")
        stored[name] = tensor.to(dtype=merged[name].dtype).cpu()
        if not bool(torch.isfinite(stored[name]).all()):
            raise RunFailure(f"layer {layer}: solution for {name} reaches {tensor.abs().max().item():.3g}, beyond "
                             f"{str(stored[name].dtype).removeprefix('torch.')}, the merged model's dtype, which stores it"
                             + (f"; {remedy}" if remedy else ""))
    return stored


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

    def fold_task(self, plan: "CalibrationPlan", layer: int, systems: dict[str, RegMeanSystem], stats: dict[str, GroupStatistics], expert_weights: dict[str, torch.Tensor], task: str) -> None:
        """Add task i's reduced Gram and W_i G̃_i to every group's sums (MergeBench step 2.2: equal weights unless the recipe gives them)."""
        share = plan.task_weight(task)
        for group in plan.groups():
            group_stats = stats[group.name]
            if group_stats.tokens == 0:
                raise FeatCalError("internal: a task contributed no tokens")
            gram = group_stats.gram.to(SOLVE_DTYPE) / float(group_stats.tokens)  # per-token mean (compute_grams L46-49)
            diagonal = gram.diagonal().clone()
            system = systems.setdefault(group.name, self.new_system(layer))
            for projection in plan.selected(group):
                weight = expert_weights[f"{projection}.weight"].to(device=gram.device, dtype=SOLVE_DTYPE)
                system.targets.add(projection, weight @ gram, weight * diagonal, share)  # W_i G and W_i diag(G)
            system.gram.add(GRAM, gram, torch.diag(diagonal), share)

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
        return stored_solutions(layer, solved, merged)
