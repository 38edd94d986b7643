"""Model summaries -> a Table-4-style markdown table, a CSV and a PNG bar chart.

Rows are models, columns the suite's tasks and their unweighted average, in percent with the
suite's decimals. Paper rows can be added; they are labelled "(paper)" and kept apart in the
chart (hatched), since they were not produced by this pipeline.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import uncertainty
from featcal_llm.evaluation.suite import SHIPPED, Suite, load_suite

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
    stderr: dict[str, float | None] = field(default_factory=dict)  # task or "average" -> standard error
    intervals: dict[str, uncertainty.Comparison] = field(default_factory=dict)  # difference rows


def fmt(value: float | None, decimals: int, signed: bool = False) -> str:
    """Round half up, as tables are read (62.05 -> 62.1), not half-even on binary floats."""
    if value is None:
        return "–"
    quantum = Decimal(1).scaleb(-decimals)
    text = str(Decimal(repr(value)).quantize(quantum, rounding=ROUND_HALF_UP))
    return f"+{text}" if signed and not text.startswith("-") else text


SUMMARY_KEYS = {"label": str, "model": dict, "suite": dict, "tasks": dict, "backend": dict, "chat_template": dict}


def load_summaries(paths: list[Path]) -> list[dict]:
    """Summary files, or directories holding them (`<label>.json` written by `eval`), each read once; a label that
    two results folders share (the 3B and the 8B runs' `merged`, say) is told apart by its folder's shortest distinct tail
    (`3b`, or `3b/eval-results` beside `8b/eval-results`), and two in one folder by their files' names."""
    summaries, seen = [], set()
    for path in paths:
        if path.is_dir():
            files = sorted(path.glob("*.json"))  # those that are no summary are passed over
        elif path.is_file():
            files = [path]
        else:
            raise FeatCalError(f"{path}: no such results file or directory")
        for file in files:
            if file.resolve() in seen:
                continue
            seen.add(file.resolve())
            try:
                data = json.loads(file.read_text())
            except ValueError:
                raise FeatCalError(f"{file}: not a JSON file") from None
            if isinstance(data, dict) and str(data.get("schema", "")).startswith("featcal-llm/eval-summary/"):
                wrong = [key for key, kind in SUMMARY_KEYS.items() if not isinstance(data.get(key), kind)]
                wrong += _damaged_tasks(data["tasks"]) if "tasks" not in wrong else []
                if wrong or not {"name", "version"} <= set(data["suite"]):
                    raise FeatCalError(f"{file}: an evaluation summary without {', '.join(wrong) or 'suite.name, suite.version'} "
                                       "(damaged, or written by another featcal-llm release; score the model again)")
                data["_dir"], data["_file"] = str(file.parent), str(file)
                summaries.append(data)
            elif path.is_file():
                raise FeatCalError(f"{file}: not an evaluation summary written by `featcal_llm eval`")
    from featcal_llm.io.names import short_names

    labels = [summary["label"] for summary in summaries]
    folders = short_names(sorted({summary["_dir"] for summary in summaries}))  # `3b/eval-results`, not the whole path
    for summary in summaries:
        if labels.count(summary["label"]) > 1:
            summary["label"] = f"{summary['label']} ({folders[summary['_dir']]})"
    labels = [summary["label"] for summary in summaries]
    for summary in summaries:  # one folder, two summaries of one label (a file copied or renamed): told by its file
        if labels.count(summary["label"]) > 1:
            summary["label"] = f"{summary['label'].rpartition(' (')[0]} ({folders[summary['_dir']]}/{Path(summary['_file']).name})"
    return summaries


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _damaged_tasks(tasks: dict) -> list[str]:
    """The task entries a table cannot read: not a mapping, or a score or standard error that is not a number."""
    wrong = []
    for task, entry in tasks.items():
        if not isinstance(entry, dict):
            wrong.append(f"tasks.{task} as a mapping")
            continue
        wrong += [f"a number at tasks.{task}.{key}" for key in ("score", "stderr") if entry.get(key) is not None and not _number(entry[key])]
    return wrong


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
                f"{summary.get('_file', summary['label'] + '.json')}: scored with suite {summary['suite']['name']} v{summary['suite']['version']}, "
                f"not {suite.name} v{suite.version}; compare results of one suite version only"
            )
        scores = {task: summary["tasks"].get(task, {}).get("score") for task in suite.tasks}
        average = summary["average"] if summary.get("complete") else None
        errors = {task: summary["tasks"].get(task, {}).get("stderr") for task in suite.tasks}
        if average is not None and all(e is not None for e in errors.values()):
            errors["average"] = math.sqrt(sum(e * e for e in errors.values())) / len(errors)
        rows.append(Row(summary["label"], scores, average, "this harness", _settings(summary), stderr=errors))
    return rows


