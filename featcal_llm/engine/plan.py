"""What a run calibrates: the architecture's input groups, the selected projections, the hyper-parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from featcal_llm.family.architectures import Architecture, InputGroup

if TYPE_CHECKING:
    from featcal_llm.engine.tuning import Search


@dataclass(frozen=True)
class Hyperparameters:
    lam: float
    alpha: float
    rho: float
    eps: float


@dataclass(frozen=True)
class CalibrationPlan:
    """What to calibrate; derived once from the recipe and the architecture."""

    architecture: Architecture
    projections: frozenset[str]
    norms: bool
    biases: bool
    hyper: Hyperparameters  # a fixed run's values; ignored for the hyper-parameters a tuned run chooses
    tuning: "Search | None" = None  # set when λ, α or ρ are chosen per layer on held-out records

    def groups(self) -> tuple[InputGroup, ...]:
        return tuple(
            group
            for group in self.architecture.groups
            if self.selected(group) or (self.norms and group.norm)
        )

    def selected(self, group: InputGroup) -> tuple[str, ...]:
        return tuple(p for p in group.projections if p in self.projections)
