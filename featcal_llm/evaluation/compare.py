"""`run recipe.yaml` with an `eval:` block: merged vs calibrated, one pipeline, one table."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation.config import EvalSection
from featcal_llm.evaluation.leaderboard import (
    comparison_row,
    reference_rows,
    render_markdown,
    summary_rows,
    write_csv,
    write_png,
)
from featcal_llm.evaluation.modelinfo import (
    ChatDecision,
    check_model_dir,
    decide_chat_template,
)
from featcal_llm.evaluation.runner import evaluate_model, safe_label
from featcal_llm.io.model_files import saved_chat_template
from featcal_llm.evaluation.suite import load_suite


def _same_decision(decision: ChatDecision, model_dir: Path) -> ChatDecision:
    """The calibrated model is scored exactly like the merge it came from."""
    import hashlib

    template = saved_chat_template(model_dir)
    if decision.applied and template is None:
        raise FeatCalError(f"{model_dir}: the merged model is scored with its chat template, but this tokenizer has none")
    sha = hashlib.sha256(template.encode()).hexdigest() if template else None
    return ChatDecision(decision.applied, f"as the merged model ({decision.reason})", sha)


def _labels(merged_dir: Path, calibrated_dir: Path) -> tuple[str, str]:
    merged, calibrated = safe_label(merged_dir.name), safe_label(calibrated_dir.name)
    if merged == calibrated:
        merged, calibrated = f"{merged}-merged", f"{calibrated}-calibrated"
    return merged, calibrated


@dataclass(frozen=True)
class AfterCalibration:
    """The merged-vs-calibrated table, and the calibrated model's own summary of this evaluation (the card's
    model-index takes its scores: not whichever summary in the results folder names the same directory)."""

    table: str
    calibrated: dict


def compare_after_calibration(section: EvalSection, merged_dir: Path, calibrated_dir: Path, recipe_dir: Path,
                              echo=lambda line: print(line, file=sys.stderr)) -> AfterCalibration:
    section = section.resolve(recipe_dir)
    suite = load_suite(section.suite)
    references = reference_rows([section.reference], suite, "eval.reference") if section.reference else []  # before any scoring
    merged_dir, calibrated_dir = check_model_dir(merged_dir), check_model_dir(calibrated_dir)
    merged_chat = decide_chat_template(merged_dir, section.chat_template)
    calibrated_chat = _same_decision(merged_chat, calibrated_dir)
    merged_label, calibrated_label = _labels(merged_dir, calibrated_dir)
    merged = evaluate_model(merged_dir, merged_label, section, chat=merged_chat, echo=echo)
    calibrated = evaluate_model(calibrated_dir, calibrated_label, section, chat=calibrated_chat, echo=echo)

    ours = summary_rows([merged, calibrated], suite)
    for summary in (merged, calibrated):
        summary["_dir"] = section.output
    delta = comparison_row(merged, calibrated, suite, "Δ calibrated − merged")
    rows = references + ours + [delta]
    markdown = render_markdown(rows, suite)
    output = Path(section.output)
    (output / "after-calibration.md").write_text(markdown)
    write_csv(rows, suite, output / "after-calibration.csv")
    write_png(rows, suite, output / "after-calibration.png")
    return AfterCalibration(markdown, {key: value for key, value in calibrated.items() if not key.startswith("_")})
