"""`featcal_weights.json`: what a run resolved, at full precision (the card rounds it), with a legend of its keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from featcal_llm import __version__
from featcal_llm.io.recipe import Recipe

WEIGHTS_FILE = "featcal_weights.json"  # the expert and token weights at full precision (the card rounds them)
# featcal_weights.json's legend: what its less obvious keys hold
ABOUT = {
    "expert_lead": "per expert, over the predictions of its calibration records: tokens_ahead, the share where it predicts "
                   "the next token better than the merged model; mean_positive_lead, the mean of max(0, log p_expert - "
                   "log p_merged) in nats (where it trails counts as 0): what its tokens' weights (token_weights: "
                   "expert_lead) came from; net_lead, the signed mean lead over its judged tokens, and net_lead_margin, "
                   "two standard errors of it counted over its records: the merge teaches its records (trailing_experts: "
                   "merge) only where net_lead + net_lead_margin <= 0; records_dropped of its records (trailing_records: "
                   "drop) weighed 0",
    "taught_by_merge": "per expert that trails the merge on its own records beyond two standard errors: its mean signed lead log p_expert - "
                       "log p_merged in nats (below 0) over its judged tokens (the responses of prompt/response records, "
                       "every token of plain and generated text); the merged model taught those records (trailing_experts: merge)",
    "teachers": "per expert whose records another expert taught (teachers: best): that expert, its mean lead log p_teacher "
                "- log p_expert in nats over the judged tokens of the coverage pass's records, and two standard errors of "
                "it counted over the records (margin); the expert_lead and taught_by_merge entries of such an expert are "
                "its teacher's lead over the merge on its records",
    "coverage_nll": "model (the base under base) -> expert whose records -> mean NLL in nats: what the coverage expert "
                    "weights came from",
    "expert_weights": "each expert's weight in the objective as the run used it",
    "made_from": "per setting the weights follow from (the featcal block's, its defaults filled in; the mergekit part's, "
                 "as written), a digest of its value: run --eval-only scores this output only under a recipe that still "
                 "says them, or one of the same settings_root",
    "settings_root": "the digest of the settings of the recipe this output's weights were first made from (the recipe's "
                     "own, or, for a run of a saved featcal_recipe.yml, the recipe it replays): run --eval-only also "
                     "scores it under a recipe of the same root",
}


def run_record(recipe: Recipe, merged: str, names: dict[str, str], hyper: dict, settings: dict[str, Any], tokens: dict[str, int], *,
               starts: dict[str, dict], models: dict[str, dict], weights: dict[str, float] | None, coverage: dict | None,
               advantage: dict[str, dict[str, float]] | None, taught: dict[str, float], unchanged: bool,
               teachers: dict[str, tuple[str, float, float]] | None = None) -> dict[str, Any]:
    """The record's content (card.write_card's arguments, resolved; `merged`: the merged model's reference; `names`:
    each model as the card shows it; `weights`: None where every expert weighs 1)."""
    featcal = recipe.featcal
    base = str(recipe.base)
    run: dict[str, Any] = {  # featcal_weights.json: what the run resolved, at full precision
        "base_model": names[base],
        "merged_model": names[merged],
        "merge_method": recipe.merge_config.merge_method,
        "method": featcal.method,
        "experts": [names[expert.name] for expert in recipe.experts],
        "hyperparameters": hyper,
        "settings": settings,
        "calibration_tokens": {names[name]: count for name, count in tokens.items()},
        **({"generation_starts": {names.get(name, name): start for name, start in starts.items()}} if starts else {}),
        **({"models": models} if models else {}),
        "featcal_llm_version": __version__,
    }
    if weights is not None:
        run["expert_weights"] = {names[name]: weight for name, weight in weights.items()}
    if coverage is not None:  # model (the base under "base") → whose records → NLL: what the coverage weights came from
        run["coverage_nll"] = {names.get(model, model): {names[task]: nll for task, nll in row.items()} for model, row in coverage.items()}
    if advantage is not None:  # expert → where it is ahead of the merge: what its tokens' weights came from
        run["expert_lead"] = {names[task]: {"tokens_ahead": summary["tokens_ahead"], "mean_positive_lead": summary["lead"],
                                            **{key: summary[key] for key in ("net_lead", "net_lead_margin", "records_dropped")
                                               if key in summary}}
                              for task, summary in advantage.items()}
    if teachers:  # expert → the expert that taught its records in its place (`teachers: best`)
        run["teachers"] = {names[task]: {"teacher": names[teacher], "lead": lead, "margin": margin}
                           for task, (teacher, lead, margin) in teachers.items()}
    if taught:  # expert → its mean signed lead over the merge on its own records (≤ 0): the merge taught those records instead
        run["taught_by_merge"] = {names[task]: lead for task, lead in taught.items()}
    if unchanged:
        run["unchanged"] = True
    if recipe.made_from is not None:
        run["made_from"] = recipe.made_from
    if recipe.settings_root is not None:
        run["settings_root"] = recipe.settings_root
    run["about"] = {key: text for key, text in ABOUT.items() if key in run}
    return run


def _json_ready(value: Any) -> Any:
    """The run record as JSON holds it: tuples as lists, anything else unknown as its text."""
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def write_run_record(directory: Path, run: dict[str, Any]) -> None:
    (directory / WEIGHTS_FILE).write_text(json.dumps(_json_ready(run), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def read_run_record(directory: Path) -> dict[str, Any]:
    """What a calibrated checkpoint's run resolved (`featcal_weights.json`, written by write_card)."""
    return json.loads((directory / WEIGHTS_FILE).read_text(encoding="utf-8"))
