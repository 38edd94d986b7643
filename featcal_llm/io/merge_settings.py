"""The merge's own settings that mergekit refuses only mid-merge, or accepts and then writes a merge transformers
cannot read: `dtype`/`out_dtype`, a local `tokenizer_source`, `chat_template`. Checked by `validate` and before `run`
merges, without importing mergekit or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.io.problems import Problem

MERGEKIT_DTYPES = ("bfloat16", "float16", "float32", "float64", "int64")  # mergekit.common.dtype_from_name (tests/test_evidence.py)


def mergekit_chat_templates() -> list[str]:
    """The names of the chat templates mergekit ships (mergekit/_data/chat_templates), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("mergekit")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(path.stem for path in (Path(list(spec.submodule_search_locations)[0]) / "_data" / "chat_templates").glob("*.jinja"))


def chat_template_problem(template: str | None) -> str | None:
    """What mergekit makes of the recipe's `chat_template:` (mergekit.merge._set_chat_template): `auto`, a template it
    ships, or a Jinja template, which must parse. mergekit logs its refusal and writes the merge without a tokenizer."""
    if not template or template == "auto":
        return None
    names = mergekit_chat_templates()
    if template in names and "{" not in template:
        return None
    if len(template) < 20 or "{" not in template:
        return f"{template}: mergekit takes auto, a template it ships ({', '.join(names)}) or a Jinja template"
    from featcal_llm.io.model_files import chat_template_syntax_error

    problem = chat_template_syntax_error(template)
    return None if problem is None else f"not a Jinja template transformers can render ({problem})"


def merge_setting_problems(path: Path, merge_config: Any) -> list[Problem]:
    """Each setting mergekit would fail on after the run started, as one problem naming its key."""
    problems: list[Problem] = []
    for key in ("dtype", "out_dtype"):  # mergekit's dtype_from_name refuses any other name mid-merge
        value = getattr(merge_config, key, None)
        if value and value.removeprefix("torch.") not in MERGEKIT_DTYPES:
            problems.append(Problem(str(path), key, f"{value}: mergekit merges in {', '.join(MERGEKIT_DTYPES)}"))
        elif value and value.startswith("torch."):  # mergekit strips it to merge, then writes it as given into config.json
            problems.append(Problem(str(path), key, f"{value}: write {value.removeprefix('torch.')} (mergekit would write "
                                                    f"{value} into the merge's config.json, whose dtype transformers cannot read)"))
        elif value == "int64":  # whole-number weights: the merge's norms and projections could not be calibrated
            problems.append(Problem(str(path), key, "int64: a merge of whole numbers; featcal-llm merges and calibrates in "
                                                    "bfloat16, float16, float32 or float64"))
    source = getattr(merge_config, "tokenizer_source", None)
    if source is not None and not isinstance(source, str):  # a model reference: a local one must be there
        from featcal_llm.io.references import is_hub_reference

        for model_path in (source.model, source.lora):
            if model_path is not None and not is_hub_reference(model_path) and not Path(model_path.path).is_dir():
                problems.append(Problem(str(path), "tokenizer_source", f"{model_path.path}: model directory does not exist "
                                                                       "(tokenizer_source: base, union, or a model)"))
    template_problem = chat_template_problem(getattr(merge_config, "chat_template", None))
    if template_problem is not None:
        problems.append(Problem(str(path), "chat_template", template_problem))
    return problems
