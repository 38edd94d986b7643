"""The output's generation_config.json: the stop ids and sampling defaults transformers, vLLM and lm-eval read there.

mergekit copies its donor's (the base model's) only where it copies the tokenizer's files as they are; a recipe with
`tokenizer_source` or `chat_template` has it build the tokenizer, and the merge, then the calibrated output, had none:
a Llama-3-Instruct's second stop id (`<|eot_id|>`, in that file only) was lost and generations ran on.
"""

from __future__ import annotations

import yaml
from transformers import GenerationConfig

from featcal_llm.pipeline import run_recipe
from scenario import build_scenario

FILE = "generation_config.json"


def _with_generation_config(tmp_path):
    """A two-expert scenario whose models ship a generation config of their own: two stop ids, sampling defaults."""
    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, do_sample=True, temperature=0.6,
                              top_p=0.9, max_new_tokens=77)
    for directory in (scenario.base, *scenario.experts.values()):
        config.save_pretrained(directory)
    return scenario


def _recipe(scenario, tmp_path, merged, **top):
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), merged=str(merged)).read_text())
    recipe.update(top)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return tmp_path / "r.yaml", recipe


def test_a_merge_that_builds_its_tokenizer_keeps_the_base_s_generation_config(tmp_path):
    scenario = _with_generation_config(tmp_path)
    path, _ = _recipe(scenario, tmp_path, tmp_path / "merged", tokenizer_source="base")
    output = run_recipe(path, progress=False)
    expected = (scenario.base / FILE).read_bytes()
    assert (tmp_path / "merged" / FILE).read_bytes() == expected  # mergekit's plain copy would have given this file
    assert (output / FILE).read_bytes() == expected
    assert GenerationConfig.from_pretrained(output).eos_token_id == [2, 3]


def test_a_merge_given_without_one_gets_the_base_s_in_the_output(tmp_path, capsys):
    """A merge the user made with mergekit itself (`tokenizer_source: base`), which wrote no generation config."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    scenario = _with_generation_config(tmp_path)
    path, recipe = _recipe(scenario, tmp_path, tmp_path / "theirs", tokenizer_source="base")
    config = MergeConfiguration.model_validate({key: value for key, value in recipe.items() if key != "featcal"})
    run_merge(config, str(tmp_path / "theirs"), options=MergeOptions(quiet=True, write_model_card=False))
    assert not (tmp_path / "theirs" / FILE).exists()  # what mergekit 0.1.5 writes for this recipe
    output = run_recipe(path, progress=False)
    assert (output / FILE).read_bytes() == (scenario.base / FILE).read_bytes()
    assert f"the merge has no {FILE}: the output gets the base model's" in capsys.readouterr().err
