"""Model summaries -> a Table-4-style markdown table, a CSV and a PNG bar chart.

Rows are models, columns the suite's tasks and their unweighted average, in percent with the
suite's decimals. Paper rows can be added; they are labelled "(paper)" and kept apart in the
chart (hatched), since they were not produced by this pipeline.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation.suite import Suite, eval_root, load_suite

REFERENCE_FILE = "reference/featcal_paper.yaml"


@dataclass
class Row:
    name: str
    scores: dict[str, float | None]
    average: float | None
    source: str
    settings: str = ""
    is_reference: bool = False
    signed: bool = False  # a difference row: printed with its sign, left out of the chart


def fmt(value: float | None, decimals: int, signed: bool = False) -> str:
    """Round half up, as tables are read (62.05 -> 62.1), not half-even on binary floats."""
    if value is None:
        return "–"
    quantum = Decimal(1).scaleb(-decimals)
    text = str(Decimal(repr(value)).quantize(quantum, rounding=ROUND_HALF_UP))
    return f"+{text}" if signed and not text.startswith("-") else text


def load_summaries(paths: list[Path]) -> list[dict]:
    """Summary files, or directories holding them (`<label>.json` written by `eval`)."""
    summaries = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.glob("*.json") if p.name != "fingerprints.json")
        elif path.is_file():
            files = [path]
        else:
            raise FeatCalError(f"{path}: no such results file or directory")
        for file in files:
            try:
                data = json.loads(file.read_text())
            except ValueError:
                raise FeatCalError(f"{file}: not a JSON file") from None
            if isinstance(data, dict) and data.get("schema", "").startswith("featcal-llm/eval-summary/"):
                summaries.append(data)
            elif path.is_file():
                raise FeatCalError(f"{file}: not an evaluation summary written by `featcal_llm eval`")
    return summaries


def _settings(summary: dict) -> str:
    backend = summary["backend"]
    parts = [backend["name"], "chat" if summary["chat_template"]["applied"] else "no chat"]
    if summary.get("limit"):
        parts.append(f"limit {summary['limit']}")
    if summary.get("max_gen_toks"):
        parts.append(f"max_gen_toks {summary['max_gen_toks']}")
    return ", ".join(parts)


def summary_rows(summaries: list[dict], suite: Suite) -> list[Row]:
    rows = []
    for summary in summaries:
        if (summary["suite"]["name"], summary["suite"]["version"]) != (suite.name, suite.version):
            raise FeatCalError(
                f"{summary['label']}.json: scored with suite {summary['suite']['name']} v{summary['suite']['version']}, "
                f"not {suite.name} v{suite.version}; compare results of one suite version only"
            )
        scores = {task: summary["tasks"].get(task, {}).get("score") for task in suite.tasks}
        average = summary["average"] if summary.get("complete") else None
        rows.append(Row(summary["label"], scores, average, "this harness", _settings(summary)))
    return rows


def reference_rows(models: list[str], suite: Suite) -> list[Row]:
    """Paper rows for the named base models (`all` for every one)."""
    path = eval_root() / REFERENCE_FILE
    data = yaml.safe_load(path.read_text())
    if data["suite"] != suite.name:
        return []
    available = list(data["models"])
    wanted = available if "all" in models else models
    unknown = [m for m in wanted if m not in data["models"]]
    if unknown:
        raise FeatCalError(f"--reference: unknown model {', '.join(unknown)}; the paper has {', '.join(available)}, or all")
    rows = []
    for model in wanted:
        for entry in data["models"][model]:
            scores = dict(zip(data["columns"], entry["scores"]))
            rows.append(Row(f"{model} · {entry['method']} (paper)", {t: scores.get(t) for t in suite.tasks},
                            entry["avg"], f"paper, Table {entry['table']}", is_reference=True))
    return rows


def render_markdown(rows: list[Row], suite: Suite) -> str:
    decimals = suite.report.decimals
    header = ["Model"] + [spec.label for spec in suite.tasks.values()] + ["Avg.", "Source"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(suite.tasks) + 1) + ["---"]) + "|"]
    for row in rows:
        source = row.source + (f" ({row.settings})" if row.settings else "")
        cells = ([row.name] + [fmt(row.scores[t], decimals, row.signed) for t in suite.tasks]
                 + [fmt(row.average, decimals, row.signed), source])
        lines.append("| " + " | ".join(cells) + " |")
    metric_note = "; ".join(f"{spec.label}: {spec.metric}" for spec in suite.tasks.values())
    lines.append("")
    lines.append(f"Suite {suite.name} v{suite.version}, {suite.report.scale}, Avg. = mean of the {len(suite.tasks)} tasks "
                 f"(– when a task is missing). Metrics: {metric_note}.")
    if any(row.is_reference for row in rows):
        lines.append("Rows marked (paper) are copied from the FeatCal paper; its evaluation settings are unpublished.")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], suite: Suite, path: Path) -> None:
    decimals = suite.report.decimals
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model"] + list(suite.tasks) + ["average", "source", "settings", "reference"])
        for row in rows:
            writer.writerow([row.name] + [fmt(row.scores[t], decimals) if row.scores[t] is not None else ""
                                          for t in suite.tasks]
                            + [fmt(row.average, decimals) if row.average is not None else "", row.source,
                               row.settings, "yes" if row.is_reference else "no"])


def write_png(rows: list[Row], suite: Suite, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    columns = [spec.label for spec in suite.tasks.values()] + ["Avg."]
    x = np.arange(len(columns))
    width = 0.8 / max(1, len([row for row in rows if not row.signed]))
    figure, axes = plt.subplots(figsize=(max(8.0, 1.3 * len(columns) + 0.35 * len(rows)), 4.8), dpi=110)
    rows = [row for row in rows if not row.signed]
    for index, row in enumerate(rows):
        values = [row.scores[t] if row.scores[t] is not None else np.nan for t in suite.tasks]
        values.append(row.average if row.average is not None else np.nan)
        axes.bar(x - 0.4 + width * (index + 0.5), values, width, label=row.name,
                 hatch="//" if row.is_reference else None, edgecolor="black", linewidth=0.4)
    axes.set_xticks(x, columns)
    axes.set_ylabel("score (%)" if suite.report.scale == "percent" else "score")
    axes.set_ylim(0, 100 if suite.report.scale == "percent" else 1)
    axes.set_title(f"{suite.name} v{suite.version}")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def build_leaderboard(result_paths: list[Path], output: Path, *, references: list[str] = (),
                      suite_name: str | None = None, stem: str = "leaderboard") -> tuple[str, dict[str, Path]]:
    """Write <stem>.md, <stem>.csv and <stem>.png into `output`; return the markdown and paths."""
    summaries = load_summaries(result_paths)
    if not summaries and not references:
        raise FeatCalError(f"{', '.join(map(str, result_paths))}: no evaluation summaries found (run `eval` first)")
    if suite_name is None and summaries:
        recorded = summaries[0]["suite"]
        suite_name = recorded["path"] if Path(recorded["path"]).is_file() else recorded["name"]
    suite = load_suite(suite_name or "mergebench")
    rows = reference_rows(list(references), suite) + summary_rows(summaries, suite)
    markdown = render_markdown(rows, suite)
    output.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": output / f"{stem}.md", "csv": output / f"{stem}.csv", "png": output / f"{stem}.png"}
    paths["markdown"].write_text(markdown)
    write_csv(rows, suite, paths["csv"])
    write_png(rows, suite, paths["png"])
    return markdown, paths
