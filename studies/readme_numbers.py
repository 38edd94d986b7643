"""The README's results table and docs/results.md's other settings, rendered from the studies' results files
(docs/studies/results/*.json).

Each page holds its block between `README-NUMBERS` markers; tests/test_readme_numbers.py renders them again from the
committed results and compares, so a claim cannot lag the run it came from. After rerunning a study:

    python -m studies.readme_numbers --write

The README's table shows one setting: `TABLE_FILE`. Switching it to another results file is that one constant (rows
the file lacks are left out). A row may carry 95 % intervals, `"share_ci95": [lo, hi]` and
`"nll_ci95": {"avg": [lo, hi], "<domain>": [lo, hi], ...}`; the share's and the average's are shown as
`0.62 (0.55–0.69)`.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "studies" / "results"
README = ROOT / "README.md"
RESULTS_PAGE = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- README-NUMBERS", "<!-- /README-NUMBERS -->"

# the setting the README's table shows (a file in RESULTS)
TABLE_FILE = "specialised-long-rebuilt.json"

# (row key in the results file, how the table names it); EXPERTS is no row of the file: each expert's NLL on its own
# kind of text, the merged row's minus the setting's gap. Rows the file does not have are left out.
EXPERTS = "each expert"
TABLE_ROWS = [
    ("merged", "merged model (Task Arithmetic)"),
    (EXPERTS, "each expert, on its own kind of text only"),
    ("best single expert", "best single expert, shipped alone"),
    ("featcal paper rule", "+ FeatCal, the paper's weighing (every expert and token alike)"),
    ("featcal defaults", "+ FeatCal, featcal-llm's defaults"),
    ("distill (lr by val share)", "the merge distilled toward the experts (gradient reference, its budget chosen on val files)"),
    ("featcal defaults + refine", "+ FeatCal, featcal-llm's defaults, then `refine: true`"),
    # the same recipe under the name the rebuilt setting ran it (a file with both shows the first)
    ("featcal defaults + refine, held-out drawn by position", "+ FeatCal, featcal-llm's defaults, then `refine: true`"),
    ("featcal defaults + refine, 160 steps", "+ FeatCal, featcal-llm's defaults, then `refine: {steps: 160}`"),
]

# the study page that describes each setting (absolute link from the README: PyPI renders it too)
STUDY_PAGES = {"allgap.json": "docs/studies/all-gap.md", "allgap-half.json": "docs/studies/all-gap.md",
               "allgap-half-long.json": "docs/studies/all-gap.md", "allgap-half-embeddings.json": "docs/studies/all-gap.md",
               "allgap-half-embeddings-refine.json": "docs/studies/all-gap.md"}
DOMAINS = {"code": "Python code", "prose": "Python's documentation", "c": "C headers",  # the all-gap settings
           "manpage": "roff manual pages", "changelog": "Debian changelogs", "copyright": "Debian copyright files"}  # specialised

# docs/results.md: the defaults' share in the study's other all-gap settings: (results file, how the page names the
# setting, a second row of that file to quote beside the defaults or None, how the page names that row)
OTHER_SETTINGS = [
    ("allgap-half-embeddings.json", "the same, experts that also trained their embeddings (tied to the LM head, which "
     "`head: auto` then re-fits)", "featcal defaults, head: false", "the head left merged"),
    ("allgap-half-embeddings-refine.json", "the embeddings variant built again (its text prepared and its experts trained "
     "again), `refine: true` beside the defaults", "featcal defaults + refine", "`refine: true`"),
    ("allgap-half-long.json", "the same, every expert trained three times longer", None, None),
    ("allgap.json", "weight 1 per expert: the merge worse than the base on two kinds", "featcal paper rule", "the paper's rule"),
]
OTHERS_BASE = "allgap-half.json"  # the setting the other settings are variants of
SHORT_NAMES = {"allgap-half.json": "`allgap-half`", "allgap-half-embeddings.json": "the embeddings variant",
               "allgap-half-embeddings-refine.json": "its second build",
               "allgap-half-long.json": "the long variant", "allgap.json": "weight 1"}


def repository_url() -> str:
    """The project's repository (pyproject's `Repository` URL): the README's links are absolute, for PyPI."""
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    return urls["Repository"].rstrip("/")