def _items(summary: dict, task: str) -> dict[int, float] | None:
    entry = summary["tasks"].get(task)
    if not entry:
        return None
    if not isinstance(entry.get("samples"), str) or not isinstance(entry.get("metric"), str):
        raise FeatCalError(f"{summary.get('_file', summary['label'] + '.json')}: tasks.{task} names no samples file and "
                           "metric, so --compare has no items to pair (damaged, or written by another featcal-llm "
                           "release; score the model again)")
    samples = Path(summary.get("_dir", ".")) / entry["samples"]
    return uncertainty.per_item_scores(samples, entry["metric"]) if samples.is_file() else None


def comparison_row(base: dict, other: dict, suite: Suite, name: str | None = None) -> Row:
    """`other` − `base` per task and on average, with paired-bootstrap intervals and McNemar p."""
    scale = 100.0 if suite.report.scale == "percent" else 1.0
    scores, intervals, pairs = {}, {}, []
    for task in suite.tasks:
        a, b = _items(base, task), _items(other, task)
        result = uncertainty.compare([uncertainty.paired(a, b)]) if a and b else None
        if result is None:
            scores[task] = None
            continue
        pairs.append(uncertainty.paired(a, b))
        intervals[task] = replace(result, delta=result.delta * scale, low=result.low * scale, high=result.high * scale)
        scores[task] = intervals[task].delta
    average = None
    if len(pairs) == len(suite.tasks):
        result = uncertainty.compare(pairs)
        intervals["average"] = replace(result, delta=result.delta * scale, low=result.low * scale, high=result.high * scale)
        average = intervals["average"].delta
    return Row(name or f"Δ {other['label']} − {base['label']}", scores, average, "", signed=True, intervals=intervals)


def reference_rows(models: list[str], suite: Suite, key: str = "--reference") -> list[Row]:
    """Paper rows for the named base models (`all` for every one); an unknown one is an error naming `key`."""
    if not models:
        return []
    path = SHIPPED / REFERENCE_FILE  # the paper's rows ship with the package
    data = yaml.safe_load(path.read_text())
    if data["suite"] != suite.name:
        raise FeatCalError(f"{key}: the paper's rows are scored on suite {data['suite']}, not {suite.name}; "
                           f"compare with them on suite {data['suite']}")
    available = list(data["models"])
    wanted = available if "all" in models else models
    unknown = [m for m in wanted if m not in data["models"]]
    if unknown:
        raise FeatCalError(f"{key}: unknown model {', '.join(unknown)}; the paper has {', '.join(available)}, or all")
    rows = []
    for model in wanted:
        for entry in data["models"][model]:
            scores = dict(zip(data["columns"], entry["scores"]))
            rows.append(Row(f"{model} · {entry['method']} (paper)", {t: scores.get(t) for t in suite.tasks},
                            entry["avg"], f"paper, Table {entry['table']}", is_reference=True))
    return rows


def _cell(row: Row, key: str, value: float | None, decimals: int) -> str:
    text = fmt(value, decimals, row.signed)
    if value is None:
        return text
    if row.signed and key in row.intervals:
        interval = row.intervals[key]
        return f"{text} [{fmt(interval.low, decimals, True)}, {fmt(interval.high, decimals, True)}]"
    if row.stderr.get(key) is not None:
        return f"{text} ±{fmt(row.stderr[key], decimals)}"
    return text


