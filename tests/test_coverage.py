"""`expert_weights: coverage`: each expert weighs 1 plus the share of the other experts' gain over the base it also achieves.

The coverage pass's NLLs are checked against each model's own full forward (transformers' causal LM: its
embedding scaling, final norm, tied head and soft-capped logits), and the calibrated update against the brute
force run with the weights those NLLs give.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from reference import brute_force_featcal
from test_exactness import TOLERANCE, delta_error, read_weights
from scenario import build_scenario
from test_head import reference_models

from featcal_llm.tiny import save_model

from featcal_llm.maths.coverage import coverage_weights
from featcal_llm.pipeline import run_recipe


def test_coverage_weights_by_hand():
    base = {"a": 3.0, "b": 3.0, "c": 3.0}
    losses = {  # model → records → NLL
        "a": {"a": 2.0, "b": 2.4, "c": 2.6},  # does b's work fully (clipped at 1), half of c's
        "b": {"a": 3.5, "b": 2.5, "c": 2.9},  # worse than the base on a's records: 0; an eighth of c's gain
        "c": {"a": 2.5, "b": 3.0, "c": 2.2},
    }
    assert coverage_weights(losses, base) == pytest.approx({"a": 2.5, "b": 1.125, "c": 1.5})
    no_gain = {**base, "b": 2.4}  # b is no better than the base on its own records: nobody shares its gain
    assert coverage_weights(losses, no_gain)["a"] == pytest.approx(1.5)
    # the base scores each expert's records differently: every share is against the base on *those* records
    uneven = {"a": 2.0, "b": 4.0, "c": 3.0}
    # (a's own gain is 0 now, so no one shares it; b's is 1.5 and c's 0.8)
    assert coverage_weights(losses, uneven) == pytest.approx({"a": 1 + 1 + 0.5, "b": 1 + 0.1 / 0.8, "c": 1 + (4.0 - 3.0) / 1.5})
    exactly = {**base, "b": 2.5}  # b's gain is exactly 0 (an unmodified copy of the base): no share, no division by 0
    assert coverage_weights(losses, exactly)["a"] == pytest.approx(1.5)


def full_model_nll(model, sequences: list[list[int]]) -> float:
    """Token-weighted mean next-token NLL through the whole causal LM, one record at a time (no padding at all)."""
    total, count = 0.0, 0
    for ids in sequences:
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        if getattr(model.config, "final_logit_softcapping", None):
            assert logits.abs().max() <= model.config.final_logit_softcapping  # the family capped them itself
        total += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return total / count


def card_front(output) -> dict:
    """The card's front matter, with the run's record (featcal_weights.json) under `featcal`, rounded as a card shows it."""
    from featcal_llm.io.run_record import read_run_record
    from featcal_llm.io.card_meta import rounded

    return yaml.safe_load((output / "README.md").read_text().split("---")[1]) | {"featcal": rounded(read_run_record(output))}


def exact_weights(output) -> dict:
    """featcal_weights.json: the NLLs and weights the card shows rounded, at full precision."""
    return json.loads((output / "featcal_weights.json").read_text())


def trained_scenario(root, family: str, steps: tuple[int, ...], kinds: tuple[tuple[int, ...], ...] | None = None):
    """A float64 scenario whose experts are fine-tuned on their own records (expert i for steps[i] Adam steps), so
    that each has a gain over the base to share: random experts' NLLs differ from the base's by noise only.
    `kinds[i]`: the experts whose records expert i is fine-tuned on, in turn (default: its own)."""
    from scenario import build_char_tokenizer
    from test_exactness import scenario_family
    from transformers import AutoModelForCausalLM

    scenario = build_scenario(root, experts=len(steps), layers=2, samples=12, words=(4, 10), dtype="float64", **scenario_family(family))
    tokenizer = build_char_tokenizer()
    records = {name: [tokenizer(json.loads(line)["text"])["input_ids"] for line in path.read_text().splitlines()]
               for name, path in scenario.data.items()}
    names = list(scenario.experts)
    for index, ((name, path), count) in enumerate(zip(scenario.experts.items(), steps)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        texts = [records[names[k]][i] for i in range(len(records[name])) for k in (kinds[index] if kinds else (index,))]
        for step in range(count):
            ids = torch.tensor([texts[step % len(texts)]])
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        shutil.rmtree(path)
        save_model(model.eval(), tokenizer, path, max_shard_size="40KB")
    return scenario


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # untied head; tied head with scaled embeddings and soft-capped logits
def test_coverage_nll_and_update_match_full_model_forward_and_brute_force(family, tmp_path):
    scenario = trained_scenario(tmp_path / "scenario", family, (24, 6))
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                   expert_weights="coverage")
    output = run_recipe(recipe, progress=False)
    merged, base, experts, sequences = reference_models(scenario)  # 12 records each: the pass scores all of them
    with torch.no_grad():
        losses = {i: {j: full_model_nll(model, sequences[j]) for j in experts} for i, model in experts.items()}
        base_losses = {j: full_model_nll(base, sequences[j]) for j in experts}
    ours = exact_weights(output)["coverage_nll"]
    names = {str(path): name for name, path in scenario.experts.items()}
    worst = max(abs(ours[names[i]][names[j]] - losses[i][j]) for i in experts for j in experts)
    worst = max(worst, *(abs(ours["base"][names[j]] - base_losses[j]) for j in experts))
    print(f"{family}: coverage NLLs within {worst:.1e} of the full forward; NLL {ours}")
    assert worst < 1e-10
    shares = coverage_weights(losses, base_losses)
    assert max(abs(share - 1) for share in shares.values()) > 0.05, "the scenario must give weights other than 1"
    expected = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8, shares=shares).state_dict()
    calibrated, merged_weights = read_weights(output), read_weights(scenario.root / "merged")
    name = "model.layers.1.mlp.down_proj.weight"
    assert delta_error(calibrated[name], expected[name], merged_weights[name]) <= TOLERANCE
    unit = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8).state_dict()
    assert delta_error(calibrated[name], unit[name], merged_weights[name]) > 100 * TOLERANCE  # the weights mattered


def test_a_coverage_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    """The weights are recomputed on the rerun from the same records and models: the resumed layers get the same ones."""
    from test_reliability import resumes_to_the_same_bytes

    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), expert_weights="coverage", dtype="float64")
    resumes_to_the_same_bytes(recipe, tmp_path / "out", 1, monkeypatch)


def test_given_weights_win_and_equal_skips_the_pass(tmp_path, capsys):
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), expert_weights="coverage").read_text())
    recipe["featcal"]["data"][str(scenario.experts["expert1"])]["weight"] = 0.25
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)
    front = card_front(output)["featcal"]
    weights = coverage_weights(*split_base(exact_weights(output)["coverage_nll"]))
    assert front["expert_weights"] == {"expert0": round(weights["expert0"], 4), "expert1": 0.25}
    assert "expert1 0.25 (data.<expert>.weight)" in capsys.readouterr().err
    equal = card_front(run_recipe(scenario.write_recipe(tmp_path / "e.yaml", output=str(tmp_path / "e")), progress=False))
    assert "coverage_nll" not in equal["featcal"] and "expert_weights" not in equal["featcal"]
    assert equal["featcal"]["settings"]["expert_weights"] == "equal"


def split_base(nll: dict) -> tuple[dict, dict]:
    return {model: row for model, row in nll.items() if model != "base"}, nll["base"]


def test_a_bad_expert_weights_is_one_line_naming_the_key(family_scenarios, tmp_path):
    from featcal_llm.errors import FeatCalError

    scenario = family_scenarios("llama")
    with pytest.raises(FeatCalError) as error:
        run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), expert_weights="by-size"), progress=False)
    message = str(error.value).strip()
    assert "featcal.expert_weights" in message and "'coverage' or 'equal'" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_regmean_takes_coverage_weights_when_asked(tmp_path):
    """RegMean's default stays equal (its closed form sums the Grams); `expert_weights: coverage` weighs its sums too."""
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out")).read_text())
    for key in ("lambda", "alpha", "rho", "expert_weights"):
        recipe["featcal"].pop(key)
    recipe["featcal"]["method"] = "regmean"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    plain = card_front(run_recipe(tmp_path / "r.yaml", progress=False))["featcal"]
    assert plain["settings"]["expert_weights"] == "equal" and "coverage_nll" not in plain
    recipe["featcal"].update(expert_weights="coverage", output=str(tmp_path / "cov"))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    covered_output = run_recipe(tmp_path / "c.yaml", progress=False)
    covered = card_front(covered_output)["featcal"]
    exact = coverage_weights(*split_base(exact_weights(covered_output)["coverage_nll"]))
    assert covered["expert_weights"] == {name: round(w, 4) for name, w in exact.items()}
    assert not torch.equal(read_weights(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"],
                           read_weights(tmp_path / "cov")["model.layers.0.mlp.up_proj.weight"])


def test_a_non_finite_nll_is_one_line_naming_the_model_not_a_silent_weight(tmp_path, monkeypatch):
    import featcal_llm.engine.coverage as coverage_module
    from featcal_llm.errors import RunFailure

    scenario = trained_scenario(tmp_path / "scenario", "llama", (4, 2))
    monkeypatch.setattr(coverage_module, "token_log_probs", lambda head, hidden, batch: torch.full(batch.keep.shape, float("nan")))
    with pytest.raises(RunFailure, match=r"expert_weights: coverage: .*NLL on expert .* is not finite") as error:
        run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), expert_weights="coverage"), progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


