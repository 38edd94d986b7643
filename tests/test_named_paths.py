"""Every repository path a shipped recipe, suite or doc page names exists.

The MergeBench recipes and docs/evaluation.md once pointed to `eval/mergebench.yaml` and `eval/tasks/`, which never
existed (the suites ship in featcal_llm/evaluation/suites/). A path counts when it exists from the repository root or
from the naming file's own folder (a relative link); markdown links are checked the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = "featcal_llm|eval|docs|recipes|tests|studies"
NAMED = re.compile(rf"(?<![\w/.~-])((?:{TOP})/[\w./-]*[\w/])")  # `eval/tasks/`, featcal_llm/recipes/x.yaml, ...
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) with a local target
SHIPPED = sorted(
    [*ROOT.glob("docs/*.md"), *ROOT.glob("featcal_llm/recipes/*.yaml"), *ROOT.glob("recipes/*.yaml"),
     *ROOT.glob("featcal_llm/evaluation/suites/**/*.yaml")])


def named_paths(text: str) -> list[str]:
    """The repository paths and local link targets a text names."""
    links = [target for target in LINK.findall(text) if "://" not in target and not target.startswith("mailto:")]
    return sorted(set(NAMED.findall(text)) | set(links))


def missing(path: Path) -> list[str]:
    return [name for name in named_paths(path.read_text())
            if not (ROOT / name).exists() and not (path.parent / name).exists()]


def test_the_scanner_sees_a_missing_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("default `eval/mergebench.yaml`, see [the suites](featcal_llm/evaluation/suites/) and "
                    "evalplus/eval/utils.py (upstream, not ours) and [a link](nowhere.md) and [web](https://x.org/a)\n")
    assert missing(page) == ["eval/mergebench.yaml", "nowhere.md"]


def test_the_shipped_files_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in SHIPPED}
    assert {"docs/evaluation.md", "featcal_llm/recipes/mergebench-llama-3.2-3b-ta-featcal.yaml",
            "featcal_llm/evaluation/suites/mergebench.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_path_a_shipped_file_names_exists(path):
    assert missing(path) == []
