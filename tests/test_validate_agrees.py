"""`validate` says what `run` will say (issue 56, item 3): the same refusals, each one line, in one round, without torch.

Each bad recipe below was passed by `validate` before (or refused by `run` only after minutes of work, or not at
all): validate's error lines, run's (CLI) and the pipeline's own check (mergekit's real parsing) must be the same.
The table of edits is here; tests/test_agree_{models,data,settings,outputs}.py hold one topic each, and
tests/agreement.py what they share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.io.problems import RecipeProblems

from agreement import (dataset_directory, error_lines, expert_of, expert_with_a_quantization_config, first_data_file, model_path_typo,
                       recipe_of, without_chat_template, write_edited)


HEAVY = ("torch", "mergekit", "transformers", "peft", "datasets", "safetensors")


def _mixtral_base(r, t):
    """A base model whose config says Mixtral (weights linked, never read)."""
    base = t / "mixtral-base"
    shutil.copytree(r["base_model"], base, copy_function=os.symlink)
    (base / "config.json").unlink()
    config = json.loads((Path(r["base_model"]) / "config.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    (base / "config.json").write_text(json.dumps(config))
    r["base_model"] = str(base)


def _expert_with_another_norm_epsilon(r, t):
    """An expert whose layers compute another function than the base's (its norm epsilon), shapes alike."""
    expert = t / "other-eps"
    shutil.copytree(r["models"][1]["model"], expert, copy_function=os.symlink)
    config = json.loads((expert / "config.json").read_text())
    (expert / "config.json").unlink()
    (expert / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 10}))
    r["featcal"]["data"][str(expert)] = r["featcal"]["data"].pop(r["models"][1]["model"])
    r["models"][1]["model"] = str(expert)


def _base_without_tokenizer(r, t):
    """A base directory with weights and config but no tokenizer: the records cannot be tokenised."""
    from featcal_llm.io.model_files import TOKENIZER_FILES

    bare = t / "bare-base"
    shutil.copytree(r["base_model"], bare, symlinks=True, ignore=shutil.ignore_patterns(*TOKENIZER_FILES, "special_tokens_map.json"))
    r["base_model"] = str(bare)


