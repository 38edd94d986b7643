"""The README's results table, rendered from the studies' results files (docs/studies/results/*.json).

The README holds this table between its `README-NUMBERS` markers; tests/test_readme_numbers.py renders it again
from the committed results and compares, so a claim cannot lag the run it came from. After rerunning a study:

    python -m studies.readme_numbers --write
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "studies" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- README-NUMBERS", "<!-- /README-NUMBERS -->"

DOMAINS = {"code": "Python code (`code`)", "prose": "Python's documentation (`prose`)", "c": "C headers (`c`)"}

# (results file, row in it, what the README calls it)
ROWS = [
    ("allgap-half.json", "merged", "merged (Task Arithmetic)"),
    ("allgap-half.json", "best single expert", "best single expert"),
    ("allgap-half.json", "featcal paper rule", "+ FeatCal, the paper's weights (every expert and token alike)"),
    ("allgap-half.json", "featcal defaults", "+ FeatCal, featcal-llm defaults"),
]
# the defaults' share in the study's other all-gap settings: (results file, how the README names the setting,
# a second row of that file to quote beside the defaults or None, how the README names that row)
OTHER_SETTINGS = [
    ("allgap-half-embeddings.json", "the same at weight ½ with experts that also trained their embeddings, which SmolLM2 "
     "ties to its LM head, so that `head: auto` re-fits the head", "featcal defaults, head: false", "the head left merged"),
    ("allgap-half-long.json", "the same at weight ½ with every expert trained three times longer", None, None),
    ("allgap.json", "weight 1 per expert, where the merge interferes so badly that it is worse than the base on two domains",
     None, None),
]

SHORT_NAMES = {"allgap-half-embeddings.json": "the embeddings variant", "allgap-half-long.json": "the long variant",
               "allgap.json": "weight 1"}


def _cell(row: dict, domains: list[str]) -> list[str]:
    nll = [f"{row['nll'][d]:.3f}" for d in domains]
    share = "" if row.get("share") is None else f"{row['share']:.2f}"
    return [f"{row['nll_avg']:.3f}", *nll, share]


def render(results_dir: Path = RESULTS) -> str:
    """The markdown block the README carries between its markers (markers excluded)."""
    loaded: dict[str, dict] = {}
    lines: list[str] = []
    for file, key, label in ROWS:
        results = loaded.setdefault(file, json.loads((results_dir / file).read_text(encoding="utf-8")))
        if key not in results["rows"]:
            continue
        domains = list(results["setting"]["experts"])
        if not lines:
            setting = results["setting"]
            lines.append(f"Setting `{setting['name']}` ([{file}](docs/studies/results/{file}), [docs/studies/all-gap.md](docs/studies/all-gap.md)): "
                         "SmolLM2-135M-Instruct; three experts fine-tuned (decoder layers and final norm; embeddings frozen) on "
                         + ", ".join(DOMAINS.get(d, d) for d in domains) + f"; mergekit Task Arithmetic, weight {setting['ta_weight']:g} per expert; "
                         f"{results['rows']['featcal defaults']['featcal']['samples']} unlabelled records per expert; "
                         "held-out NLL in nats per token (lower is better); *recovered*: Σ over domains of (merge − model) / "
                         "Σ of (merge − expert), the ratio of sums.")
            lines.append("")
            lines.append("| model | average NLL | " + " | ".join(f"{d} NLL" for d in domains) + " | recovered |")
            lines.append("|---|" + "---:|" * (len(domains) + 2))
        row = results["rows"][key]
        name = label + (f" ({row['expert']})" if row.get("expert") else "")
        lines.append(f"| {name} | " + " | ".join(_cell(row, domains)) + " |")
    lines.append("")
    others = [json.loads((results_dir / file).read_text(encoding="utf-8")) for file, *_ in OTHER_SETTINGS]
    lines.append("The experts lead this merge on their own text by " + _leads(loaded[ROWS[0][0]]) + ". The defaults in the study's other "
                 "all-gap settings: " + "; ".join(_other(results, *named) for results, (_, *named) in zip(others, OTHER_SETTINGS)) + "."
                 + _ran_with([loaded[ROWS[-1][0]], *others]))
    return "\n".join(lines)


def _ran_with(results: list[dict]) -> str:
    """Which defaults' rows today's `trailing_experts:` default is known to give: rows run with it, or with `keep` where
    every expert leads the merge on its calibration records (`record_leads`; the same run, bit for bit)."""
    from featcal_llm.io.block import FeatCalConfig

    today = FeatCalConfig.model_fields["trailing_experts"].json_schema_extra["shown_default"].split("`")[1]
    rows = [r["rows"]["featcal defaults"] for r in results]
    if all(row["featcal_effective"].get("trailing_experts", "keep") == today for row in rows):
        return ""
    named = ["this table's setting", *(SHORT_NAMES[file] for file, *_ in OTHER_SETTINGS)]
    known = [f"{name} ({' / '.join(f'{lead:.3f}' for lead in row['record_leads'].values())})"
             for name, row in zip(named, rows) if row.get("record_leads") and min(row["record_leads"].values()) > 0]
    unknown = [name for name, row in zip(named, rows) if not row.get("record_leads")]
    return (f" Today's `trailing_experts: {today}` lets the merge teach the records of an expert that trails it on them, and "
            "gives the same run, bit for bit, where every expert leads the merge on its own calibration records, as in "
            + " and in ".join(known) + " (nats a token, code / prose / c)"
            + (f"; the rows of {' and '.join(unknown)} ran with `trailing_experts: keep`, the default then, and did not log those "
               "leads" if unknown else "") + ".")


def _leads(results: dict) -> str:
    gap = results["setting"]["gap"]
    return ", ".join(f"{gap[d]:.3f} ({d})" for d in results["setting"]["experts"]) + " nats a token"


def _other(results: dict, label: str, beside: str | None, beside_label: str | None) -> str:
    row = results["rows"]["featcal defaults"]
    text = f"{label} (leads {_leads(results)}): recovered {row['share']:.2f}"
    return text if beside is None else text + f" ({beside_label}: {results['rows'][beside]['share']:.2f})"


def readme_block(text: str) -> str:
    """What the README holds between its markers (the opening marker's comment line excluded)."""
    match = re.search(re.escape(BEGIN) + r".*?-->\n(.*?)\n" + re.escape(END), text, re.S)
    if match is None:
        raise ValueError(f"{README}: no {BEGIN} … {END} block")
    return match.group(1)


def write(readme: Path = README) -> None:
    text = readme.read_text(encoding="utf-8")
    block = readme_block(text)
    readme.write_text(text.replace(block, render(), 1), encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's block in place")
    args = parser.parse_args()
    if args.write:
        write()
    else:
        print(render())
