"""`teachers: best`: an expert's records are taught by the other expert that predicts them better beyond doubt.

The scenario's expert0 is fine-tuned on both experts' records (a broad expert), expert1 a few steps on its own (a
narrow one that expert0 beats on its own text). The choice is checked against the leads computed here from the whole
models' forward; the updates against the brute force with expert0 in expert1's place (its token weights read from
expert0's lead over the merge on expert1's records), and far from the brute force that keeps expert1.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from reference import _token_leads, advantage_token_weights, brute_force_featcal, mean_leads
from test_coverage import card_front, exact_weights, trained_scenario
from test_exactness import TOLERANCE, delta_error, read_weights
from test_head import reference_models

from featcal_llm.io.problems import RecipeProblems
from featcal_llm.maths.advantage import lead_moments
from featcal_llm.maths.coverage import better_teachers
from featcal_llm.pipeline import run_recipe


def test_better_teachers_by_hand():
    """The largest lead beyond two standard errors wins; a lead within them, one record, or the expert itself does not."""
    def moments(leads, counts):
        return lead_moments(torch.tensor(leads, dtype=torch.float64), torch.tensor(counts))

    clear = moments([2.0, 2.2, 1.8, 2.1], [10, 10, 10, 10])  # mean 0.2025 nats a token
    clearer = moments([3.0, 3.1, 2.9, 3.2], [10, 10, 10, 10])  # 0.305
    noisy = moments([5.0, -4.0, 6.0, -5.5], [10, 10, 10, 10])  # mean 0.0375, spread far larger
    single = moments([9.0], [10])
    own = moments([0.0] * 4, [10] * 4)
    chosen = better_teachers({"a": {"a": own, "b": clear, "c": clearer}, "b": {"a": noisy, "b": own, "c": single},
                              "c": {"a": moments([-2.0, -2.2, -1.8, -2.1], [10] * 4), "b": noisy, "c": clearer}})
    assert set(chosen) == {"a"}
    teacher, lead, margin = chosen["a"]
    residuals = torch.tensor([3.0, 3.1, 2.9, 3.2], dtype=torch.float64) - 0.305 * 10
    assert teacher == "c" and lead == pytest.approx(0.305) and margin == pytest.approx(2 * math.sqrt(float((residuals ** 2).sum()) / 12) / 10)
    tie = better_teachers({"a": {"b": clear, "c": clear}})
    assert tie["a"][0] == "b"  # the recipe's order breaks a tie


@pytest.fixture(scope="module")
def broad_and_narrow(tmp_path_factory):
    """expert0 trained on both experts' records, expert1 on its own for 3 steps; the models and records in float64."""
    root = tmp_path_factory.mktemp("best-teachers")
    scenario = trained_scenario(root / "scenario", "llama", (48, 3), kinds=((0, 1), (1,)))
    run_recipe(scenario.write_recipe(root / "merge.yaml", output=str(root / "first"), expert_weights="equal"), progress=False)
    return (scenario, *reference_models(scenario))


def _leads_over(own, other, records) -> tuple[float, float]:
    """`other`'s mean lead over `own` per judged token of `records`, and two standard errors of it (records as units)."""
    sums = [float(_token_leads(own, other, record).sum()) for record in records]
    counts = [len(record) - 1 for record in records]
    mean = sum(sums) / sum(counts)
    spread = sum((s - mean * n) ** 2 for s, n in zip(sums, counts)) / ((len(sums) - 1) * len(sums))
    return mean, 2 * math.sqrt(spread) / (sum(counts) / len(counts))