def _chat_records_without_a_template(r, t):
    """Chat records tokenised with a base whose tokenizer has no chat template; an expert asked to answer the empty
    request with none either."""
    r["base_model"] = without_chat_template(r["base_model"], t / "plain-base")
    (t / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    r["featcal"]["data"][expert_of(r, 0)] = {"path": str(t / "chat.jsonl"), "format": "chat", "messages": "messages"}
    plain = without_chat_template(expert_of(r, 1), t / "plain-expert")
    r["featcal"]["data"].pop(expert_of(r, 1))
    r["featcal"]["data"][plain] = {"generate": {"chat_template": "empty"}}
    r["models"][1]["model"] = plain


def _duplicates(r, _t):
    text = yaml.safe_dump(r, sort_keys=False)
    return text.replace("  samples: 16\n", "  samples: 16\n  samples: 8\n").replace("dtype: float32\n", "dtype: float32\ndtype: bfloat16\n")


def _bad_yaml(r, _t):
    return yaml.safe_dump(r, sort_keys=False).replace("merge_method: task_arithmetic", "merge_method: [task_arithmetic")


def _set(change):
    def mutate(r, _t):
        change(r)
    return mutate


# name → (mutation of the scenario's recipe, or a function returning the file's text; one list of fragments per error line)
def _expert_with_a_missing_shard(r, t):
    """An expert whose index names a shard file that is not there (a download cut short)."""
    expert = t / "cut-short"
    shutil.copytree(r["models"][1]["model"], expert, copy_function=os.symlink)
    names = [name for name in json.loads((expert / "model.safetensors.index.json").read_text())["weight_map"]] \
        if (expert / "model.safetensors.index.json").exists() else ["model.embed_tokens.weight"]
    weight_map = {name: "model.safetensors" for name in names}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (expert / "model.safetensors.index.json").unlink(missing_ok=True)
    (expert / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    r["featcal"]["data"][str(expert)] = r["featcal"]["data"].pop(r["models"][1]["model"])
    r["models"][1]["model"] = str(expert)


def _supplied_merge_without_weights(r, t):
    """A merge directory with the merge's config and tokenizer and no weights (a copy that left them behind)."""
    supplied = t / "supplied"
    supplied.mkdir()
    for item in Path(r["base_model"]).iterdir():
        if not item.name.startswith("model.safetensors") and item.is_file():
            shutil.copy(item, supplied / item.name)
    (supplied / "model.safetensors.index.json").unlink(missing_ok=True)
    r["featcal"]["merged"] = str(supplied)


def _alpaca_with_a_number_for_input(r, t):
    first_data_file(r, t, "alpaca.jsonl", json.dumps({"instruction": "do", "input": 3, "response": "ok"}) + "\n")
    r["featcal"]["data"][expert_of(r, 0)]["format"] = "alpaca"


def _start_token_not_in_the_vocabulary(r, _t):
    r["featcal"]["data"][expert_of(r, 1)] = {"generate": {"start": "<nope>", "samples": 2}}


CASES = {
    "a generation start that is no token": (_start_token_not_in_the_vocabulary, [
        ["featcal.data.", ".generate.start: '<nope>' is not a token of the expert's vocabulary"]]),
    "a tokenizer source that is not there": (lambda r, t: r.update(tokenizer_source=str(t / "nowhere")), [
        ["bad.yaml: tokenizer_source: ", "nowhere: model directory does not exist (tokenizer_source: base, union, or a model)"]]),
    "an alpaca input that is a number": (_alpaca_with_a_number_for_input, [
        ["alpaca.jsonl: record 0: field 'input' is a number (int), not a string; format: alpaca reads it as text"]]),
    "a JSON file holding an empty list": (lambda r, t: first_data_file(r, t, "cal.json", "[]"), [["cal.json: no records"]]),
    "a text of whitespace only": (lambda r, t: first_data_file(r, t, "cal.jsonl", '{"text": "ok"}\n{"text": " \\n\\t"}\n'), [
        ["cal.jsonl: record 1: field 'text' is only whitespace; drop the record or fill it"]]),
    "a CSV file with an empty cell": (lambda r, t: first_data_file(r, t, "cal.csv", "text\nhello there\n\"\"\n"), [
        ["cal.csv: record 1: field 'text' is null"]]),
    "a chat template mergekit cannot use": (_set(lambda r: r.update(chat_template="{{ bogus")), [
        ["bad.yaml: chat_template: {{ bogus: mergekit takes auto, a template it ships (alpaca, chatml, exaone, llama3, mistral) "
         "or a Jinja template"]]),
    "a chat template that does not parse": (_set(lambda r: r.update(chat_template="{% for m in messages %}{{ m.content }}")), [
        ["bad.yaml: chat_template: not a Jinja template transformers can render (line 1: "]]),
    "the base named as the merge": (_set(lambda r: r["featcal"].update(merged=r["base_model"])), [
        ["featcal.merged: ", " is base_model ", ", not the merge of the recipe's models; name the merge's directory"]]),
    "an expert named as the merge": (_set(lambda r: r["featcal"].update(merged=r["models"][1]["model"])), [
        ["featcal.merged: ", " is the expert ", ", not the merge of the recipe's models"]]),
    "an expert whose index names a missing shard": (_expert_with_a_missing_shard, [
        ["models: ", "cut-short: model.safetensors.index.json: points at missing shard file model-00002-of-00002.safetensors"]]),
    "a supplied merge without weights": (_supplied_merge_without_weights, [
        ["featcal.merged: ", "supplied: no model.safetensors or model.safetensors.index.json found"]]),
    "parameter name typo": (_set(lambda r: r["models"][0].update(parameters={"wieght": 0.5})), [
        ["models.0.parameters.wieght: not a parameter of merge method task_arithmetic; did you mean 'weight'?"]]),
    "parameter of the wrong type": (_set(lambda r: r["models"][1]["parameters"].update(weight="heavy")), [
        ["models.1.parameters.weight: expected a number (got 'heavy')"]]),
    "global parameter given per model": (_set(lambda r: r["models"][2]["parameters"].update(normalize=True)), [
        ["models.2.parameters.normalize: a global parameter of task_arithmetic"]]),
    "required parameter missing": (_set(lambda r: r["models"][2].pop("parameters")), [
        ["models.2.parameters: merge method task_arithmetic needs weight for model"]]),
    "linear without a weight for the base": (_set(lambda r: r.update(merge_method="linear")), [
        ["bad.yaml: parameters: merge method linear needs weight for the base model too"]]),
    "too many experts for nuslerp": (_set(lambda r: r.update(merge_method="nuslerp")), [
        ["models: merge method nuslerp merges exactly 2 experts besides the base model; this recipe has 3"]]),
    "a Mixtral base": (_mixtral_base, [
        ["base_model", "mixtral-base: architecture ['MixtralForCausalLM'] is a mixture of experts"],
        *[["differs from the base model's ['MixtralForCausalLM']"]] * 3]),
    "duplicate keys": (_duplicates, [["bad.yaml: dtype: given twice (lines "], ["bad.yaml: featcal.samples: given twice (lines "]]),
    "YAML syntax": (_bad_yaml, [
        ["bad.yaml: not valid YAML at line 2, column 11: did not find expected ',' or ']' (while parsing a flow sequence at line 1)"]]),
    "featcall block": (_set(lambda r: r.update(featcall=r.pop("featcal"))), [["bad.yaml: featcall: unknown key; did you mean 'featcal'?"]]),
    "unknown projection": (_set(lambda r: r["featcal"].update(modules=["q_prj", "up_proj"])), [
        ["bad.yaml: featcal.modules: unknown projection 'q_prj' (expected one of q_proj, k_proj, v_proj, o_proj, gate_proj"]]),
    "per-layer values for another depth": (_set(lambda r: r["featcal"].update({key: {"per_layer": [value] * 2} for key, value in
                                                                              (("lambda", 1e-3), ("alpha", 0.3), ("rho", 0.5))})), [
        ["bad.yaml: featcal.lambda.per_layer: 2 values for a model of 3 decoder layers"]]),
    "an expert with another norm epsilon": (_expert_with_another_norm_epsilon, [
        ["other-eps/config.json: config rms_norm_eps = 0.0001 differs from the base model's 1e-05"]]),
    "an expert declaring quantized weights": (expert_with_a_quantization_config, [
        ["quantized/config.json: quantization_config (bitsandbytes): featcal-llm merges and calibrates unquantized weights"]]),
    "a JSON file of columns": (lambda r, t: first_data_file(r, t, "cal.json", json.dumps({"text": ["a b", "c d", "e f"]})), [
        ["cal.json: record 0: field 'text' is a list, not a string;", "a JSON file holding one object of lists (columns) is one record to datasets"]]),
    "a dataset directory without data files": (lambda r, t: dataset_directory(r, t, {}), [
        ["ds: the directory holds no data file datasets reads (JSON lines, JSON, CSV, parquet, text, ...)"]]),
    "a dataset directory without the split asked for": (lambda r, t: dataset_directory(
        r, t, {"train.jsonl": '{"text": "a b"}\n'}, split="validation"), [
        [".split: validation: ", "ds has the split train (named by its files, as datasets reads them)"]]),
    "a base without tokenizer files": (_base_without_tokenizer, [
        ["featcal.tokenizer: ", "bare-base: no tokenizer files (tokenizer.json, tokenizer_config.json, tokenizer.model or vocab.json)"]]),
    "chat without a chat template": (_chat_records_without_a_template, [
        ["format: chat needs a tokenizer with a chat template"],
        ["plain-expert.generate.chat_template: empty, but the expert's tokenizer has no chat template"]]),
    "a base model that is a number": (_set(lambda r: r.update(base_model=5)), [
        ["bad.yaml: base_model: expected a model path or hub id (a string: path, or path+lora for an adapter) (got 5)"]]),
    "a data entry that is a number": (_set(lambda r: r["featcal"]["data"].update({expert_of(r, 0): 3})), [
        ["bad.yaml: featcal.data.", ": expected a mapping of path, generate, split, name, format, text, instruction, input, response, "
                           "prompt, messages, samples, weight (got 3)"]]),
    "model path typo": (model_path_typo, [["models: ", "x: model directory does not exist; did you mean", "(featcal.data names it)?"]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validate_and_run_refuse_alike(scenario, tmp_path, case):
    mutate, expected = CASES[case]
    recipe = write_edited(scenario, tmp_path, mutate)
    validated = CliRunner().invoke(main, ["validate", str(recipe)])
    ran = CliRunner().invoke(main, ["run", str(recipe)])
    assert validated.exit_code == 2 and ran.exit_code == 2, (validated.output, ran.output, ran.exception)
    errors = error_lines(validated)
    assert len(errors) == len(expected), errors
    for fragments in expected:
        assert any(all(fragment in line for fragment in fragments) for line in errors), (fragments, errors)
    assert error_lines(ran) == errors
    from featcal_llm.io.validate import check_before_run  # the pipeline's own check, which parses with mergekit itself

    with pytest.raises(RecipeProblems) as refused:
        check_before_run(recipe)
    assert [str(problem) for problem in refused.value.problems] == errors
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged").exists()


def test_a_key_given_twice_in_a_list_item_and_a_recipe_not_utf8_name_their_lines(tmp_path):
    """An expert's entry with `model:` twice (models.0.model, lines 3 and 4); a recipe saved as Latin-1 names the byte
    and the line it stands on (the third)."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.recipe_yaml import read_yaml_mapping

    recipe = tmp_path / "r.yaml"
    recipe.write_text("merge_method: linear\nmodels:\n  - model: a\n    model: b\n")
    problems = []
    read_yaml_mapping(recipe, problems)
    assert [str(problem) for problem in problems] == [
        f"{recipe}: models.0.model: given twice (lines 3 and 4); YAML would keep the second silently: keep one"]
    recipe.write_bytes(b"merge_method: linear\nmodels: []\n# caf\xe9\n")
    with pytest.raises(FeatCalError) as error:
        read_yaml_mapping(recipe, [])
    assert str(error.value) == f"{recipe}: not UTF-8 text (byte 0xe9 on line 3); save the recipe as UTF-8"


def test_merge_keys_are_no_key_given_twice_and_a_shared_mappings_repeat_is_named_once(tmp_path):
    """Two `<<:` merge keys in one mapping are both merged (PyYAML keeps both mappings' keys), so neither is a key given
    twice; a key the shared mapping repeats is named where it is written, not again where each alias brings it in."""
    from featcal_llm.io.recipe_yaml import read_yaml_mapping

    recipe = tmp_path / "r.yaml"
    recipe.write_text("a: &a {x: 1}\nb: &b {y: 2}\nc:\n  <<: *a\n  <<: *b\n  z: 3\n")
    problems = []
    assert read_yaml_mapping(recipe, problems)["c"] == {"x": 1, "y": 2, "z": 3} and problems == []
    recipe.write_text("shared: &s\n  x: 1\n  x: 2\nc:\n  <<: *s\nd:\n  <<: *s\n")
    read_yaml_mapping(recipe, problems)
    assert [str(problem) for problem in problems] == [
        f"{recipe}: shared.x: given twice (lines 2 and 3); YAML would keep the second silently: keep one"]


def test_duplicate_keys_name_both_lines(scenario, tmp_path):
    recipe = write_edited(scenario, tmp_path, _duplicates)
    lines = recipe.read_text().splitlines()
    dtype, samples = lines.index("dtype: float32") + 1, lines.index("  samples: 16") + 1
    assert error_lines(CliRunner().invoke(main, ["validate", str(recipe)])) == [
        f"{recipe}: dtype: given twice (lines {dtype} and {dtype + 1}); YAML would keep the second silently: keep one",
        f"{recipe}: featcal.samples: given twice (lines {samples} and {samples + 1}); YAML would keep the second silently: keep one"]


MERGEKIT_REFUSES = {  # validate refuses these before any work; mergekit's own merge refuses them too, minutes in on a real model
    "parameter of the wrong type": "validation error for float",
    "required parameter missing": "Missing required parameter weight",
    "too many experts for nuslerp": "requires exactly 2 non-base inputs",
    "linear without a weight for the base": "Missing required parameter weight",
}


@pytest.mark.parametrize("case", list(MERGEKIT_REFUSES))
def test_mergekit_itself_refuses_what_validate_refuses_of_its_parameters(scenario, tmp_path, case):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    recipe = recipe_of(scenario, tmp_path)
    CASES[case][0](recipe, tmp_path)
    recipe.pop("featcal")
    with pytest.raises(Exception) as refused:
        run_merge(MergeConfiguration.model_validate(recipe), str(tmp_path / "merge"), options=MergeOptions(quiet=True, write_model_card=False))
    assert MERGEKIT_REFUSES[case] in str(refused.value)
    recipe["merge_method"] = "task_arithmetic" if case != "linear without a weight for the base" else "linear"
    recipe.setdefault("parameters", {})["weight"] = 0.5  # the fix validate names: mergekit merges it
    for entry in recipe["models"]:
        entry["parameters"] = {"weight": 0.5}
    if case == "too many experts for nuslerp":
        recipe.update(merge_method="nuslerp", models=recipe["models"][:2])
        recipe.pop("parameters")
    run_merge(MergeConfiguration.model_validate(recipe), str(tmp_path / "fixed"), options=MergeOptions(quiet=True, write_model_card=False))
    assert (tmp_path / "fixed" / "config.json").is_file()
    from featcal_llm.io.validate import check_recipe  # and validate passes what mergekit merged

    featcal = recipe_of(scenario, tmp_path)["featcal"]
    featcal["data"] = {name: spec for name, spec in featcal["data"].items() if name in [entry["model"] for entry in recipe["models"]]}
    (tmp_path / "fixed.yaml").write_text(yaml.safe_dump({**recipe, "featcal": featcal}, sort_keys=False))
    assert check_recipe(tmp_path / "fixed.yaml", plan=False).problems == []


def test_per_layer_depth_is_refused_in_the_engines_words(scenario, tmp_path):
    """validate checks the depth without torch; the engine's own refusal (engine/method.py) says the same line."""
    from featcal_llm.engine.method import objective_for
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.recipe import read_recipe

    recipe = write_edited(scenario, tmp_path, CASES["per-layer values for another depth"][0])
    (line,) = error_lines(CliRunner().invoke(main, ["validate", str(recipe)]))
    with pytest.raises(FeatCalError) as raised:
        objective_for(read_recipe(recipe, mergekit=False).featcal, 3, str(recipe))
    assert str(raised.value) == line


def test_a_clean_recipe_is_parsed_by_mergekit_for_run_and_by_the_copy_for_validate(scenario, tmp_path):
    from featcal_llm.io.validate import check_before_run, check_recipe

    path = tmp_path / "clean.yaml"
    path.write_text(yaml.safe_dump(recipe_of(scenario, tmp_path), sort_keys=False))
    checked = check_recipe(path, plan=False)
    assert checked.problems == [] and type(checked.recipe.merge_config).__module__ == "featcal_llm.io.mergekit_config"
    recipe = check_before_run(path)
    assert type(recipe.merge_config).__module__ == "mergekit.config"
    assert [str(e.reference) for e in recipe.experts] == [str(e.reference) for e in checked.recipe.experts]
    assert recipe.merge_config.model_dump(mode="json") == checked.recipe.merge_config.model_dump(mode="json")


def test_validate_imports_no_torch_on_a_clean_or_a_bad_recipe(scenario, tmp_path):
    """The whole recipe, mergekit part and models included, is checked from the schema and the configs alone."""
    clean = tmp_path / "clean.yaml"
    clean.write_text(yaml.safe_dump(recipe_of(scenario, tmp_path), sort_keys=False))
    refined = tmp_path / "refine-on-cpu.yaml"  # its memory plan asks whether the CPU computes bf16 natively
    recipe = recipe_of(scenario, tmp_path)
    recipe["featcal"].update(refine=True, device="cpu")
    refined.write_text(yaml.safe_dump(recipe, sort_keys=False))
    (tmp_path / "bad").mkdir()
    bad = write_edited(scenario, tmp_path / "bad", CASES["parameter name typo"][0])
    mixtral = tmp_path / "mixtral"
    mixtral.mkdir()
    arch = write_edited(scenario, mixtral, _mixtral_base)
    code = ("import sys\nfrom featcal_llm.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as exit:\n    print('exit', exit.code)\n"
            f"print('loaded', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    for command, recipe, status in [("validate", clean, 0), ("validate", refined, 0), ("validate", bad, 2), ("validate", arch, 2), ("run", bad, 2), ("run", arch, 2)]:
        result = subprocess.run([sys.executable, "-c", code, command, str(recipe)], capture_output=True, text=True, cwd=tmp_path)
        assert result.stdout.splitlines()[-2:] == [f"exit {status}", "loaded []"], (command, recipe, result.stdout, result.stderr)


def test_the_refusal_table_in_the_docs_is_what_both_commands_say(tmp_path, monkeypatch):
    """docs/validate.md's lines, from the same recipes (tests/validate_refusals.py), as the code prints them today."""
    import huggingface_hub

    import validate_refusals as refusals

    doc = (Path(__file__).parents[1] / "docs" / "validate.md").read_text(encoding="utf-8")
    paths = refusals.write_cases(tmp_path, refusals.build(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert f"`{paths['clean'].name}: ok` (exit 0)" in doc and CliRunner().invoke(main, ["validate", paths["clean"].name]).exit_code == 0
    for slug, (what, _, extra) in refusals.CASES.items():
        validated = CliRunner().invoke(main, ["validate", paths[slug].name])
        ran = CliRunner().invoke(main, ["run", paths[slug].name, *extra])
        errors = [line for line in validated.stderr.splitlines() if ": error: " in line]
        assert ran.exit_code == 2 and (extra or validated.exit_code == 2), (slug, validated.output, ran.output)
        row = f"| {what} | {'(no `--push-to-hub` option: nothing to check)' if extra else refusals._cell(errors)} | " \
              f"{refusals._cell([line for line in ran.stderr.splitlines() if ': error: ' in line])} |"
        assert row in doc, (slug, row)


def test_a_recipe_that_is_not_utf8_is_refused_in_one_line(scenario, tmp_path):
    """A recipe saved in Latin-1/Windows-1252 (a comment `# café`): both commands died in a UnicodeDecodeError traceback
    (exit 1) instead of one line naming the file, as a data file that is not UTF-8 gets."""
    recipe = recipe_of(scenario, tmp_path)
    path = tmp_path / "r.yaml"
    path.write_bytes(yaml.safe_dump(recipe, sort_keys=False).encode() + "# café\n".encode("latin-1"))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    ran = CliRunner().invoke(main, ["run", str(path)])
    for result in (validated, ran):
        assert isinstance(result.exception, SystemExit) and result.exit_code == 2, repr(result.exception)
    assert len(error_lines(validated)) == 1 and error_lines(validated)[0].startswith(f"{path}: ") and "UTF-8" in error_lines(validated)[0]
    assert error_lines(ran) == error_lines(validated)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "out").exists()