def render_markdown(rows: list[Row], suite: Suite) -> str:
    decimals = suite.report.decimals
    header = ["Model"] + [spec.label for spec in suite.tasks.values()] + ["Avg.", "Source"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(suite.tasks) + 1) + ["---"]) + "|"]
    for row in rows:
        source = row.source + (f" ({row.settings})" if row.settings else "")
        cells = ([row.name] + [_cell(row, t, row.scores[t], decimals) for t in suite.tasks]
                 + [_cell(row, "average", row.average, decimals), source])
        lines.append("| " + " | ".join(cells) + " |")
    metric_note = "; ".join(f"{spec.label}: {spec.metric}" for spec in suite.tasks.values())
    lines.append("")
    lines.append(f"Suite {suite.name} v{suite.version}, {suite.report.scale}, Avg. = mean of the {len(suite.tasks)} tasks "
                 f"(– when a task is missing). Metrics: {metric_note}.")
    if any(row.stderr for row in rows):
        lines.append("± is one standard error over the items (a 95% interval is about ±2 of them).")
    for row in rows:
        if row.signed and row.intervals:
            p_values = ", ".join(f"{suite.tasks[t].label} {row.intervals[t].p_mcnemar:.3g}" for t in suite.tasks
                                 if t in row.intervals and row.intervals[t].p_mcnemar is not None)
            lines.append(f"{row.name}: mean paired difference [{uncertainty.CONFIDENCE:.0%} paired-bootstrap interval, "
                         f"{uncertainty.ITERATIONS:,} resamples of the items, seed {uncertainty.SEED}]"
                         + (f"; McNemar exact p: {p_values}" if p_values else "") + ".")
    if any(row.source.startswith("normalized") for row in rows):
        lines.append("Rows '÷ expert' are MergeBench's normalized score: the model's score as a percentage of the "
                     "expert's on that expert's task; Avg. over the tasks that have an expert.")
    if any(row.is_reference for row in rows):
        lines.append("Rows marked (paper) are copied from the FeatCal paper; its evaluation settings are unpublished.")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], suite: Suite, path: Path) -> None:
    """One row per model; scores, then the source, then per task (and average) the standard error
    or, for difference rows, the interval and McNemar's p."""
    decimals = suite.report.decimals
    keys = list(suite.tasks) + ["average"]

    def number(value: float | None, places: int = decimals) -> str:
        return fmt(value, places) if value is not None else ""

    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model"] + list(suite.tasks) + ["average", "source", "settings", "reference"]
                        + [f"{k}_{part}" for k in keys for part in ("stderr", "ci_low", "ci_high", "p_mcnemar")])
        for row in rows:
            extra = []
            for key in keys:
                interval = row.intervals.get(key)
                extra += [number(row.stderr.get(key)), number(interval.low if interval else None),
                          number(interval.high if interval else None),
                          f"{interval.p_mcnemar:.4g}" if interval and interval.p_mcnemar is not None else ""]
            writer.writerow([row.name] + [number(row.scores[t]) for t in suite.tasks]
                            + [number(row.average), row.source, row.settings, "yes" if row.is_reference else "no"] + extra)