def test_an_expert_no_better_than_the_base_on_its_own_records_is_named(tmp_path, capsys):
    """The coverage pass has each expert's NLL on its own records beside the base's: an expert that does not beat the base
    there has not learnt its kind of text (a user's trailing experts were worse than the base too), and the run says so."""
    from transformers import AutoModelForCausalLM

    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 24))
    spoilt = scenario.experts["expert1"]
    model = AutoModelForCausalLM.from_pretrained(spoilt, dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    for old in spoilt.glob("model*.safetensors*"):  # its shards and index, written again below
        old.unlink()
    model.save_pretrained(spoilt)
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                   expert_weights="coverage")
    run_recipe(recipe, progress=False)
    _, base, experts, sequences = reference_models(scenario)
    with torch.no_grad():
        behind = {path for path, expert in experts.items() if full_model_nll(expert, sequences[path]) >= full_model_nll(base, sequences[path])}
    err = capsys.readouterr().err
    warned = {line.split("featcal.data.")[1].split(":")[0] for line in err.splitlines()
              if "predicts its own records no better than the base model does" in line}
    assert str(spoilt) in behind and warned == behind, (warned, behind)
    sampled = min(len(sequences[str(spoilt)]), 16)  # the records the pass read, not the sample's cap, where fewer
    assert sampled < 16 and f"nats a token, on {sampled} of them)" in err
    assert f"weighing the experts by coverage: {sampled} records per expert through the base" in err


