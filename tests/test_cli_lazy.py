"""The CLI loads sub-package commands only when they are used, and still lists them all (issue 11, start-up)."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner


def test_importing_the_cli_loads_no_sub_package():
    code = "import sys, featcal_llm.cli; print(sorted(m for m in sys.modules if m.startswith(('featcal_llm.', 'mergekit', 'torch'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['featcal_llm.cli', 'featcal_llm.errors']", loaded


def test_help_lists_every_command_and_each_resolves():
    from featcal_llm.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("bench", "demo", "eval", "leaderboard", "run"):
        assert f"  {name} " in result.output, name
        assert CliRunner().invoke(main, [name, "--help"]).exit_code == 0, name
    assert CliRunner().invoke(main, ["nope"]).exit_code == 2
