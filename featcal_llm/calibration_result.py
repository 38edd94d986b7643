"""What `calibrate` returns (the per-expert drift and KL summary, what `refine:` changed, time and memory) and the
table `featcal-llm run` prints from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class ExpertSummary:
    """How far the merged and the calibrated model are from one expert, on that expert's probe records.

    `drift_*`: relative feature drift ‖h − h_expert‖ / ‖h_expert‖ at the last decoder layer's output (`*_merged`: of
    the model the calibration started from, a stack's first stage for a stack: CalibrationResult.start);
    `kl_*`: mean next-token KL(expert ‖ model) through each model's final norm and LM head.
    None where the run did not measure it.
    """

    drift_merged: float | None
    drift_calibrated: float | None
    kl_merged: float | None
    kl_calibrated: float | None
    # the merge teaches this expert's records (trailing_experts: merge): every number above is to the merged model, the
    # records' teacher, not to the expert (so the merged model's are 0)
    taught_by_merge: bool = False
    taught_by: str | None = None  # `teachers: best`: the other expert that teaches this expert's records, every number above is to it


@dataclass(frozen=True)
class RefineSummary:
    """What `refine:` changed after the closed form (featcal_refine.json holds every check); only where it changed the weights."""

    chosen_step: int
    held_out_kl: dict[str, tuple[float | None, float | None]]  # by expert: (the closed form's, the written weights')
    top_k: int | None = None  # the KL is refine's own measure, over each teacher's top-k tokens (not the drift report's)


@dataclass(frozen=True)
class CalibrationResult:
    """What `calibrate` produced and what it cost."""

    output: Path  # the calibrated checkpoint
    merged: Path  # the merged model it was calibrated from
    experts: dict[str, ExpertSummary] = field(default_factory=dict)  # by the recipe's expert name
    seconds: float = 0.0  # wall-clock time of the whole run (merge and evaluation included)
    peak_host_memory: int | None = None  # bytes: the process's peak resident memory during the run (None where unknown)
    peak_gpu_memory: int | None = None  # bytes: peak CUDA memory allocated by torch (None without CUDA)
    evaluation: str | None = None  # the merged-vs-calibrated table of the recipe's `eval:` block
    warnings: tuple[str, ...] = ()  # every warning the run printed, in order
    unchanged: bool = False  # the output is the merged model, unchanged: every expert trails it on its own records
    head_changed: bool = False  # unchanged but for its LM head (a tied merge's stored head, written as vLLM serves it)
    probe: str | None = None  # the records `experts` was measured on: "held-out records" or "calibration subsample"
    # `refine:` changed the weights after `experts` was measured (featcal_refine.json): the step it chose, and each
    # expert's held-out KL to its records' teacher before and after it
    refined: RefineSummary | None = None
    start: str = "merged"  # what `experts`' "merged" columns measured: the merge, or a stack's first stage (regmean++)

    def headline(self) -> str:
        """The run's last line: where the checkpoint is, and whether it is the merge unchanged."""
        if self.unchanged:
            but = " but for its LM head (see its card)" if self.head_changed else ""
            return (f"checkpoint written to {self.output}: the merged model, unchanged{but} (every expert predicts its own "
                    "records worse than the merge; see the warning above)")
        return f"calibrated checkpoint written to {self.output}"

    def __str__(self) -> str:
        """What `featcal-llm run` prints: where the checkpoint is, the per-expert table, the warnings and the evaluation."""
        lines = [f"calibrated checkpoint: {self.output} (from the merged model {self.merged})" if not self.unchanged else
                 f"checkpoint: {self.output}, the merged model {self.merged} unchanged (every expert trails it on its own records)"]
        if self.experts:
            lines += ["", self.table()]
        else:
            lines.append(f"time {_duration(self.seconds)}")
        lines += [f"warning: {warning}" for warning in self.warnings]
        if self.evaluation:
            lines += ["", self.evaluation.rstrip()]
        return "\n".join(lines)

    def table(self) -> str:
        """The per-expert summary as a plain-text table, with the run's time and peak memory."""
        def number(value: float | None) -> str:
            return "–" if value is None else f"{value:.4g}"

        from featcal_llm.io.names import short_names

        labels = short_names(list(self.experts))  # experts named by long paths: the part that tells them apart
        width = max([len("expert"), *(len(labels[name]) + 2 * (summary.taught_by_merge or summary.taught_by is not None)
                                      for name, summary in self.experts.items())])
        ours = "closed form" if self.refined else "calibrated"  # measured before refine: changed the weights
        columns = [f"drift {self.start}", f"drift {ours}", f"KL {self.start}", f"KL {ours}"]
        header = "  ".join([f"{'expert':<{width}}", *columns])
        rows = [header, "-" * len(header)]
        farther = [name for name, summary in self.experts.items() if summary.kl_merged is not None
                   and summary.kl_calibrated is not None and summary.kl_calibrated > summary.kl_merged]
        for name, summary in self.experts.items():
            values = (summary.drift_merged, summary.drift_calibrated, summary.kl_merged, summary.kl_calibrated)
            label = labels[name] + (" *" if summary.taught_by_merge else " †" if summary.taught_by is not None else "")
            rows.append("  ".join([f"{label:<{width}}", *(f"{number(v):>{len(c)}}" for v, c in zip(values, columns))])
                        + ("  !" if name in farther else ""))
        rows.append("drift: ‖h − h_expert‖ / ‖h_expert‖ after the last layer; KL: the next-token KL divergence to the expert; "
                    "lower is closer to the expert")
        if farther:  # the broad setting's harm: a kind of text the calibration made worse than the merge
            rows.append(f"! KL {ours} above KL {self.start}: on these records the {ours} model predicts this expert's next "
                        f"tokens worse than the {self.start} model did")
        memory = [f"host {_gib(self.peak_host_memory)}"] if self.peak_host_memory is not None else []
        memory += [f"GPU {_gib(self.peak_gpu_memory)}"] if self.peak_gpu_memory is not None else []
        rows.append({"held-out records": "(drift and KL on each expert's held-out records, which the calibration did not fit)",
                     "calibration subsample": "(drift and KL on a sample of each expert's calibration records, not on held-out text)"}
                    .get(self.probe, "(drift and KL on each expert's probe records: featcal_drift.json says which)"))
        taught = [labels[name] for name, summary in self.experts.items() if summary.taught_by_merge]
        if taught:
            rows.append(f"* the merge teaches {', '.join(taught)}'s records (trailing_experts: merge): drift and KL there are to the "
                        "merged model, not to the expert")
        chosen = {labels[name]: labels.get(summary.taught_by, summary.taught_by) for name, summary in self.experts.items()
                  if summary.taught_by is not None and not summary.taught_by_merge}
        if chosen:
            rows.append("† " + "; ".join(f"{teacher} teaches {name}'s records" for name, teacher in chosen.items())
                        + " (teachers: best): drift and KL there are to that teacher, not to the expert")
        if self.refined:
            changes = ", ".join(f"{labels.get(name, name)} {number(before)} → {number(after)}"
                                for name, (before, after) in self.refined.held_out_kl.items())
            rows.append(f"then refine: changed the weights (step {self.refined.chosen_step}): held-out KL to each record's "
                        f"teacher over its top-{self.refined.top_k} tokens, refine's own measure, {changes} (featcal_refine.json)")
        rows.append(f"time {_duration(self.seconds)}" + (f"; peak memory: {', '.join(memory)}" if memory else "")
                    + (" (host: the resident set, with the pages of the model files read)" if self.peak_host_memory else ""))
        return "\n".join(rows)


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)} min {rest:.0f} s" if minutes else f"{rest:.1f} s"


def summarize_report(report: Mapping[str, Any]) -> dict[str, ExpertSummary]:
    """Per-expert summary of a featcal_drift.json payload: the last layer's drift and the final next-token KL."""
    layers = report.get("layers") or []
    last = layers[-1] if layers else {}
    divergence = report.get("output_divergence") or {}
    taught, teachers = set(report.get("taught_by_merge", [])), report.get("teachers", {})
    return {
        name: ExpertSummary(
            last.get("merged", {}).get(name), last.get("calibrated", {}).get(name),
            divergence.get("merged", {}).get(name), divergence.get("calibrated", {}).get(name), name in taught, teachers.get(name),
        )
        for name in report.get("experts", [])
    }


def refine_summary(refined: Mapping[str, Any] | None) -> RefineSummary | None:
    """The run's `refine:` change (RunOutcome.refined), by the recipe's expert names."""
    if not refined:
        return None
    before, after = refined["per_expert"]["before"], refined["per_expert"]["after"]
    return RefineSummary(refined["chosen_step"], {name: (before.get(name), after.get(name)) for name in before}, refined.get("top_k"))