def test_the_broad_expert_teaches_the_narrow_expert_s_records(broad_and_narrow, tmp_path, capsys):
    scenario, merged, base, experts, sequences = broad_and_narrow
    first, second = experts
    ahead, margin = _leads_over(experts[second], experts[first], sequences[second])  # 12 records: the pass scores all
    behind, _ = _leads_over(experts[first], experts[second], sequences[first])
    assert ahead - margin > 0.05 and behind < 0, (ahead, margin, behind)
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                   expert_weights="equal", token_weights="expert_lead", teachers="best")
    output = run_recipe(recipe, progress=False)
    teachers = {first: experts[first], second: copy.deepcopy(experts[first])}  # a copy: the brute force hooks each model once
    assert min(mean_leads(merged, teachers, sequences).values()) > 0  # the merge teaches neither: trailing_experts keeps out
    weights = advantage_token_weights(merged, teachers, sequences)
    reference = brute_force_featcal(merged, base, teachers, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=weights).state_dict()
    kept = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8,
                               token_weights=advantage_token_weights(merged, experts, sequences)).state_dict()
    ours, merged_weights = read_weights(output), read_weights(scenario.root / "merged")
    changed = [name for name in ours if not torch.equal(ours[name], merged_weights[name])]
    error = max(delta_error(ours[name], reference[name], merged_weights[name]) for name in changed)
    away = max(delta_error(ours[name], kept[name], merged_weights[name]) for name in changed)
    print(f"updates within {error:.1e} of the brute force with expert0 teaching expert1's records, {away:.1e} from the own-teacher one")
    assert error <= TOLERANCE and away > 1e-2
    record = exact_weights(output)["teachers"]
    assert list(record) == ["expert1"] and record["expert1"]["teacher"] == "expert0"
    assert record["expert1"]["lead"] == pytest.approx(ahead, abs=1e-9) and record["expert1"]["margin"] == pytest.approx(margin, abs=1e-9)
    assert card_front(output)["featcal"]["settings"]["teachers"] == "best"
    readme = (output / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("- `expert1`"))
    assert "its records were calibrated toward `expert0`, which predicts them better (by 0.813" in line, line
    err = capsys.readouterr().err
    assert "teachers: best: expert0 teaches expert1's records" in err and "; expert1 (taught by expert0) ahead on " in err


def test_on_prompt_response_records_the_choice_reads_the_responses_and_the_nll_every_token(broad_and_narrow, tmp_path):
    """The same experts on completion records (each text cut in two): the coverage pass's NLLs count every token of a
    record (its mean over the scored tokens, from each whole model's forward), while the lead that chooses expert1's
    teacher counts only the tokens that predict its response (test_response_scoring.py judges the lead over the merge
    alike)."""
    from test_coverage import full_model_nll

    from featcal_llm.tiny import build_char_tokenizer

    scenario, merged, base, experts, sequences = broad_and_narrow
    first, second = experts
    tokenizer, starts, names = build_char_tokenizer(), {}, {}
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150,
                                                  dtype="float64", expert_weights="coverage", token_weights="expert_lead",
                                                  teachers="best").read_text())
    for name, path in scenario.data.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        cuts = [max(1, len(row["text"]) // 2) for row in rows]
        written = tmp_path / f"{name}.jsonl"
        written.write_text("".join(json.dumps({"prompt": row["text"][:cut], "completion": row["text"][cut:]}) + "\n"
                                   for row, cut in zip(rows, cuts)))
        expert = str(scenario.experts[name])
        recipe["featcal"]["data"][expert].update(path=str(written), format="completion")
        starts[expert] = [len(tokenizer(row["text"][:cut])["input_ids"]) for row, cut in zip(rows, cuts)][:12]
        names[expert] = name
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)
    with torch.no_grad():
        sums = [float(_token_leads(experts[second], experts[first], record, start).sum())
                for record, start in zip(sequences[second], starts[second])]
        nll = {i: {j: full_model_nll(model, sequences[j]) for j in experts} for i, model in experts.items()}
    counts = [len(record) - max(start, 1) for record, start in zip(sequences[second], starts[second])]  # successors in the response
    mean = sum(sums) / sum(counts)
    spread = sum((s - mean * n) ** 2 for s, n in zip(sums, counts)) / ((len(sums) - 1) * len(sums))
    margin = 2 * math.sqrt(spread) / (sum(counts) / len(counts))
    every_token, _ = _leads_over(experts[second], experts[first], sequences[second])
    assert abs(mean - every_token) > 0.01, (mean, every_token)  # the prompts' tokens would move the lead
    record = exact_weights(output)
    assert record["teachers"]["expert1"]["teacher"] == "expert0"
    assert record["teachers"]["expert1"]["lead"] == pytest.approx(mean, abs=1e-9)
    assert record["teachers"]["expert1"]["margin"] == pytest.approx(margin, abs=1e-9)
    ours = record["coverage_nll"]
    assert max(abs(ours[names[i]][names[j]] - nll[i][j]) for i in experts for j in experts) < 1e-10, (ours, nll)


def test_where_each_expert_is_best_on_its_own_records_best_changes_no_byte(tmp_path, capsys):
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    own = run_recipe(scenario.write_recipe(tmp_path / "own.yaml", output=str(tmp_path / "own"), dtype="float64"), progress=False)
    best = run_recipe(scenario.write_recipe(tmp_path / "best.yaml", output=str(tmp_path / "best"), dtype="float64", teachers="best"),
                      progress=False)
    for name in ("model-00001-of-00001.safetensors",) if (own / "model-00001-of-00001.safetensors").exists() else ():
        assert (own / name).read_bytes() == (best / name).read_bytes()
    ours, theirs = read_weights(best), read_weights(own)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert "each expert predicts its own records best" in capsys.readouterr().err
    assert "teachers" not in exact_weights(best)


def test_teachers_is_featcal_s_key(tmp_path):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "s", experts=2, layers=1, samples=4)
    with pytest.raises(RecipeProblems, match=r"featcal\.teachers: only method featcal reads it \(method is regmean\)"):
        run_recipe(scenario.write_recipe(tmp_path / "r.yaml", method="regmean", teachers="best"), progress=False)
    with pytest.raises(RecipeProblems, match=r"featcal\.teachers"):
        run_recipe(scenario.write_recipe(tmp_path / "bad.yaml", teachers="broad"), progress=False)
    assert not (tmp_path / "s" / "out").exists()


