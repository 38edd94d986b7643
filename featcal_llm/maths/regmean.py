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
from typing import Literal

from featcal_llm.maths.objective import Targets

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
