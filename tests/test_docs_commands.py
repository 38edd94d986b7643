"""The README and docs/ as a user meets them: every command block runs, every full recipe loads, every link resolves.

A fenced ``bash``/``python`` block runs in a fresh tiny scenario (tests/scenario.py: a base, experts, data and
``recipe.yaml`` in the working directory), with ``featcal-llm`` and ``python`` meaning this checkout. Left out:
install blocks (``pip install``, ``apt-get``, ``python3 -m venv``: CI runs the README's own set-up commands), and a
block preceded by ``<!-- not run in tests: REASON -->`` (a GPU, the hub, a long run). A block whose command or API
function does not exist (yet) in this checkout is skipped, naming it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run in tests:\s*(.+?)\s*-->$")
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
COMMAND_LANGUAGES = {"bash", "sh", "shell", "python"}
INSTALL = re.compile(r"\bpip install\b|\bapt-get\b|python3? -m venv\b")
CLI_COMMAND = re.compile(r"(?:featcal-llm|python -m featcal_llm)\s+([a-z][\w-]*)")
API_CALL = re.compile(r"\bfeatcal_llm\.([A-Za-z_]\w*)\s*\(")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# pages other branches write, linked before they land: checked once they exist
WRITTEN_ELSEWHERE = {"docs/recipe.md", "docs/reuse.md"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str
    not_run: str | None  # the reason given in the marker, if any

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """Fenced code blocks with the `not run in tests` marker that stands on the line right before them, if any."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{page.relative_to(REPO)}:{index + 1}: code block never closed"
        marker = NOT_RUN.match(lines[index - 1].strip()) if index > 0 else None
        found.append(Block(page, index + 1, opening.group(1).lower(), "\n".join(lines[index + 1 : end]), marker and marker.group(1)))
        index = end + 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]
COMMAND_BLOCKS = [b for b in ALL_BLOCKS if b.language in COMMAND_LANGUAGES]


def is_install(block: Block) -> bool:
    return block.language != "python" and bool(INSTALL.search(block.text))


RUN_BLOCKS = [b for b in COMMAND_BLOCKS if b.not_run is None and not is_install(b)]


def missing_names(block: Block) -> list[str]:
    """CLI sub-commands and API functions the block uses that this checkout does not have."""
    import click

    import featcal_llm
    from featcal_llm.cli import main

    commands = set(main.list_commands(click.Context(main)))
    code = "\n".join(line.split("#", 1)[0] for line in block.text.splitlines())  # not what comments mention
    missing = [f"featcal-llm {c}" for c in CLI_COMMAND.findall(code) if c not in commands]
    missing += [f"featcal_llm.{f}" for f in API_CALL.findall(code) if not hasattr(featcal_llm, f)]
    return sorted(set(missing))


