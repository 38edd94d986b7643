"""The model card as the Hub reads it: huggingface_hub's ModelCard parses the front matter; the body says what was done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard, metadata_load
from safetensors.torch import save_file

from featcal_llm.io.card import write_card
from featcal_llm.io.card_edits import append_evaluation, point_usage_at
from featcal_llm.io.run_record import read_run_record
from featcal_llm.io.recipe import load_recipe
from featcal_llm.io.references import ModelSource

CALIBRATED = {"projections": ["mlp.down_proj"], "every_projection": True, "norms": False, "biases": True, "head": None}


def _recipe(tmp_path: Path, **featcal) -> Path:
    (tmp_path / "local-expert").mkdir(parents=True)
    (tmp_path / "code.jsonl").write_text('{"text": "x"}\n')
    block = {"merged": str(tmp_path / "merged"), "output": str(tmp_path / "my-merge"), "data": {
        "org/math@v2": {"path": "MergeBench/math_val", "format": "alpaca", "instruction": "query"},
        "org/code+org/code-lora": {"path": str(tmp_path / "code.jsonl")},
        str(tmp_path / "local-expert"): {"generate": {}},
    }, **featcal}
    recipe = {"merge_method": "task_arithmetic", "base_model": "meta-llama/Llama-3.2-3B",
              "models": [{"model": name, "parameters": {"weight": 0.3}} for name in block["data"]],
              "dtype": "bfloat16", "featcal": block}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _card(tmp_path: Path, bias: bool = False, **featcal) -> tuple[Path, str]:
    """A card written for a recipe with hub experts, a base whose card says llama3.2, and raw float NLLs."""
    recipe = load_recipe(_recipe(tmp_path, **featcal))
    base = tmp_path / "base-snapshot"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: llama3.2\n---\n# Llama\n")
    output = tmp_path / "checkpoint"
    output.mkdir()
    tensors = {"model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}
    if bias:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(2)
    save_file(tensors, output / "model.safetensors")
    names = [expert.name for expert in recipe.experts]
    coverage = {"base": {name: 4.607189019958311 for name in names}, **{name: {other: 3.1234567891 for other in names} for name in names}}
    write_card(output, recipe, str(tmp_path / "merged"), {name: 100 for name in names}, precisions={"dtype": torch.float32},
               sources={"base_model": ModelSource("meta-llama/Llama-3.2-3B", base)}, calibrated=CALIBRATED,
               weights={name: 1.0 + index / 3 for index, name in enumerate(names)}, coverage=coverage,
               advantage={name: {"tokens_ahead": 0.4567891, "lead": 0.2071234567} for name in names})
    return output, (output / "README.md").read_text(encoding="utf-8")


def test_the_hub_reads_the_lineage_license_datasets_and_task(tmp_path):
    output, text = _card(tmp_path)
    data = ModelCard.load(output / "README.md").data
    assert data.base_model == ["meta-llama/Llama-3.2-3B", "org/math", "org/code", "org/code-lora"]  # every hub model, no revision
    assert data.base_model_relation == "merge"
    assert data.license == "llama3.2"  # the base's, from its card on this machine
    assert data.datasets == ["MergeBench/math_val"]  # the local file and the generated texts are no hub datasets
    assert (data.pipeline_tag, data.library_name, data.tags) == ("text-generation", "transformers", ["merge", "mergekit", "featcal"])
    front = yaml.safe_load(text.split("---")[1])
    assert list(front) == ["base_model", "base_model_relation", "license", "datasets", "pipeline_tag", "library_name", "tags"]
    assert metadata_load(output / "README.md") == front  # huggingface_hub's own reader sees the same keys
    assert "4.607189" not in text and "3.12345" not in text and "1.3333333" not in text  # the card rounds...
    exact = json.loads((output / "featcal_weights.json").read_text())  # ...the run's record beside it does not
    assert exact["coverage_nll"]["base"]["org/math@v2"] == 4.607189019958311 and exact["expert_weights"]["org/code+org/code-lora"] == 4 / 3
    assert exact["hyperparameters"] == {"lambda": 1e-5, "alpha": 0.15, "rho": 0.5, "eps": 1e-8} and exact["method"] == "featcal"


def test_a_license_key_wins_and_a_base_without_a_card_gives_none(tmp_path):
    output, _ = _card(tmp_path / "a", license="apache-2.0")
    assert ModelCard.load(output / "README.md").data.license == "apache-2.0"
    recipe = load_recipe(_recipe(tmp_path / "b"))
    (tmp_path / "b" / "out").mkdir()
    write_card(tmp_path / "b" / "out", recipe, "merged", {expert.name: 1 for expert in recipe.experts}, calibrated=CALIBRATED)
    assert ModelCard.load(tmp_path / "b" / "out" / "README.md").data.license is None


def test_the_body_is_plain_sentences_with_usage_and_citation(tmp_path):
    output, text = _card(tmp_path)
    body = text.split("---", 2)[2]
    assert body.startswith("\n\n# my-merge\n\nThis model is a merge of 3 experts fine-tuned from `meta-llama/Llama-3.2-3B`")
    assert "into the merged model (`merged`)" in body and "to the merged model." in body
    assert "Every linear projection of every decoder layer was re-fitted. The norms keep the merged model's scales." in body
    assert "bias" not in body.lower()  # the checkpoint has none: nothing to say about them
    assert "in forward order" not in body and "also updated:" not in body
    assert 'model_id = "my-merge"' in body and "AutoModelForCausalLM.from_pretrained(model_id" in body
    assert "FeatCal: Feature Calibration for Post-Merging Models" in body and "Gu, Yanggan and Cai, Shuo and Wang, Zihao and Wang, Wenjun" in body
    assert body.index("## Usage") < body.index("## Recipe") < body.index("## Citation")
    point_usage_at(output, "me/my-merge")
    assert 'model_id = "me/my-merge"' in (output / "README.md").read_text()


@pytest.mark.parametrize("biases", [True, False])
def test_biases_are_named_only_for_a_model_that_has_them(tmp_path, biases):
    output, text = _card(tmp_path, bias=biases)
    body = text.split("---", 2)[2]
    assert ("The projections' biases were updated with their weights." in body) is biases
    assert ("biases" in read_run_record(output)["settings"]) is biases


def test_the_clamped_lead_is_named_as_such_and_the_signed_one_is_the_trailing_decision(tmp_path):
    """`expert_lead` holds the mean of max(0, lead), `taught_by_merge` the signed mean: two names, two meanings."""
    recipe = load_recipe(_recipe(tmp_path))
    names = [expert.name for expert in recipe.experts]
    (tmp_path / "out").mkdir()
    calibrated = {**CALIBRATED, "taught_by_merge": {names[1]: -0.2471}}
    write_card(tmp_path / "out", recipe, "merged", {name: 10 for name in names}, calibrated=calibrated,
               advantage={name: {"tokens_ahead": 0.25, "lead": 0.159} for name in names})
    run = read_run_record(tmp_path / "out")
    assert run["expert_lead"]["org/code+org/code-lora"] == {"tokens_ahead": 0.25, "mean_positive_lead": 0.159}
    assert run["taught_by_merge"] == {"org/code+org/code-lora": -0.2471}
    assert "mean_positive_lead" in run["about"]["expert_lead"] and "signed" in run["about"]["taught_by_merge"]
    body = (tmp_path / "out" / "README.md").read_text()
    assert "ahead of the merged model on 25% of its tokens, mean positive lead 0.159 nats a token; it predicts its own " \
           "records worse than the merged model (by 0.247 nats a token)" in body
    assert "*mean positive lead* is max(0, log p_expert − log p_merged)" in body


def test_the_body_has_no_python_reprs_and_links_the_paper(tmp_path):
    recipe = load_recipe(_recipe(tmp_path, shuffle=False))
    names = [expert.name for expert in recipe.experts]
    (tmp_path / "out").mkdir()
    head = {"lambda": 1e-5, "alpha": 1.0, "rho": 0.5, "untied": True}
    write_card(tmp_path / "out", recipe, "merged", {name: 10 for name in names}, precisions={"dtype": torch.bfloat16},
               calibrated={**CALIBRATED, "every_projection": False, "projections": ["mlp.down_proj", "self_attn.q_proj"], "head": head})
    body = (tmp_path / "out" / "README.md").read_text().split("---", 2)[2].split("## Usage")[0]  # the prose, not the code
    for repr_ in ("False", "True", "None", "{'", "['", "torch."):
        assert repr_ not in body, repr_
    assert "- records shuffled before they are taken: no\n" in body and "- norm scales re-fitted: no\n" in body
    assert "- projections re-fitted: `mlp.down_proj`, `self_attn.q_proj`\n" in body and "- compute precision (the weights keep the merge's dtypes): bfloat16\n" in body
    assert "- LM head: re-fitted (λ = 1e-05, α = 1, ρ = 0.5), untied from the input embeddings\n" in body
    assert "FeatCal feature calibration ([Gu et al., 2026](https://github.com/egangu/featcal))" in body
    assert "url    = {https://github.com/egangu/featcal}" in (tmp_path / "out" / "README.md").read_text()  # the citation


def test_an_unchanged_run_shows_no_head_or_refit_settings(tmp_path):
    """Every expert trailed the merge: nothing was re-fitted, so the card names no head, projection or norm setting."""
    recipe = load_recipe(_recipe(tmp_path))
    names = [expert.name for expert in recipe.experts]
    (tmp_path / "out").mkdir()
    calibrated = {**CALIBRATED, "head": {"lambda": 1e-5, "alpha": 1.0, "rho": 0.5, "untied": False}, "unchanged": True,
                  "taught_by_merge": {name: -0.1 for name in names}}
    write_card(tmp_path / "out", recipe, "merged", {name: 10 for name in names}, calibrated=calibrated)
    body = (tmp_path / "out" / "README.md").read_text()
    assert "this model is the merged model, unchanged" in body
    assert "LM head" not in body and "re-fitted:" not in body and "## Hyper-parameters" not in body and "featcal_drift" not in body
    run = read_run_record(tmp_path / "out")
    assert run["unchanged"] is True and not {"head", "projections", "norms", "biases"} & set(run["settings"])
    assert run["settings"]["trailing_experts"] == "merge"  # what decided it stays


def _summary(model_dir: Path) -> dict:
    return {"schema": 1, "label": model_dir.name, "model": {"path": str(model_dir), "fingerprint": "f"},
            "suite": {"name": "mergebench", "version": "2"},
            "tasks": {"gsm8k": {"label": "GSM8K", "metric": "exact_match,flexible-extract", "score": 61.2345, "value": 0.612345},
                      "ifeval": {"label": "IFEval", "metric": "prompt_level_strict_acc,none", "score": 70.0, "value": 0.7}}}


def test_eval_scores_become_the_hub_s_model_index(tmp_path):
    output, _ = _card(tmp_path)
    results = tmp_path / "eval"
    results.mkdir()
    (results / "merged.json").write_text(json.dumps(_summary(tmp_path / "merged")))  # the merge's: not this model's
    (results / "my-merge.json").write_text(json.dumps(_summary(output)))
    (results / "fingerprints.json").write_text("{}")
    summary = json.loads((results / "my-merge.json").read_text())
    append_evaluation(output, "| Model | GSM8K |\n|---|---:|\n| my-merge | 61.2 |\n", summary)
    card = ModelCard.load(output / "README.md")
    results_read = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results_read == {("gsm8k", "exact_match"): 61.23, ("ifeval", "prompt_level_strict_acc"): 70.0}
    assert card.data.model_name == "checkpoint" and card.data.license == "llama3.2"  # the other keys are kept
    text = (output / "README.md").read_text()
    assert text.index("## Evaluation") < text.index("## Recipe") and "| my-merge | 61.2 |" in text
    assert text.count("## Usage") == 1 and text.startswith("---\n")


def test_an_eval_without_scores_for_this_model_adds_the_table_and_no_model_index(tmp_path):
    output, _ = _card(tmp_path)
    append_evaluation(output, "| Model |\n|---|\n", None)
    assert "model-index" not in metadata_load(output / "README.md") and "## Evaluation" in (output / "README.md").read_text()


def test_a_head_untied_without_the_re_fit_is_said(tmp_path):
    """The head can end untied with `head:` off: the refinement trained a head the files stored apart from the embedding."""
    recipe = load_recipe(_recipe(tmp_path))
    names = [expert.name for expert in recipe.experts]
    (tmp_path / "out").mkdir()
    write_card(tmp_path / "out", recipe, "merged", {name: 10 for name in names}, calibrated={**CALIBRATED, "untied_by_refine": True})
    body = (tmp_path / "out" / "README.md").read_text()
    assert "The refinement trained the LM head apart from the input embeddings: it is a tensor of its own, config " \
           "`tie_word_embeddings: false`." in body


@pytest.mark.parametrize("smoke", [{"limit": 5}, {"max_gen_toks": 8}])
def test_a_smoke_run_s_scores_are_no_model_index(tmp_path, smoke):
    """Scores of a run with `limit` or `max_gen_toks` set (a CPU dry run) are shown in the table, not published as the
    model's results."""
    output, _ = _card(tmp_path)
    append_evaluation(output, "| Model | GSM8K |\n|---|---:|\n| my-merge | 61.2 |\n", {**_summary(output), **smoke})
    assert "model-index" not in metadata_load(output / "README.md") and "| my-merge | 61.2 |" in (output / "README.md").read_text()


