"""The tensors mergekit's architecture requires of every input model: `validate` refuses a model that lacks one, as
mergekit's merge would, and passes the tied heads mergekit does merge.

Phi-4-mini's layout (Phi3ForCausalLM, `tie_word_embeddings: true`, no `lm_head.weight` stored) was passed by validate,
then refused by mergekit at merge time: mergekit's phi3 architecture requires `lm_head.weight` and names no tied
alias for it, while its llama and qwen2 architectures read a missing head from the tied embedding.
"""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main

from agreement import error_lines
from scenario import build_scenario
from test_exactness import scenario_family


def _tiny(tmp_path, family):
    scenario = build_scenario(tmp_path / family, experts=2, layers=1, samples=4, **scenario_family(family))
    return scenario, yaml.safe_load(scenario.recipe.read_text())


def _mergekit_merges(recipe: dict, out) -> str | None:
    """mergekit's own merge of the recipe's mergekit part: None where it merged, else its error's first line."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    config = MergeConfiguration.model_validate({key: value for key, value in recipe.items() if key != "featcal"})
    try:
        run_merge(config, str(out), options=MergeOptions(quiet=True, write_model_card=False))
    except Exception as error:  # mergekit's RuntimeError, as run shows it
        return str(error).splitlines()[0]
    return None


@pytest.mark.xfail(strict=True, reason="validate passes a tied Phi-3; mergekit then refuses it at merge time (run exit 1)")
def test_a_tied_phi3_is_refused_by_validate_and_run_before_the_merge(tmp_path):
    scenario, recipe = _tiny(tmp_path, "phi3-tied")
    assert not any(name.startswith("lm_head") for name in _names(scenario.base))  # Phi-4-mini's layout
    refused = _mergekit_merges(recipe, tmp_path / "mergekit-out")
    assert refused is not None and "lm_head.weight" in refused  # what mergekit says, after loading torch and the models
    validated = CliRunner().invoke(main, ["validate", str(scenario.recipe)])
    ran = CliRunner().invoke(main, ["run", str(scenario.recipe)])
    assert validated.exit_code == 2 and ran.exit_code == 2, (validated.output, ran.output)
    line = error_lines(validated)[0]
    assert error_lines(ran)[0] == line
    assert f"{scenario.base}" in line and "lm_head.weight" in line and "Phi3ForCausalLM" in line
    assert not (scenario.root / "merged").exists()  # refused before any merge


@pytest.mark.parametrize("family", ["llama-tied", "qwen2-tied"])
def test_tied_heads_mergekit_merges_pass(tmp_path, family):
    """Llama's and Qwen2's architectures read the head from the tied embedding: mergekit merges them, validate passes."""
    scenario, recipe = _tiny(tmp_path, family)
    assert not any(name.startswith("lm_head") for name in _names(scenario.base))
    assert _mergekit_merges(recipe, tmp_path / "mergekit-out") is None
    validated = CliRunner().invoke(main, ["validate", str(scenario.recipe)])
    assert validated.exit_code == 0, validated.output


def _names(directory) -> list[str]:
    from featcal_llm.io.lora_layout import checkpoint_shapes

    return list(checkpoint_shapes(directory, "test"))
