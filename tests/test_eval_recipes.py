"""The shipped MergeBench recipes parse and validate offline (mergekit part and eval: block)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mergekit.config import MergeConfiguration

from featcal_llm.evaluation import EvalSection
from featcal_llm.evaluation.suite import load_suite

ROOT = Path(__file__).resolve().parents[1]
PAPER = {  # model -> (lambda, rho, alpha), FeatCal paper Sec. 5
    "mergebench-llama-3.2-3b-ta-featcal.yaml": ("Llama-3.2-3B-Instruct", 1e-5, 0.5, 0.15),
    "mergebench-llama-3.1-8b-ta-featcal.yaml": ("Llama-3.1-8B-Instruct", 3.0, 0.5, 0.15),
    "mergebench-llama-3.2-3b-ta-paper.yaml": ("Llama-3.2-3B-Instruct", 1e-5, 0.5, 0.15),
    "mergebench-llama-3.1-8b-ta-paper.yaml": ("Llama-3.1-8B-Instruct", 3.0, 0.5, 0.15),
}
# the -paper recipes weigh as the paper does; the -featcal ones are featcal-llm's defaults, written out
WEIGHTS = {"paper": ("equal", "equal"), "featcal": ("coverage", "expert_lead")}
VAL = {"math": ("MergeBench/math_val", "query", None, "response"),
       "coding": ("MergeBench/coding_val", "instruction", "input", "response"),
       "instruction": ("MergeBench/instruction_val", "instruction", "input", "output")}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_validates(name):
    model, lam, rho, alpha = PAPER[name]
    raw = yaml.safe_load((ROOT / "featcal_llm" / "recipes" / name).read_text())
    featcal = raw.pop("featcal")
    config = MergeConfiguration.model_validate(raw)
    assert config.merge_method == "task_arithmetic"
    assert str(config.base_model) == f"meta-llama/{model}"
    experts = [str(m.model) for m in config.models]
    assert experts == [f"MergeBench/{model}_{domain}" for domain in ("math", "coding", "instruction")]
    assert [m.parameters["weight"] for m in config.models] == [0.3, 0.3, 0.3]
    assert (featcal["lambda"], featcal["rho"], featcal["alpha"]) == (lam, rho, alpha)
    assert featcal["samples"] == 256 and featcal["max_length"] == 2048
    kind = name.removesuffix(".yaml").rsplit("-", 1)[1]
    assert (featcal["expert_weights"], featcal["token_weights"]) == WEIGHTS[kind]
    title = (ROOT / "featcal_llm" / "recipes" / name).read_text().splitlines()[0]
    assert title.startswith("# The paper's setting" if kind == "paper" else "# featcal-llm defaults") and "Table 4" in (
        title if kind == "paper" else (ROOT / "featcal_llm" / "recipes" / name).read_text().split("merge_method")[0])
    # calibration data keyed by the expert string, paired by domain name
    assert set(featcal["data"]) == set(experts)
    for expert, source in featcal["data"].items():
        path, instruction, input_column, response = VAL[expert.rsplit("_", 1)[1]]
        assert (source["path"], source["split"], source["format"]) == (path, "train", "alpaca")
        assert (source["instruction"], source.get("input"), source["response"]) == (instruction, input_column, response)
    section = EvalSection.model_validate(featcal["eval"])
    assert section.chat_template == "on" and section.allow_code_execution
    assert section.backend.name == "vllm" and section.reference == model
    assert section.suite == "mergebench" and load_suite(section.suite).version == "2"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_loads_with_the_recipe_loader(name):
    recipe = pytest.importorskip("featcal_llm.io.recipe")
    if not hasattr(recipe, "load_recipe"):
        pytest.skip("featcal_llm.io.recipe.load_recipe not written yet")
    loaded = recipe.load_recipe(ROOT / "featcal_llm" / "recipes" / name)
    paper = name.endswith("-paper.yaml")
    assert (loaded.featcal.balancing, loaded.featcal.token_weighting) == (("equal", "equal") if paper else ("coverage", "expert_lead"))
    section = getattr(getattr(loaded, "featcal", None), "eval", None)
    assert isinstance(section, EvalSection)
    assert section.reference == PAPER[name][0]