def test_the_card_says_which_recipe_it_shows_and_which_replays(tmp_path):
    output, _ = _card(tmp_path)
    text = " ".join((output / "README.md").read_text().split())
    assert "The recipe as it was written (mergekit configuration plus the `featcal:` block)" in text
    assert "`featcal_recipe.yml` beside this card is the recipe as it ran" in text


def test_the_settings_name_the_trailing_rule_and_coverage_only_where_it_weighed(tmp_path):
    """The trailing rule in words (not the raw value), and "(coverage)" beside an expert's weight only where the
    coverage pass gave it: under `expert_weights: equal` the weights are the recipe's own."""
    from featcal_llm.io.card_settings import SETTING_TEXT

    _, card = _card(tmp_path / "coverage")
    assert f"- {SETTING_TEXT['trailing_experts']}: the merged model (`merge`)\n" in card
    assert card.count(", weight 1.333 (coverage)") == 1
    _, equal = _card(tmp_path / "equal", expert_weights="equal", trailing_experts="keep")
    assert f"- {SETTING_TEXT['trailing_experts']}: the expert itself (`keep`)\n" in equal
    assert ", weight 1.333" in equal and "(coverage)" not in equal


def test_hub_ids_local_paths_and_licence_keys_of_a_base_card(tmp_path, monkeypatch):
    """What the front matter takes from the recipe and the base's card: `org/name` only where no such path is here (a
    deeper path is local whatever it names); a data file found beside the recipe is no hub dataset, from any current
    directory; `license_name`/`license_link` only under licence `other`."""
    from types import SimpleNamespace

    from featcal_llm.io.card_meta import base_license, hub_datasets
    from featcal_llm.io.references import hub_id

    monkeypatch.chdir(tmp_path)
    assert hub_id("org/name@v2") == "org/name" and hub_id("models/org/name") is None and hub_id("./org/name") is None
    (tmp_path / "recipes" / "data").mkdir(parents=True)
    (tmp_path / "recipes" / "data" / "x.jsonl").write_text("{}\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    recipe = SimpleNamespace(path=tmp_path / "recipes" / "r.yaml", base=None, featcal=SimpleNamespace(data={
        "a": SimpleNamespace(path="data/x.jsonl"), "b": SimpleNamespace(path="MergeBench/math_val"), "c": SimpleNamespace(path=None)}))
    assert hub_datasets(recipe) == ["MergeBench/math_val"]
    base = tmp_path / "base"
    base.mkdir()
    for licence, expected in (("apache-2.0", {"license": "apache-2.0"}),
                              ("other", {"license": "other", "license_name": "custom", "license_link": "LICENSE"})):
        (base / "README.md").write_text(f"---\nlicense: {licence}\nlicense_name: custom\nlicense_link: LICENSE\n---\n# base\n")
        assert base_license(recipe, base) == expected