def test_refine_and_the_run_s_table_name_the_chosen_teacher(broad_and_narrow, tmp_path, monkeypatch):
    """refine's teacher of expert1's records is expert0 (the reader it builds its distributions from), featcal_refine.json
    and the card say so by the short name, and the run's table marks the row whose drift and KL are to expert0."""
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.calibration_result import CalibrationResult, summarize_report

    scenario, *_ = broad_and_narrow
    seen = {}
    real = refine_module.refine

    def spy(job):
        seen["readers"] = {task: reader.directory for task, reader in job.teachers.items()}
        return real(job)

    monkeypatch.setattr(refine_module, "refine", spy)
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64",
                                              expert_weights="equal", token_weights="expert_lead", teachers="best",
                                              refine={"steps": 2, "eval_every": 2, "lr": 1e-4, "params": "full", "precision": "float32"}),
                        progress=False)
    first, second = scenario.experts.values()
    assert {Path(d).resolve() for d in seen["readers"].values()} == {first.resolve()}
    report = json.loads((output / "featcal_refine.json").read_text())
    assert report["teachers"] == {"expert0": "own expert", "expert1": "another expert"} and report["taught_by"] == {"expert1": "expert0"}
    assert "`expert1`: expert `expert0`" in (output / "README.md").read_text()
    drift = json.loads((output / "featcal_drift.json").read_text())
    table = CalibrationResult(output, scenario.root / "merged", summarize_report(drift)).table()
    assert table.splitlines()[3].split()[:2] == ["expert1", "†"], table
    assert "† expert0 teaches expert1's records (teachers: best): drift and KL there are to that teacher" in table


def test_a_best_teachers_run_resumes_to_the_same_bytes(broad_and_narrow, tmp_path, monkeypatch):
    """The choice is kept with the passes in the staging area: a resumed run reads it back and writes the same bytes."""
    from test_reliability import resumes_to_the_same_bytes

    scenario, *_ = broad_and_narrow
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), dtype="float64", teachers="best")
    resumes_to_the_same_bytes(recipe, tmp_path / "out", 1, monkeypatch)