def shims(directory: Path) -> dict[str, str]:
    """`featcal-llm` and `python` meaning this interpreter and this checkout, whatever is installed."""
    directory.mkdir()
    for name, target in {"featcal-llm": f'exec "{sys.executable}" -m featcal_llm "$@"', "python": f'exec "{sys.executable}" "$@"'}.items():
        path = directory / name
        path.write_text(f"#!/bin/sh\n{target}\n")
        path.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{directory}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_blocks_found():
    """The parser sees the README's blocks; a marker only ever stands right before a block."""
    readme = [b for b in ALL_BLOCKS if b.page.name == "README.md" and b.page.parent == REPO]
    assert any(b.language == "yaml" for b in readme) and any(b.language == "bash" for b in readme)
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                following = lines[number + 1] if number + 1 < len(lines) else ""
                assert FENCE.match(following), f"{page.relative_to(REPO)}:{number + 1}: the marker must stand right before a code block"


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.name)
def test_command_block_runs(block, tmp_path):
    missing = missing_names(block)
    if missing:
        pytest.skip(f"not in this checkout yet: {', '.join(missing)}")
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "work", experts=2, layers=2, samples=8)
    env = shims(tmp_path / "bin")
    env["TMPDIR"] = str(tmp_path)
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.text + "\n")
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.text]
    done = subprocess.run(command, cwd=scenario.root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{block.text}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"


def full_recipes() -> list[Block]:
    recipes = []
    for block in ALL_BLOCKS:
        if block.language != "yaml" or "..." in block.text:
            continue
        data = yaml.safe_load(block.text)
        if isinstance(data, dict) and "featcal" in data and ("models" in data or "slices" in data):
            recipes.append(block)
    return recipes


@pytest.mark.parametrize("block", full_recipes(), ids=lambda b: b.name)
def test_documented_recipe_loads(block, tmp_path):
    """A whole recipe shown in the docs passes the recipe checks that need no model (load_recipe)."""
    from featcal_llm.io.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(block.text)
    load_recipe(path)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    inside, found = False, set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def repository_url() -> str:
    """pyproject's `Repository` URL: the README links to this repository's files absolutely (PyPI renders it too)."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]["Repository"].rstrip("/")


def own_file(target: str) -> str | None:
    """The checkout-relative path an absolute link to this repository's main branch names, else None."""
    match = re.match(re.escape(repository_url()) + r"/(?:blob|tree)/main/(.*)$", target)
    return match.group(1) if match else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    """Every relative link, and every absolute one into this repository's main branch, names a file of this checkout
    (and, with #anchor, one of its headings)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    problems = []
    for link in LINK.findall(text):
        target, folder = link, page.parent
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            target, folder = own_file(link), REPO
            if target is None:  # another site
                continue
        file_part, _, anchor = target.partition("#")
        resolved = (folder / file_part).resolve() if file_part else page
        relative = resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else str(resolved)
        if not resolved.exists():
            if relative not in WRITTEN_ELSEWHERE:
                problems.append(f"{link}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{link}: no heading with anchor #{anchor}")
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


def test_readme_setup_commands_match_ci():
    """The README's two set-up commands: the test one is what .ci/run runs; the demo one installs no test extras."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    bash = [b.text for b in ALL_BLOCKS if b.page == REPO / "README.md" and b.language == "bash"]
    demo = [t for t in bash if t.endswith("-m featcal_llm demo") and "venv" in t]
    tests = [t for t in bash if t.endswith("-m pytest -q -p no:cacheprovider -n 2 --dist loadfile") and "venv" in t]
    assert len(demo) == 1 and len(tests) == 1, "the README must keep exactly one demo and one test set-up command"
    assert "[test]" not in demo[0]
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.replace("pip install -q ", "pip install ") == tests[0]


def test_readme_first_screen_is_short():
    """Before Install a newcomer reads what it is, one table of what it gives and the two set-up commands: at most
    45 lines, and every link absolute (PyPI renders the README as the package's description)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = readme[: readme.index("\n## Install\n")]
    assert len(first.splitlines()) <= 45
    tables = [line for line in first.splitlines() if line.startswith("|---")]
    assert len(tables) == 1, "one table before Install"
    assert first.count("```bash") == 2 and "-m featcal_llm demo" in first and "-m pytest" in first
    relative = [target for target in LINK.findall(re.sub(r"```.*?```", "", readme, flags=re.S))
                if not re.match(r"[a-z][a-z0-9+.-]*:", target)]
    assert relative == [], f"README.md: links PyPI cannot follow: {relative}"


MODULE_COMMAND = re.compile(r"python -m ((?:featcal_llm|studies)(?:\.\w+)+)")
DRIVER = """
import runpy, sys, io, contextlib
failed = []
for module in sys.argv[1:]:
    sys.argv = [module, "-h"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code or 0
    except BaseException as error:
        code = repr(error)
    if code != 0 or not out.getvalue().strip():
        failed.append((module, code, out.getvalue()[:200]))
print(failed)
"""


def test_every_module_the_docs_run_takes_h():
    """The README says every command takes -h: so do the `python -m` modules the pages tell you to run (help, exit 0)."""
    modules = sorted({m for page in PAGES for m in MODULE_COMMAND.findall(page.read_text(encoding="utf-8"))} - {"featcal_llm"})
    assert len(modules) > 10, modules
    result = subprocess.run([sys.executable, "-c", DRIVER, *modules], capture_output=True, text=True, cwd=REPO, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "[]", (result.stdout[-3000:], result.stderr[-2000:])
