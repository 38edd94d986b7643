"""The tiny merge refine's end-to-end tests share (tests/test_refine*.py): two experts far from their merge, each with its
own kind of text, and the closed form's and REFINE's runs of it, built once a session (conftest.py registers the
fixtures) and read, never changed, by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REFINE = {"steps": 6, "eval_every": 2, "patience": 2, "lr": 3e-4, "batch_records": 8, "params": "full", "top_k": 128,
          "precision": "float32"}  # the same numbers on every CPU (auto picks bf16 where the CPU has AVX512-BF16 or AMX)


def kind_texts(kind: int, count: int) -> list[str]:
    """Two kinds of text a model can tell apart: words (expert0's records) and arithmetic-like symbols (expert1's), so
    that held-out records of a kind can be predicted from the training records of that kind."""
    import random
    import string

    from scenario import WORDS

    rng = random.Random(kind)
    if kind == 0:
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(count)]
    symbols = string.digits + "+-*/=()"
    return [" ".join("".join(rng.choice(symbols) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(4, 10)))
            for _ in range(count)]


@pytest.fixture(scope="session")
def far_scenario(tmp_path_factory):
    """Two experts far from their merge (noise 0.6), two layers, each with its own kind of text; merged once by mergekit."""
    from scenario import build_scenario

    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("refine"), experts=2, layers=2, samples=12, noise=0.6)
    for kind, path in enumerate(sorted(scenario.data.values())):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in kind_texts(kind, 16)))
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


def run(scenario, name: str, **featcal) -> Path:
    from featcal_llm.pipeline import run_recipe

    recipe = scenario.write_recipe(scenario.root / f"{name}.yaml", output=str(scenario.root / name), **featcal)
    return run_recipe(recipe, force=True, progress=False)


@pytest.fixture(scope="session")
def closed_form(far_scenario) -> Path:
    """The same run (records held out alike) with the refine stage replaced by one that returns the closed form's tensors:
    what every refinement of this scenario starts from (the refine settings do not change the closed form)."""
    import featcal_llm.engine.refine as refine_module

    def stand_in(job):
        return job.replacements, {"params": "full", "lr": 0.0, "steps_run": 0, "chosen_step": 0, "max_steps": 0, "top_k": 1,
                                  "held_out_kl": {"before": 0.0, "after": 0.0}, "teachers": {}}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(refine_module, "refine", stand_in)
        return run(far_scenario, "closed", refine=REFINE)


@pytest.fixture(scope="session")
def refined(far_scenario) -> Path:
    """REFINE's run, shared by the tests that read it."""
    return run(far_scenario, "refined", refine=REFINE)


def killed_after_step_2(recipe, monkeypatch) -> None:
    """Run the recipe and stop it right after refine's check at step 2, as a crash would."""
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.pipeline import run_recipe

    def crash(step, saved):
        if step == 2:
            raise RuntimeError("killed after step 2")

    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "after_check", crash)
        with pytest.raises(RuntimeError, match="killed after step 2"):
            run_recipe(recipe, progress=False)


__all__ = ["REFINE", "closed_form", "far_scenario", "killed_after_step_2", "kind_texts", "refined", "run"]
