"""What a cached result depends on besides the model and the suite: the grader's code, the
libraries, the task's source files in lm-eval, and the dataset revision. Every part goes into the
cache key (runner.py), so a changed grader, environment or dataset is a miss, never a silent hit.

Runs in the user's process: nothing here imports lm-eval, vLLM or torch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml

from featcal_llm.evaluation.suite import Suite

GRADER_MODULES = ("evalplus.py", "sanitize.py", "sandbox.py", "harness.py", "oracle.py", "codec.py", "judge.py", "problem.py")
VERSIONED_PACKAGES = ("lm_eval", "vllm", "transformers", "torch", "datasets")
_HERE = Path(__file__).resolve().parent


def _sha_files(files: list[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def grader_source_sha256() -> str:
    """The code that turns a completion into a pass/fail for the code tasks."""
    return _sha_files([_HERE / name for name in GRADER_MODULES], _HERE)


def package_versions() -> dict[str, str | None]:
    found = {}
    for package in VERSIONED_PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def lm_eval_tasks_root() -> Path | None:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


@functools.lru_cache(maxsize=None)
def find_task_yaml(name: str) -> Path | None:
    """The YAML in lm-eval's task tree that says `task: <name>` (found without importing lm-eval)."""
    root = lm_eval_tasks_root()
    if root is None:
        return None
    pattern = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
    for path in sorted(root.rglob("*.yaml")):
        try:
            if pattern.search(path.read_text(errors="replace")):
                return path
        except OSError:
            continue
    return None


class _TolerantLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs without resolving their `!function` tags."""


_TolerantLoader.add_multi_constructor("!", lambda loader, suffix, node: f"!{suffix}")


def _task_yaml(path: Path) -> tuple[dict, list[Path]]:
    """The task's YAML merged over its `include:` chain, and every file that chain read."""
    data = yaml.load(path.read_text(), Loader=_TolerantLoader) or {}
    files = [path]
    include = data.pop("include", None)
    if include:
        base, more = _task_yaml((path.parent / include).resolve())
        data, files = {**base, **data}, more + files
    return data, files


def task_source(suite: Suite, task_id: str) -> dict:
    """Hash of the files that define the task (its YAML chain and the Python next to it) and the
    hub dataset it reads (path, config)."""
    own = suite.task_path(task_id)
    path = own or find_task_yaml(suite.tasks[task_id].lm_eval_task or "")
    if path is None:
        return {"sha256": None, "dataset_path": None, "dataset_name": None}
    config, files = _task_yaml(path)
    files += sorted(p for p in path.parent.glob("*.py"))
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    return {"sha256": _sha_files(sorted(set(files)), root), "dataset_path": config.get("dataset_path"),
            "dataset_name": config.get("dataset_name")}


def _offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@functools.lru_cache(maxsize=None)
def resolve_hub_revision(path: str, revision: str | None) -> str | None:
    """The commit a hub dataset revision points at now, or None offline / on any error."""
    if _offline() or importlib.util.find_spec("huggingface_hub") is None:
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(path, revision=revision, timeout=10).sha
    except Exception:  # noqa: BLE001 - no network, no such repo: the key says unresolved
        return None


def dataset_identity(suite: Suite, task_id: str, source: dict, local_data: str | None) -> dict:
    """Local data: its content hash. Hub data: path, config and the pinned (or resolved) commit."""
    if local_data is not None:
        return {"local": local_data}
    pinned = suite.tasks[task_id].dataset_revision
    path = source.get("dataset_path")
    resolved = pinned if pinned and re.fullmatch(r"[0-9a-f]{40}", pinned) else (
        resolve_hub_revision(path, pinned) if path else None)
    return {"path": path, "name": source.get("dataset_name"), "pinned": pinned, "revision": resolved or "unresolved"}
