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


FAMILIES = ["llama", "gemma2", "mistral", "qwen2", "qwen3", "phi3", "llama-tied", "mistral-tied", "qwen2-tied", "qwen3-tied"]


@pytest.mark.parametrize("family", FAMILIES)
def test_validate_passes_what_mergekit_merges(tmp_path, family):
    """The suite's six families (Gemma-2 tied, as it ships) and the tied Llama, Mistral, Qwen2 and Qwen3 heads, which
    mergekit's definitions read from the embedding: mergekit merges each, and validate passes each."""
    scenario, recipe = _tiny(tmp_path, family)
    assert _mergekit_merges(recipe, tmp_path / "mergekit-out") is None
    validated = CliRunner().invoke(main, ["validate", str(scenario.recipe)])
    assert validated.exit_code == 0, validated.output


def test_the_required_weights_are_mergekits_for_every_architecture_it_defines():
    """definition_for and required_weights, read from mergekit's files without importing it, against mergekit's own API
    (arch_info_for_config, all_weights) for every architecture name its definitions carry, at 3 layers."""
    from mergekit.architecture import arch_info_for_config
    from mergekit.architecture.json_definitions import NAME_TO_ARCH

    from featcal_llm.io.mergekit_architecture import CODED, definition_for, definitions, required_weights

    assert set(definitions()) == set(NAME_TO_ARCH)
    checked = 0
    for name, candidates in NAME_TO_ARCH.items():
        if name in CODED:  # mergekit builds these from the config in code (moe_defs): not checked
            assert definition_for({"architectures": [name], "model_type": candidates[0].expected_model_type}) is None
            continue
        for model_type in {candidate.expected_model_type for candidate in candidates} | {"none-of-them"}:
            config = {"architectures": [name], "model_type": model_type}
            for module in (module for candidate in candidates for module in candidate.modules.values()):
                key = module.architecture.num_layers_config_key() or "num_hidden_layers"
                *outer, last = key.split(".")
                node = config
                for part in outer:
                    node = node.setdefault(part, {})
                node[last] = 3
            theirs = arch_info_for_config(_namespace(config))
            ours = definition_for(config)
            assert (theirs is None) == (ours is None), (name, model_type)
            if theirs is None:
                continue
            expected = [(w.name, (w.name, *(w.aliases or ()), *(w.tied_names or ())))
                        for w in theirs.all_weights(_namespace(config)) if not w.optional]
            assert required_weights(ours, config) == expected, (name, model_type)
            checked += 1
    assert checked >= len(NAME_TO_ARCH) - len(CODED)


def test_mergekit_converts_no_checkpoint_layout_of_the_families_checked():
    """mergekit also builds a missing tensor from a checkpoint layout transformers renames (its conversion mapping:
    MoE and some vision types), which the check does not read: it runs only for the families featcal-llm calibrates,
    none of which has one."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for model_type in ("llama", "gemma2", "mistral", "qwen2", "qwen3", "phi3"):
        assert not get_checkpoint_conversion_mapping(model_type), model_type


def test_the_refusal_names_the_first_weight_no_name_of_which_is_stored():
    from featcal_llm.io.mergekit_architecture import first_missing

    required = [("model.embed_tokens.weight", ("model.embed_tokens.weight",)),
                ("lm_head.weight", ("lm_head.weight", "model.embed_tokens.weight")),
                ("model.norm.weight", ("model.norm.weight", "model.final_norm.weight"))]
    assert first_missing(required, {"model.embed_tokens.weight", "model.final_norm.weight"}) is None  # tied, aliased
    assert first_missing(required, {"lm_head.weight", "model.norm.weight"}) == required[0]
    assert first_missing(required, {"model.embed_tokens.weight"}) == required[2]


def _namespace(value):
    from types import SimpleNamespace

    return SimpleNamespace(**{key: _namespace(item) for key, item in value.items()}) if isinstance(value, dict) else value


def _names(directory) -> list[str]:
    from featcal_llm.io.lora_layout import checkpoint_shapes

    return list(checkpoint_shapes(directory, "test"))


def test_an_expert_lacking_a_weight_mergekit_reads_is_refused_naming_the_expert(tmp_path):
    """The base complete, expert0's checkpoint without `lm_head.weight` (an untied Phi-3, where mergekit reads the head
    of every input model): validate and run refuse it in the same line, naming expert0's folder, before any merge; the
    check reads each expert's own checkpoint (`reads_other_weights`), not only the base's."""
    from safetensors.torch import load_file, save_file

    scenario, recipe = _tiny(tmp_path, "phi3")
    expert = scenario.experts["expert0"]
    for shard in expert.glob("*.safetensors"):
        tensors = load_file(shard)
        if "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]
            save_file(tensors, shard, metadata={"format": "pt"})
    index = expert / "model.safetensors.index.json"
    if index.is_file():
        import json

        layout = json.loads(index.read_text())
        layout["weight_map"].pop("lm_head.weight", None)
        index.write_text(json.dumps(layout))
    assert "lm_head.weight" in _names(scenario.base) and "lm_head.weight" not in _names(expert)
    validated = CliRunner().invoke(main, ["validate", str(scenario.recipe)])
    ran = CliRunner().invoke(main, ["run", str(scenario.recipe)])
    assert validated.exit_code == 2 and ran.exit_code == 2, (validated.output, ran.output)
    lines = error_lines(validated)
    assert error_lines(ran)[0] == lines[0]
    assert any(f"{expert}" in line and "lm_head.weight" in line for line in lines), lines
    assert not (scenario.root / "merged").exists()