def absolute(path: str) -> str:
    """A file of this repository as a link that works on GitHub and on PyPI alike."""
    return f"{repository_url()}/blob/main/{path}"


def _load(results_dir: Path, file: str) -> dict:
    return json.loads((results_dir / file).read_text(encoding="utf-8"))


def _interval(value: float, ci: list[float] | None, digits: int) -> str:
    text = f"{value:.{digits}f}"
    if ci is None or f"{ci[0]:.{digits}f}" == f"{ci[1]:.{digits}f}":  # none, or nothing to say (the merge's share: 0–0)
        return text
    return f"{text} ({ci[0]:.{digits}f}–{ci[1]:.{digits}f})"


def _with_best_expert(rows: dict) -> dict:
    """The rows, with a `best single expert` row where the file has the experts' own rows (`expert:<kind>`) only."""
    experts = {key: row for key, row in rows.items() if key.startswith("expert:")}
    if "best single expert" in rows or not experts:
        return rows
    key = min(experts, key=lambda k: experts[k]["nll_avg"])
    return {**rows, "best single expert": {**experts[key], "expert": key.removeprefix("expert:")}}


def _row_cells(row: dict, domains: list[str]) -> list[str]:
    """Average NLL, NLL per domain, share of the gap; a 95 % interval beside the average and the share where the row
    has one (the per-domain intervals stay in the results file: a table of intervals in every cell reads slowly)."""
    ci = row.get("nll_ci95") or {}
    nll = [f"{row['nll'][d]:.3f}" for d in domains]
    share = row.get("share")
    shown = "–" if share is None or share < 0 else _interval(share, row.get("share_ci95"), 2)  # negative: said in words
    return [_interval(row["nll_avg"], ci.get("avg"), 3), *nll, shown]


def _experts_cells(results: dict, domains: list[str]) -> list[str]:
    merged, gap = results["rows"]["merged"]["nll"], results["setting"]["gap"]
    return ["–", *(f"{merged[d] - gap[d]:.3f}" for d in domains), "1 (by definition)"]


def render_table(results_dir: Path = RESULTS, file: str | None = None) -> str:
    """The README's block (markers excluded): the setting in one line, the table, what its numbers mean."""
    file = file or TABLE_FILE
    results = _load(results_dir, file)
    setting, rows = results["setting"], _with_best_expert(results["rows"])
    domains = list(setting["experts"])
    present = [(key, label) for key, label in TABLE_ROWS if key in rows or (key == EXPERTS and "gap" in setting and "merged" in rows)]
    shown = [(key, label) for i, (key, label) in enumerate(present) if label not in {other for _, other in present[:i]}]
    samples = (rows.get("featcal defaults", {}).get("featcal") or {}).get("samples")
    count = NUMBERS.get(len(domains), str(len(domains)))
    merge = f" at weight {setting['ta_weight']:g} each" if setting.get("ta_weight") is not None else ""
    lines = [
        f"Setting `{setting['name']}` ([results]({absolute(f'docs/studies/results/{file}')}), [study]({absolute(study_page(file))})): "
        f"{(setting.get('model') or 'a base model').split(' ')[0]} and {count} experts fine-tuned from it on "
        + ", ".join(f"{DOMAINS.get(d, d)} (`{d}`)" for d in domains)
        + f", merged with mergekit's Task Arithmetic{merge}; "
        + (f"{samples} unlabelled calibration records per expert." if samples else "unlabelled calibration records per expert."),
        "",
        "| model | average NLL | " + " | ".join(f"{d} NLL" for d in domains) + " | share of the gap |",
        "|---|" + "---:|" * (len(domains) + 2),
    ]
    for key, label in shown:
        if key == EXPERTS:
            cells = _experts_cells(results, domains)
        else:
            row = rows[key]
            cells = _row_cells(row, domains)
            label += f" ({row['expert']})" if row.get("expert") else ""
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(_meaning({**results, "rows": rows}, shown))
    return "\n".join(lines)


NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five"}


def study_page(file: str) -> str:
    """The study page of a results file: STUDY_PAGES, else docs/studies/<its name>.md or <its first word>.md, else
    docs/results.md."""
    stem = Path(file).stem
    for page in [STUDY_PAGES.get(file), f"docs/studies/{stem}.md", f"docs/studies/{stem.split('-')[0]}.md"]:
        if page and (ROOT / page).is_file():
            return page
    return "docs/results.md"


def _meaning(results: dict, shown: list[tuple[str, str]]) -> str:
    """What the numbers are, in words: lower is better; what the share's 0, 1 and above 1 mean; the intervals."""
    rows = results["rows"]
    text = ("NLL: negative log-likelihood on held-out text of each kind, nats per token, **lower is better**. *Share of "
            "the gap*: how much of the experts' lead over the merge on their own kinds the model wins back (summed over "
            "the kinds): 0 is the merge, 1 is as good as each expert on its own kind, **above 1 is better than the "
            "experts on their own kinds**.")
    if any(key in rows and (rows[key].get("share") or 0) < 0 for key, _ in shown):
        text += " A single expert has none (–): it is worse than the merge on the other kinds."
    if any(key in rows and (rows[key].get("share_ci95") or rows[key].get("nll_ci95")) for key, _ in shown):
        over = (results["setting"].get("bootstrap") or {}).get("over")
        how = results["setting"].get("ci_method") or (f"bootstrap over {over}" if over else None)
        text += " In brackets: 95 % intervals of the average and of the share" + (f" ({how})." if how else ".")
    else:
        text += " One run per row; no uncertainty was measured."
    return text


def render_others(results_dir: Path = RESULTS) -> str:
    """docs/results.md's block (markers excluded): the defaults' share in each all-gap setting, and which of those rows
    today's `trailing_experts:` default gives."""
    base = _load(results_dir, OTHERS_BASE)
    others = [_load(results_dir, file) for file, *_ in OTHER_SETTINGS]
    domains = list(base["setting"]["experts"])
    lines = [f"| setting | experts' leads over the merge ({' / '.join(domains)}, nats a token) | share, the defaults | beside it |",
             "|---|---|---:|---|"]
    named = [(base, "`allgap-half`, the earlier setting: Task Arithmetic ½, embeddings frozen", "featcal paper rule", "the paper's rule"),
             *((results, *rest) for results, (_, *rest) in zip(others, OTHER_SETTINGS))]
    for results, label, beside, beside_label in named:
        row = results["rows"]["featcal defaults"]
        gap = results["setting"]["gap"]
        other = f"{beside_label}: {results['rows'][beside]['share']:.2f}" if beside else ""
        lines.append(f"| {label} | {' / '.join(f'{gap[d]:.3f}' for d in domains)} | {row['share']:.2f} | {other} |")
    ran_with = _ran_with([base, *others])
    return "\n".join(lines) + ("\n\n" + ran_with.strip() if ran_with else "")


def _ran_with(results: list[dict]) -> str:
    """Which defaults' rows today's `trailing_experts:` default is known to give: rows run with it, or with `keep` where
    every expert leads the merge on its calibration records (`record_leads`; the same run, bit for bit)."""
    from featcal_llm.io.block import FeatCalConfig

    today = FeatCalConfig.model_fields["trailing_experts"].json_schema_extra["shown_default"].split("`")[1]
    rows = [r["rows"]["featcal defaults"] for r in results]
    if all(row["featcal_effective"].get("trailing_experts", "keep") == today for row in rows):
        return ""
    named = [SHORT_NAMES[OTHERS_BASE], *(SHORT_NAMES[file] for file, *_ in OTHER_SETTINGS)]
    known = [f"{name} ({' / '.join(f'{lead:.3f}' for lead in row['record_leads'].values())})"
             for name, row in zip(named, rows) if row.get("record_leads") and min(row["record_leads"].values()) > 0]
    unknown = [name for name, row in zip(named, rows) if not row.get("record_leads")]
    return (f" Today's `trailing_experts: {today}` lets the merge teach the records of an expert that trails it on them, and "
            "gives the same run, bit for bit, where every expert leads the merge on its own calibration records, as in "
            + " and in ".join(known) + " (nats a token, code / prose / c)"
            + (f"; the rows of {' and '.join(unknown)} ran with `trailing_experts: keep`, the default then, and did not log those "
               "leads" if unknown else "") + ".")


