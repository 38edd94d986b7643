"""The package as users install it: a wheel built from this tree, installed into a fresh virtual environment and run
outside the checkout, finds its evaluation suites (package data) and carries the licence."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv (system site-packages, plus this interpreter's, for the dependencies) holding only the built wheel."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: a build writes egg-info and build/ into its source tree
    shutil.copytree(ROOT / "featcal_llm", source / "featcal_llm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
                            str(source)], capture_output=True, text=True, cwd=root, env=_clean_env())
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("featcal_llm-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                             capture_output=True, text=True, cwd=root, env=_clean_env())
    assert install.returncode == 0, install.stderr[-3000:]
    # then the dependencies, from the interpreter running the tests (after the install, so pip does not take them for
    # an installed featcal-llm): plain path entries, so their .pth hooks (an editable checkout) do not run
    Path(purelib, "zz_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return wheel, venv, root / "elsewhere"


def _clean_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "FEATCAL_EVAL_DIR")}


def test_wheel_holds_the_suites_and_the_licence(installed):
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("featcal_llm/evaluation/suites/mergebench.yaml", "featcal_llm/evaluation/suites/mergebench-protocol.yaml",
                    "featcal_llm/evaluation/suites/tasks/evalplus_humaneval_plus.yaml",
                    "featcal_llm/evaluation/suites/reference/featcal_paper.yaml", "featcal_llm/generation/seed_prompts.jsonl"):
        assert shipped in names, shipped
    licence = [name for name in names if name.endswith("dist-info/licenses/LICENSE") or name.endswith("dist-info/LICENSE")]
    assert licence and "Apache License" in zipfile.ZipFile(wheel).read(licence[0]).decode()
    assert not any(name.startswith(("tests/", "studies/", "eval/")) for name in names)


def test_installed_cli_finds_the_mergebench_suite_outside_the_checkout(installed):
    _, venv, elsewhere = installed
    elsewhere.mkdir(exist_ok=True)
    help_text = subprocess.run([venv / "bin" / "featcal-llm", "eval", "--suite", "mergebench", "--help"], capture_output=True,
                               text=True, cwd=elsewhere, env=_clean_env())
    assert help_text.returncode == 0, help_text.stderr[-3000:]
    assert "Score MODEL_DIR" in help_text.stdout and "FEATCAL_EVAL_DIR" in help_text.stdout
    code = textwrap.dedent(
        """
        import featcal_llm
        from featcal_llm.evaluation.leaderboard import reference_rows
        from featcal_llm.evaluation.suite import load_suite
        suite = load_suite("mergebench")
        files = [suite.task_path(t) for t in suite.tasks if suite.task_path(t) is not None]
        assert all(path.is_file() for path in files)
        print(featcal_llm.__file__)
        print(sorted(suite.tasks))
        print(len(files), len(reference_rows(["all"], suite)) > 0)
        """
    )
    loaded = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True, cwd=elsewhere, env=_clean_env())
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    location, tasks, counts = loaded.stdout.splitlines()
    assert location.startswith(str(venv)) and not location.startswith(str(ROOT))  # the wheel's copy, not this checkout
    assert tasks == str(sorted(["arc_challenge", "gsm8k", "humaneval_plus", "ifeval", "math500", "mbpp_plus"]))
    assert counts == "2 True"


def test_own_suite_folder_comes_first_and_falls_back_to_the_shipped_suites(tmp_path, monkeypatch):
    from featcal_llm.evaluation.suite import SHIPPED, resolve_suite_path

    (tmp_path / "mine.yaml").write_text("name: mine\n")
    monkeypatch.setenv("FEATCAL_EVAL_DIR", str(tmp_path))
    assert resolve_suite_path("mine") == tmp_path / "mine.yaml"
    assert resolve_suite_path("mergebench") == SHIPPED / "mergebench.yaml"
    assert SHIPPED.is_relative_to(ROOT / "featcal_llm")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mergebench").mkdir()  # a folder of that name here (results, say) had hidden the shipped suite
    assert resolve_suite_path("mergebench") == SHIPPED / "mergebench.yaml"


def test_the_installed_cli_lists_and_prints_the_shipped_recipes(installed):
    wheel, venv, elsewhere = installed
    elsewhere.mkdir(exist_ok=True)
    shipped = sorted(path.name for path in (ROOT / "featcal_llm" / "recipes").glob("*.yaml"))
    assert len(shipped) >= 6 and all(f"featcal_llm/recipes/{name}" in zipfile.ZipFile(wheel).namelist() for name in shipped)
    listing = subprocess.run([venv / "bin" / "featcal-llm", "recipes"], capture_output=True, text=True, cwd=elsewhere, env=_clean_env())
    assert listing.returncode == 0, listing.stderr[-3000:]
    assert [line.split()[0] for line in listing.stdout.splitlines()] == [name.removesuffix(".yaml") for name in shipped]
    name = shipped[-1].removesuffix(".yaml")
    printed = subprocess.run([venv / "bin" / "featcal-llm", "recipes", name], capture_output=True, text=True, cwd=elsewhere, env=_clean_env())
    assert printed.stdout == (ROOT / "featcal_llm" / "recipes" / shipped[-1]).read_text()
    run_help = subprocess.run([venv / "bin" / "featcal-llm", "run", "-h"], capture_output=True, text=True, cwd=elsewhere, env=_clean_env())
    assert run_help.returncode == 0 and "RECIPE [OUTPUT]" in run_help.stdout


# imported by featcal_llm but brought by an extra (the evaluation worker runs only with it installed)
FROM_EXTRAS = {"lm_eval": "eval", "nltk": "eval", "vllm": "vllm"}


def test_every_third_party_import_is_declared():
    """numpy, huggingface_hub, tokenizers, pyarrow...: a package we import is one we declare, not one a dependency happens to bring."""
    import ast
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
                for requirement in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]}
    modules = set()
    for path in (ROOT / "featcal_llm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    third_party = {m for m in modules if m not in sys.stdlib_module_names and m != "featcal_llm" and m not in FROM_EXTRAS}
    distributions = importlib.metadata.packages_distributions()
    missing = sorted(m for m in third_party if not {d.lower().replace("_", "-") for d in distributions.get(m, [m])} & declared)
    assert missing == [], f"imported but not declared in pyproject.toml: {missing}"


PROJECT_URLS = ("Homepage", "Documentation", "Repository", "Issues", "Changelog")


def relative_links(markdown: str) -> list[str]:
    """Link and image targets (markdown and HTML) outside code that PyPI cannot follow: no scheme (a path, `#anchor`)."""
    import re

    text = re.sub(r"```.*?```|`[^`\n]*`", "", markdown, flags=re.S)
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, flags=re.M)  # reference definitions
    targets += re.findall(r"""\b(?:href|src)\s*=\s*["']([^"']+)""", text)
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_relative_links_are_found():
    """The check below can fail: each kind of relative link is caught, absolute ones and code are not."""
    page = ("[a](docs/a.md) ![b](img.png) [c](#install) <img src=\"x.png\"> <a href='y.md'>y</a>\n[d]: docs/d.md\n"
            "[ok](https://example.org/a.md) `[no](code.md)`\n```\n[no](block.md)\n```\n")
    assert relative_links(page) == ["docs/a.md", "img.png", "#install", "docs/d.md", "x.png", "y.md"]


def test_the_wheel_metadata_names_the_project_urls_and_links_absolutely(installed):
    """What PyPI shows: the wheel's METADATA carries the project URLs, and its long description (the README) has no
    link that only resolves inside a checkout."""
    from email.parser import Parser

    wheel, _, _ = installed
    archive = zipfile.ZipFile(wheel)
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    urls = dict(value.split(", ", 1) for value in metadata.get_all("Project-URL"))
    for label in PROJECT_URLS:
        assert urls.get(label, "").startswith("https://"), (label, urls)
    assert metadata["Description-Content-Type"].startswith("text/markdown")
    description = metadata.get_payload()
    assert description.strip() == (ROOT / "README.md").read_text(encoding="utf-8").strip()
    assert relative_links(description) == [], "README links PyPI cannot follow"
    repository = urls["Repository"].rstrip("/")
    assert f"{repository}/blob/main/docs/results.md" in description  # the docs link into the repository the metadata names
