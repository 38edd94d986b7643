"""Changes to a card already written (io/card.py): the evaluation section and the Hub's `model-index` once a run's
`eval:` scored the model, and the usage snippet pointed at the Hub repository `--push-to-hub` publishes to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

EVAL_HEADING = "## Evaluation"
USAGE_ID = 'model_id = "'  # the usage snippet's line (io/card.py writes it) that --push-to-hub points at the Hub repository


def point_usage_at(directory: Path, repo_id: str) -> None:
    """The usage snippet of the card in `directory` loads `repo_id` (what `--push-to-hub` publishes)."""
    card = directory / "README.md"
    if not card.is_file():
        return
    lines = card.read_text(encoding="utf-8").splitlines(keepends=True)
    card.write_text("".join(f'{USAGE_ID}{repo_id}"\n' if line.startswith(USAGE_ID) else line for line in lines), encoding="utf-8")


def insert_before(text: str, heading: str, section: str) -> str:
    """`section` placed before the card's `heading` (at the end where the card has none)."""
    head, marker, tail = text.partition(heading)
    return head + section + marker + tail if marker else text.rstrip() + "\n\n" + section


def split_card(text: str) -> tuple[dict[str, Any], str]:
    """A card's front matter (parsed) and its body."""
    if not text.startswith("---\n"):
        return {}, text
    front, _, body = text[4:].partition("\n---\n")
    return yaml.safe_load(front) or {}, body


def append_evaluation(directory: Path, table: str, summary: dict[str, Any] | None = None) -> None:
    """Add the merged-vs-calibrated evaluation table (a run's `eval:` block) to the card, before the recipe, and, given
    the calibrated model's evaluation summary (evaluation.runner's `<label>.json`), its scores as the front matter's
    `model-index`, which the Hub shows as the model's evaluation results."""
    from featcal_llm.io.card_meta import model_index

    card = directory / "README.md"
    front, body = split_card(card.read_text(encoding="utf-8"))
    section = f"{EVAL_HEADING}\nThe merged and the calibrated model scored with one pipeline (featcal-llm `eval:`):\n\n{table.rstrip()}\n\n"
    if EVAL_HEADING in body:  # scored again (run --eval-only): the new table replaces the old one
        before, _, after = body.partition(EVAL_HEADING)
        rest = after.find("\n## ")
        body = before + (after[rest + 1:] if rest >= 0 else "")
    body = insert_before(body, "## Recipe", section)
    index = model_index(Path(directory).name, summary) if summary is not None else []
    if index:
        front["model-index"] = index
    text = ("---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---\n" if front else "") + body
    card.write_text(text, encoding="utf-8")