def test_the_replay_sentence_names_the_backend_a_generated_set_needs(tmp_path):
    """`featcal_recipe.yml` pins each generated set's sampling but not its backend (pinning vLLM would refuse a replay on
    a CPU): the card says on what machine running it again makes this checkpoint; without generated data, anywhere."""
    _, body = _card(tmp_path / "a")
    assert "running it again makes this checkpoint on a machine where each `generate:` expert's `backend` resolves as it " \
           "did here (transformers and vLLM draw other samples from one seed)." in body
    _, body = _card(tmp_path / "b", data={"org/code+org/code-lora": {"path": str(tmp_path / "b" / "code.jsonl")}})
    assert "running it again makes this checkpoint." in body and "`backend` resolves" not in body


def test_the_refinement_section_says_why_it_stopped_before_its_last_step():
    """A refinement that stopped early names `patience` and how often it checked; one that ran every step, or whose
    report predates the keys, says nothing more."""
    from featcal_llm.io.refine_card import refine_text

    report = {"params": "full", "lr": 1e-4, "top_k": 64, "steps_run": 12, "max_steps": 40, "chosen_step": 4,
              "eval_every": 4, "patience": 2, "teachers": {"a": "own expert"}, "held_out_kl": {"before": 0.5, "after": 0.25},
              "autocast": None, "master": "float32"}
    assert ("It ran 12 of at most 40 steps, stopping once 2 checks in a row (one every 4 steps) kept no better state "
            "(`patience`). The held-out KL") in refine_text(report)
    assert "stopping once a check (one every 4 steps) kept no better state" in refine_text({**report, "patience": 1})
    assert "The checks' records (3 of `a`'s) were held out of the closed form's statistics too" in refine_text(
        {**report, "held_out_records": {"a": 3}})
    assert "were held out" not in refine_text({**report, "held_out_records": {"a": 0}})  # none held out: no such claim
    for finished in ({**report, "steps_run": 40}, {key: value for key, value in report.items() if key != "patience"}):
        assert f"It ran {finished['steps_run']} of at most 40 steps. The held-out KL" in refine_text(finished)


