"""What a run calibrates and by which objective: the architecture's input groups, the selected projections, the method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from featcal_llm.family.architectures import Architecture, InputGroup
from featcal_llm.engine.objectives import FeatCal
from featcal_llm.engine.objectives import RegMean

if TYPE_CHECKING:
    from featcal_llm.engine.tuning import Search
    from featcal_llm.maths.objective import Hyperparameters


@dataclass(frozen=True)
class CalibrationPlan:
    """What to calibrate and how; derived once from the recipe and the architecture."""

    architecture: Architecture
    projections: frozenset[str]
    norms: bool
    biases: bool
    objective: FeatCal | RegMean
    head: "Hyperparameters | None" = None  # the LM head's re-fit after the last layer (FeatCal's `head:`)
    own_heads: list[str] | None = None  # `head: auto`: the experts whose LM head differs from the base's (None: not asked)
    only: frozenset[str] | None = None  # the input groups this rank folds and solves (None: all of them)
    task_weights: dict[str, float] | None = None  # expert → its weight in the objective (`data.<expert>.weight`; None: all 1)

    def task_weight(self, task: str) -> float:
        return 1.0 if self.task_weights is None else self.task_weights.get(task, 1.0)

    @property
    def tuning(self) -> "Search | None":
        """The search of a run that chooses its hyper-parameters per layer on held-out records (None otherwise)."""
        return self.objective.search

    def groups(self) -> tuple[InputGroup, ...]:
        return tuple(
            group
            for group in self.architecture.groups
            if (self.selected(group) or (self.norms and group.norm)) and (self.only is None or group.name in self.only)
        )

    def selected(self, group: InputGroup) -> tuple[str, ...]:
        return tuple(p for p in group.projections if p in self.projections)