# docs/costs.md: what `featcal-llm validate` plans for the paper's shape (the fields of each model's config.json
# the plan reads), so that the page cannot say other than validate does
PLAN_MODELS = {
    "SmolLM2-135M": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "num_hidden_layers": 30, "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    "Llama-3.2-3B": {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24, "num_key_value_heads": 8,
                     "head_dim": 128, "num_hidden_layers": 28, "vocab_size": 128256, "tie_word_embeddings": True,
                     "torch_dtype": "bfloat16"},
    "Llama-3.1-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "head_dim": 128, "num_hidden_layers": 32, "vocab_size": 128256, "tie_word_embeddings": False,
                     "torch_dtype": "bfloat16"},
}
PLAN_EXPERTS, PLAN_HOST_MEMORY_GB = 3, 64  # three experts; the default RAM budget of a 128 GB host


def plan_block(experts: int = PLAN_EXPERTS) -> dict:
    """The `featcal:` block the plan is made for: the defaults (256 records × 2048 tokens per expert), one GPU."""
    from featcal_llm.io.block import FeatCalConfig

    data = {f"expert{i}": {"path": f"expert{i}.jsonl", "format": "text"} for i in range(experts)}
    return FeatCalConfig.model_validate({"merged": "merged", "output": "output", "data": data, "host_memory_gb": PLAN_HOST_MEMORY_GB})


def render_costs(_results_dir: Path = RESULTS) -> str:
    """docs/costs.md's block (markers excluded): validate's memory plan for each model in PLAN_MODELS."""
    from featcal_llm.benchmark.estimate import memory_plan, size_text

    block = plan_block()
    lines = ["| model | parameters | GPU memory | host RAM | disk the run writes | disk it reads (base and experts) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, config in PLAN_MODELS.items():
        plan = memory_plan(config, block, PLAN_EXPERTS, merged_exists=False)
        spill = f" ({size_text(plan.spilled_bytes)} spilled hidden states)" if plan.spilled_bytes else ""
        lines.append(f"| {name} | {plan.parameters / 1e9:.2f} B | {size_text(plan.gpu_bytes)} | {size_text(plan.host_bytes)} | "
                     f"{size_text(plan.disk_bytes)}{spill} | {size_text(plan.inputs_bytes)} |")
    return "\n".join(lines)


# page -> what renders its block
TARGETS = {README: render_table, RESULTS_PAGE: render_others, ROOT / "docs" / "costs.md": render_costs}


def render(results_dir: Path = RESULTS) -> str:
    """The README's block (kept for callers that render the table alone)."""
    return render_table(results_dir)


def _block_match(text: str, page: Path) -> re.Match:
    match = re.search(re.escape(BEGIN) + r".*?-->\n(.*?)\n?" + re.escape(END), text, re.S)
    if match is None:
        raise ValueError(f"{page}: no {BEGIN} … {END} block")
    return match


def readme_block(text: str, page: Path = README) -> str:
    """What a page holds between its markers (the opening marker's comment line excluded)."""
    return _block_match(text, page).group(1)


def write(pages: dict[Path, object] | None = None, results_dir: Path = RESULTS) -> None:
    """Rewrite each page's block in place (an empty block is filled)."""
    for page, renderer in (pages or TARGETS).items():
        text = page.read_text(encoding="utf-8")
        match = _block_match(text, page)
        start, end = match.span(1)
        page.write_text(text[:start] + renderer(results_dir) + "\n" + text[end:].lstrip("\n"), encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's and docs/results.md's blocks in place")
    args = parser.parse_args()
    if args.write:
        write()
    else:
        for page, renderer in TARGETS.items():
            print(f"--- {page.relative_to(ROOT)}\n{renderer()}")