@pytest.mark.parametrize("written, expected", [
    ({"master": "float32", "autocast": "bfloat16"}, ("float32", True)),
    ({"master": "float32", "autocast": None}, ("float32", False)),
    ({"master": "float64", "autocast": None}, ("float64", False)),
    ({"master": "torch.float32", "autocast": "torch.bfloat16"}, ("float32", True)),  # as earlier versions wrote them
    ({"master": "torch.float32", "autocast": "None"}, ("float32", False)),
])
def test_the_refine_report_names_its_precision_in_json_and_earlier_reports_read_alike(written, expected):
    """`featcal_refine.json` wrote `"autocast": "None"` (a Python repr in a string) and `"torch.float32"`; it writes
    null and `float32` now, and the card and the saved recipe's pinning still read an earlier output's strings."""
    from featcal_llm.io.refine_card import refine_precision
    from featcal_llm.io.saved_recipe import with_refine_pinned

    assert refine_precision(written) == expected
    text = "merge_method: linear\nfeatcal:\n  refine: true\n"
    pinned = yaml.safe_load(with_refine_pinned(text, {"params": "full", **written}))["featcal"]["refine"]
    assert pinned == ({"params": "full"} if expected[0] == "float64" else
                      {"params": "full", "precision": "bfloat16" if expected[1] else "float32"})