def write_png(rows: list[Row], suite: Suite, path: Path) -> None:
    """Bars per model with 95% error bars (±1.96 standard errors); difference rows in a second
    panel with their paired-bootstrap intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    keys = list(suite.tasks) + ["average"]
    columns = [spec.label for spec in suite.tasks.values()] + ["Avg."]
    x = np.arange(len(columns))
    models = [row for row in rows if not row.signed]
    deltas = [row for row in rows if row.signed]
    height = 4.8 + (2.6 if deltas else 0.0)
    figure, panels = plt.subplots(2 if deltas else 1, 1, squeeze=False, dpi=110,
                                  figsize=(max(8.0, 1.3 * len(columns) + 0.35 * len(rows)), height),
                                  gridspec_kw={"height_ratios": [3, 1.6]} if deltas else None)
    axes = panels[0][0]

    def value(row: Row, key: str) -> float:
        found = row.average if key == "average" else row.scores[key]
        return found if found is not None else np.nan

    width = 0.8 / max(1, len(models))
    for index, row in enumerate(models):
        errors = [1.96 * row.stderr[k] if row.stderr.get(k) is not None else 0.0 for k in keys]
        axes.bar(x - 0.4 + width * (index + 0.5), [value(row, k) for k in keys], width, label=row.name,
                 yerr=errors if any(errors) else None, capsize=2, error_kw={"linewidth": 0.8},
                 hatch="//" if row.is_reference else None, edgecolor="black", linewidth=0.4)
    axes.set_xticks(x, columns)
    axes.set_ylabel("score (%)" if suite.report.scale == "percent" else "score")
    axes.set_ylim(0, 100 if suite.report.scale == "percent" else 1)
    axes.set_title(f"{suite.name} v{suite.version} (error bars: 95%)")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if deltas:
        lower = panels[1][0]
        width = 0.8 / len(deltas)
        for index, row in enumerate(deltas):
            centers = [value(row, k) for k in keys]
            spans = np.array([[c - row.intervals[k].low, row.intervals[k].high - c] if k in row.intervals else [0, 0]
                              for k, c in zip(keys, centers)]).T
            lower.bar(x - 0.4 + width * (index + 0.5), centers, width, yerr=spans, capsize=2, label=row.name,
                      edgecolor="black", linewidth=0.4, error_kw={"linewidth": 0.8})
        lower.axhline(0, color="black", linewidth=0.6)
        lower.set_xticks(x, columns)
        lower.set_ylabel("difference")
        lower.set_title(f"paired differences, {uncertainty.CONFIDENCE:.0%} bootstrap intervals", fontsize=9)
        lower.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def normalized_rows(rows: list[Row], experts: dict[str, str], suite: Suite) -> list[Row]:
    """MergeBench's normalized score: each model's score ÷ the expert's score on the expert's task
    (in percent), averaged over the tasks that have an expert."""
    by_name = {row.name: row for row in rows}
    unknown = sorted({label for label in experts.values() if label not in by_name})
    if unknown or set(experts) - set(suite.tasks):
        raise FeatCalError(f"--expert: expected TASK=LABEL with a task of {suite.name} and a scored model "
                           f"({', '.join(unknown or sorted(set(experts) - set(suite.tasks)))} not found)")
    normalized = []
    for row in rows:
        if row.is_reference or row.signed or row.name in experts.values():
            continue
        scores = {}
        for task in suite.tasks:
            expert = by_name[experts[task]].scores.get(task) if task in experts else None
            own = row.scores.get(task)
            scores[task] = 100.0 * own / expert if own is not None and expert else None
        present = [scores[t] for t in experts]
        average = sum(present) / len(present) if present and None not in present else None
        normalized.append(Row(f"{row.name} ÷ expert", scores, average, "normalized (MergeBench)", row.settings))
    return normalized


def build_leaderboard(result_paths: list[Path], output: Path, *, references: list[str] = (),
                      suite_name: str | None = None, stem: str = "leaderboard",
                      comparisons: list[tuple[str, str]] = (), experts: dict[str, str] | None = None,
                      ) -> tuple[str, dict[str, Path]]:
    """Write <stem>.md, <stem>.csv and <stem>.png into `output`; return the markdown and paths.
    `comparisons`: (base label, other label) pairs shown as difference rows with intervals;
    `experts`: task -> expert label, for MergeBench's normalized rows."""
    summaries = load_summaries(result_paths)
    if not summaries and not references:
        raise FeatCalError(f"{', '.join(map(str, result_paths))}: no evaluation summaries found (run `eval` first)")
    if suite_name is None and summaries:
        recorded = summaries[0]["suite"]
        suite_name = recorded["path"] if Path(recorded["path"]).is_file() else recorded["name"]
    suite = load_suite(suite_name or "mergebench")
    ours = summary_rows(summaries, suite)
    by_label = {summary["label"]: summary for summary in summaries}
    deltas = []
    for base, other in comparisons:
        missing = [label for label in (base, other) if label not in by_label]
        if missing:
            raise FeatCalError(f"--compare {base}:{other}: no summary labelled {', '.join(missing)} "
                               f"(have {', '.join(by_label)})")
        deltas.append(comparison_row(by_label[base], by_label[other], suite))
    normalized = normalized_rows(ours, experts, suite) if experts else []
    rows = reference_rows(list(references), suite) + ours + normalized + deltas
    markdown = render_markdown(rows, suite)
    paths = {"markdown": output / f"{stem}.md", "csv": output / f"{stem}.csv", "png": output / f"{stem}.png"}
    taken = [path for path in paths.values() if path.exists() and not path.is_file()]
    if taken:
        raise FeatCalError(f"{taken[0]}: not a file the leaderboard can replace; remove it or pass another --name")
    output.mkdir(parents=True, exist_ok=True)
    drafts = {key: path.with_name(f".{path.stem}.draft{path.suffix}") for key, path in paths.items()}  # the suffix
    try:  # tells matplotlib the format; all three written, then each put in place: no table without its chart
        drafts["markdown"].write_text(markdown)
        write_csv(rows, suite, drafts["csv"])
        write_png([row for row in rows if row not in normalized], suite, drafts["png"])
        for key, draft in drafts.items():
            draft.replace(paths[key])
    finally:
        for draft in drafts.values():
            draft.unlink(missing_ok=True)
    return markdown, paths
