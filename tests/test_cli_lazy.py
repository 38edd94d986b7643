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


HEAVY = ("torch", "mergekit", "transformers", "peft", "datasets")


def test_a_key_typo_is_refused_before_torch_or_mergekit_load(tmp_path):
    """`validate` and `run` answer a featcal: key typo from the schema alone: the edit-and-check loop stays under a second."""
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: code\n    parameters: {weight: 0.5}\n"
                      f"featcal:\n  merged: {tmp_path / 'merged'}\n  output: {tmp_path / 'out'}\n  lamda: 1.0e-5\n"
                      "  data:\n    code: {path: code.jsonl}\n")
    code = ("import sys\nfrom featcal_llm.cli import main\n"
            "try:\n    main([sys.argv[1], sys.argv[2]])\nexcept SystemExit as exit:\n    print('exit', exit.code)\n"
            f"print('loaded', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    for command in ("validate", "run"):
        result = subprocess.run([sys.executable, "-c", code, command, str(recipe)], capture_output=True, text=True, cwd=tmp_path)
        assert result.stdout.splitlines()[-2:] == ["exit 2", "loaded []"], (command, result.stdout, result.stderr)
        assert f"featcal-llm: error: {recipe}: featcal.lamda: unknown key; did you mean 'lambda'?" in result.stderr.splitlines(), result.stderr
    assert not (tmp_path / "out").exists()
