"""The model card's Hub metadata: what the Hub reads from the front matter of a merge's README.md.

As mergekit's own card does, every hub model the recipe used is listed under `base_model` (the base and
the experts, adapters included), with `base_model_relation: merge` so that the Hub draws the lineage as a
merge. The licence is the recipe's `featcal.license`, else the base model's where its card is on this
machine; calibration datasets given as hub ids are listed under `datasets`. Keys and values follow
huggingface_hub's `ModelCardData`, which the tests parse the card with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.io.block import beside_recipe
from featcal_llm.io.recipe import Recipe
from featcal_llm.io.references import hub_id

TAGS = ["merge", "mergekit", "featcal"]
PAPER_URL = "https://github.com/egangu/featcal"  # the paper's code page, which links the paper
CITATION = f"""@misc{{gu2026featcal,
  title  = {{FeatCal: Feature Calibration for Post-Merging Models}},
  author = {{Gu, Yanggan and Cai, Shuo and Wang, Zihao and Wang, Wenjun and others}},
  year   = {{2026}},
  url    = {{{PAPER_URL}}}
}}"""


def hub_models(recipe: Recipe) -> list[str]:
    """Every hub model the recipe used (base first, then the experts; a LoRA adapter's repository too), once each."""
    found: list[str] = []
    for reference in [recipe.base, *(expert.reference for expert in recipe.experts)]:
        for part in (reference.model, reference.lora) if reference is not None else ():
            repo = hub_id(part.path) if part is not None else None
            if repo is not None and repo not in found:
                found.append(repo)
    return found


def hub_datasets(recipe: Recipe) -> list[str]:
    """The hub dataset ids the experts' calibration texts came from (generated texts have none)."""
    found: list[str] = []
    for spec in recipe.featcal.data.values():
        if spec.path is None or beside_recipe(spec.path, recipe.path.parent).exists():
            continue
        repo = hub_id(spec.path)
        if repo is not None and repo not in found:
            found.append(repo)
    return found


def base_license(recipe: Recipe, base_directory: Path | None) -> dict[str, str]:
    """The base model's licence keys (`license`, and `license_name`/`license_link` for `other`) from its card on this machine."""
    card = _local_card(recipe, base_directory)
    if card is None:
        return {}
    try:
        from huggingface_hub import ModelCard

        data = ModelCard.load(card).data
    except Exception:  # an unreadable card tells nothing about the licence
        return {}
    licence = getattr(data, "license", None)
    if not isinstance(licence, str) or not licence:
        return {}
    keys = {"license": licence}
    for key in ("license_name", "license_link"):
        value = data.to_dict().get(key) if licence == "other" else None
        if isinstance(value, str):
            keys[key] = value
    return keys


def _local_card(recipe: Recipe, base_directory: Path | None) -> Path | None:
    """The base model's README.md: in its directory (a local model or a downloaded snapshot), else in the Hub cache."""
    candidates = [base_directory] if base_directory is not None else []
    if recipe.base is not None:
        candidates.append(Path(recipe.base.model.path))
    for directory in candidates:
        if (directory / "README.md").is_file():
            return directory / "README.md"
    repo = hub_id(recipe.base.model.path) if recipe.base is not None else None
    if repo is None:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo, "README.md", revision=recipe.base.model.revision)
    except Exception:
        return None
    return Path(cached) if isinstance(cached, str) else None


def rounded(value: Any) -> Any:
    """Floats to 4 decimals (4 significant digits below 1e-3, so that 1e-5 stays 1e-5), inside dicts and lists too."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float):
        if value == 0 or abs(value) >= 1e-3 or value != value:
            return round(value, 4)
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(item) for item in value]
    return value


def hub_front_matter(recipe: Recipe, base_directory: Path | None) -> dict[str, Any]:
    """The Hub's keys, in the order the Hub's own cards write them."""
    front: dict[str, Any] = {}
    models = hub_models(recipe)
    if models:
        front["base_model"] = models
        front["base_model_relation"] = "merge"
    licence = {"license": recipe.featcal.license} if recipe.featcal.license else base_license(recipe, base_directory)
    front.update(licence)
    datasets = hub_datasets(recipe)
    if datasets:
        front["datasets"] = datasets
    front.update(pipeline_tag="text-generation", library_name="transformers", tags=list(TAGS))
    return front


def model_index(name: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The Hub's `model-index` for one model's evaluation summary (evaluation.runner's `<label>.json`): one result per
    scored task, its score as the suite reports it (percent for MergeBench), through huggingface_hub's own writer;
    none for a run with `limit` or `max_gen_toks` set (a smoke run, whose scores the table still shows)."""
    from huggingface_hub import EvalResult
    from huggingface_hub.repocard_data import eval_results_to_model_index

    if summary.get("limit") or summary.get("max_gen_toks"):  # a smoke run's scores are no model's results
        return []
    suite = summary.get("suite", {})
    results = [
        EvalResult(task_type="text-generation", task_name="Text Generation", dataset_type=task, dataset_name=entry.get("label", task),
                   metric_type=str(entry["metric"]).split(",")[0], metric_value=round(float(entry["score"]), 2),
                   metric_name=f"{entry['metric']} (featcal-llm eval, suite {suite.get('name')} v{suite.get('version')})")
        for task, entry in (summary.get("tasks") or {}).items() if entry.get("score") is not None
    ]
    return eval_results_to_model_index(name, results) if results else []
