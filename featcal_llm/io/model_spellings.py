"""How a recipe writes its models, checked against the folders they name: mergekit reads each spelling as an input
of its own, and `+` as model+adapter, so a spelling that names a folder otherwise merges something else."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from featcal_llm.io.block import beside_recipe
from featcal_llm.io.problems import Problem


def one_model_two_ways(merge_config: Any) -> list[str]:
    """Local models written two ways that are one folder (a link and its target, a trailing slash): mergekit merges
    each as an input of its own, so the model counts twice (and an expert that is the base is calibrated toward it)."""
    written = [entry.model for entry in merge_config.models or ()]
    written += [merge_config.base_model] if merge_config.base_model is not None else []
    folders: dict[str, list[str]] = {}
    for reference in written:
        if reference.lora is None and Path(reference.model.path).is_dir():
            spellings = folders.setdefault(os.path.realpath(reference.model.path), [])
            if str(reference) not in spellings:
                spellings.append(str(reference))
    return [f"{' and '.join(spellings)} are one model (the folder {folder}); list each model once, written one way"
            for folder, spellings in folders.items() if len(spellings) > 1]


def plus_in_a_folder(path: Path, merge_config: Any) -> list[Problem]:
    """A local folder whose path holds `+` (`runs/llama+math/expert`): mergekit reads `+` as model+adapter, so the
    recipe names the model `runs/llama` with the hub adapter `math/expert`, which validate left to --online and run
    failed to download. Refused where the whole path is a folder and the part before `+` is none."""
    found = []
    for key, reference in [("base_model", merge_config.base_model), *(("models", entry.model) for entry in merge_config.models or ())]:
        if reference is None or reference.lora is None:
            continue
        whole, model = str(reference), str(reference.model.path)
        if beside_recipe(whole, path.parent).is_dir() and not beside_recipe(model, path.parent).is_dir():
            found.append(Problem(str(path), key, f"{whole}: mergekit reads '+' as model+adapter (model {model}, adapter "
                                 f"{reference.lora.path}), not as part of the folder's name; rename the folder or link to it "
                                 "from a path without '+'"))
    return found