def test_an_expert_no_better_than_the_base_includes_one_exactly_as_good():
    """`behind_the_base`: an expert whose NLL on its own records equals the base's learnt nothing of them either."""
    from featcal_llm.maths.coverage import behind_the_base

    losses = {"a": {"a": 3.0, "b": 4.0}, "b": {"a": 4.5, "b": 2.0}}
    assert behind_the_base(losses, {"a": 3.0, "b": 2.5}) == {"a": (3.0, 3.0)}
    assert behind_the_base(losses, {"a": 3.1, "b": 1.9}) == {"b": (2.0, 1.9)}


def test_every_weight_given_runs_no_coverage_pass(tmp_path, monkeypatch, capsys):
    """expert_weights: coverage with every expert's `weight:` given (and teachers: own): nothing is left for the pass
    to weigh, so no model runs over the records for it (a forward of the base and every expert: minutes at 8B)."""
    import featcal_llm.engine.coverage as coverage_module

    def refuse(*args, **kwargs):
        raise AssertionError("the coverage pass ran")

    monkeypatch.setattr(coverage_module, "model_losses", refuse)
    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), expert_weights="coverage",
                                                  teachers="own").read_text())
    for weight, entry in zip((1.0, 0.5), recipe["featcal"]["data"].values()):
        entry["weight"] = weight
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)
    assert "coverage" not in capsys.readouterr().err
    assert list(card_front(output)["featcal"]["expert_weights"].values()) == [1.0, 0.5]
