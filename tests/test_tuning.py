"""Tuned runs (issue 9): the shared solve is exact, held-out records stay out, choices are recorded, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_exactness import read_weights, relative_error
from test_reliability import resumes_to_the_same_bytes, tree_hash

import featcal_llm.engine.tuned as tuned_module
from featcal_llm.cli import main
from featcal_llm.maths.objective import ExpertGroup, GroupSystem, Hyperparameters, MixedTargets, SplitTargets, fold, solve_bias, solve_norm
from featcal_llm.maths.solve import RidgeSolver, anchor
from featcal_llm.pipeline import run_recipe
from featcal_llm.maths.stats import GroupStatistics
from featcal_llm.engine.tuning import AUTO, Search, coordinate_search, split_holdout
from featcal_llm.io.run_record import read_run_record

SINGLE = {"lambda": [1e-3, 1e-2], "alpha": 0.3, "rho": 0.5}  # two candidates: a search (one would be a fixed value)


def _random_stats(seed: int, d: int = 12, outputs=(("a", 5), ("b", 7)), tokens: int = 40) -> tuple[GroupStatistics, dict, dict]:
    generator = torch.Generator().manual_seed(seed)
    x_cal = torch.randn(tokens, d, generator=generator, dtype=torch.float64)
    x_exp = x_cal + 0.3 * torch.randn(tokens, d, generator=generator, dtype=torch.float64)
    weights = {name: torch.randn(m, d, generator=generator, dtype=torch.float64) for name, m in outputs}
    biases = {name: torch.randn(m, generator=generator, dtype=torch.float64) for name, m in outputs}
    stats = GroupStatistics.empty(d, dict(outputs), with_means=True, with_norm=True, device=torch.device("cpu"), dtype=torch.float64)
    stats.gram += x_cal.T @ x_cal
    for name, w in weights.items():
        stats.cross[name] += (x_exp @ w.T).T @ x_cal
    stats.sum_cal += x_cal.sum(0)
    stats.sum_exp += x_exp.sum(0)
    stats.norm_sq += (x_cal / x_cal.pow(2).mean(-1, keepdim=True).sqrt()).pow(2).sum(0)
    stats.tokens = tokens
    return stats, weights, biases


def _copy(stats: GroupStatistics) -> GroupStatistics:
    return GroupStatistics(stats.gram.clone(), {k: v.clone() for k, v in stats.cross.items()}, stats.sum_cal.clone(),
                           stats.sum_exp.clone(), stats.norm_sq.clone(), stats.tokens)


def test_shared_solve_equals_the_fixed_solve_for_every_candidate(capsys):
    """Folding once and mixing α, reusing one factor per λ, gives each candidate's fixed-run ΔW (float64)."""
    tasks = [_random_stats(seed) for seed in range(3)]
    norms = [torch.rand(12, dtype=torch.float64) + 0.5 for _ in tasks]
    generator = torch.Generator().manual_seed(9)
    merged = {n: torch.randn(m, 12, generator=generator, dtype=torch.float64) for n, m in (("a", 5), ("b", 7))}
    base = {n: w + 0.1 * torch.randn(w.shape, generator=generator, dtype=torch.float64) for n, w in merged.items()}
    bias_m = {n: torch.randn(w.shape[0], generator=generator, dtype=torch.float64) for n, w in merged.items()}
    bias_b = {n: b + 0.1 for n, b in bias_m.items()}
    norm_m, norm_b = torch.ones(12, dtype=torch.float64), torch.full((12,), 0.9, dtype=torch.float64)
    eps = 1e-8

    def folded(targets) -> GroupSystem:
        system = GroupSystem(lhs=None, targets=targets(), biases=targets())
        for (stats, weights, biases), norm in zip(tasks, norms):
            fold(system, _copy(stats), ExpertGroup(weights, biases, norm), eps)
        return system

    shared = folded(SplitTargets)
    lhs_before = shared.lhs.clone()
    solver = RidgeSolver(keep_lhs=True)
    # λ changes back and forth so that the one-factor cache is refreshed and reused
    for lam, alpha, rho in [(1e-3, 0.3, 0.5), (1e-3, 0.8, 1.5), (1e-1, 0.0, 1.0), (1e-3, 1.0, -0.5), (10.0, 0.15, 1.0)]:
        fixed = folded(lambda: MixedTargets(alpha))
        anchors = {n: anchor(merged[n], base[n], rho) for n in merged}
        fixed_biases = fixed.biases.at(alpha)
        expected = RidgeSolver().solve("g", fixed.lhs, fixed.targets.at(alpha), anchors, lam, eps, "test")
        ours = solver.solve("g", shared.lhs, shared.targets.at(alpha), anchors, lam, eps, "test")
        for name in merged:
            delta = lambda w: w - merged[name]  # noqa: E731
            assert relative_error(delta(ours[name]), delta(expected[name])) <= 1e-6, (lam, alpha, rho, name)
            b_anchor = anchor(bias_m[name], bias_b[name], rho)
            b_expected = solve_bias(fixed, fixed_biases[name], expected[name], b_anchor, lam)
            b_ours = solve_bias(shared, shared.biases.at(alpha)[name], ours[name], b_anchor, lam)
            assert float((b_ours - b_expected).norm() / (b_expected - bias_m[name]).norm()) <= 1e-6
        assert torch.allclose(solve_norm(shared, anchor(norm_m, norm_b, rho), lam), solve_norm(fixed, anchor(norm_m, norm_b, rho), lam), rtol=1e-12)
    assert shared.lhs.equal(lhs_before)  # lhs is shared by the candidates: the solves never modify it
    assert capsys.readouterr().err == ""  # every candidate used the kept factor, none needed a larger ridge


def test_coordinate_search_order_winner_and_budget():
    search = Search(dict(AUTO), 1e-8, 0.25, 12, "hidden")
    assert search.evaluations() == 12 and search.start() == {"lambda": 1e-2, "alpha": 0.3, "rho": 1.0}
    target = {"lambda": 1e-4, "alpha": 0.5, "rho": 1.5}
    seen = []

    def score(h: Hyperparameters) -> float:
        seen.append(h)
        return abs(torch.log10(torch.tensor(h.lam)) + 4).item() + abs(h.alpha - 0.5) + abs(h.rho - 1.5)

    winner, table = coordinate_search(search, score)
    assert (winner.lam, winner.alpha, winner.rho) == (target["lambda"], target["alpha"], target["rho"])
    assert len(seen) == len(table) == 12 and len(set(seen)) == 12
    assert [h.lam for h in seen[:7]] == list(AUTO["lambda"]) and all(h.lam == 1e-4 for h in seen[7:])


def test_holdout_split_is_seeded_disjoint_and_complete():
    sequences = {"a": [[i] for i in range(20)], "b": [[100 + i] for i in range(8)]}
    cal, held = split_holdout(sequences, 0.25, 0, "r.yaml")
    again, held_again = split_holdout(sequences, 0.25, 0, "r.yaml")
    assert (cal, held) == (again, held_again)
    assert len(held["a"]) == 5 and len(held["b"]) == 2
    for task in sequences:
        assert sorted(cal[task] + held[task]) == sequences[task]
    assert split_holdout(sequences, 0.25, 1, "r.yaml")[1] != held


def test_moving_the_experts_folders_keeps_a_tuned_runs_split_and_weights(tmp_path):
    """The held-out split is drawn by the seed and each expert's position in the recipe, not by its path: the same
    scenario copied to another folder, its recipe naming the new paths, calibrates to the same bytes and choices."""
    import shutil

    from scenario import build_scenario

    first = build_scenario(tmp_path / "here", experts=2, layers=1, samples=16)
    shutil.copytree(tmp_path / "here", tmp_path / "moved elsewhere")
    moved = tmp_path / "moved elsewhere" / "recipe.yaml"
    (moved.parent / "x").mkdir()  # the moved recipe spells its paths through x/..
    moved.write_text(first.recipe.read_text().replace(str(tmp_path / "here"), str(tmp_path / "moved elsewhere" / "x" / "..")))
    settings = {**SINGLE, "lambda": [1e-4, 1e-3, 1e-2], "alpha": [0.1, 0.5]}
    outputs = []
    for recipe in (first.recipe, moved):
        path = recipe.parent / "tuned.yaml"
        written = yaml.safe_load(recipe.read_text())
        written["featcal"].update(settings, output=str(recipe.parent / "out"))
        path.write_text(yaml.safe_dump(written, sort_keys=False))
        outputs.append(run_recipe(path, progress=False))
    chosen = [[layer["chosen"] for layer in json.loads((o / "featcal_tuning.json").read_text())["layers"]] for o in outputs]
    assert chosen[0] == chosen[1]
    weights = [read_weights(o) for o in outputs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _tuned(scenario, tmp_path, name: str, **overrides):
    settings = {**SINGLE, "dtype": "float64", **overrides}
    return scenario.write_recipe(tmp_path / f"{name}.yaml", output=str(tmp_path / name), **settings)


def _calibration_only_data(scenario, tmp_path, seed: int = 0) -> dict:
    """Data entries holding only the records a tuned run calibrates on (its held-out ones removed)."""
    records = {str(scenario.experts[name]): path.read_text().splitlines()[:16] for name, path in scenario.data.items()}
    cal, _ = split_holdout({n: [[i] for i in range(len(r))] for n, r in records.items()}, 0.25, seed, "x")
    data = {}
    for index, (name, lines) in enumerate(records.items()):
        path = tmp_path / f"cal-only-{index}.jsonl"
        path.write_text("\n".join(lines[i] for [i] in cal[name]) + "\n")
        data[name] = {"path": str(path), "format": "text", "text": "text"}
    return data


def test_tuned_run_equals_a_fixed_run_on_the_calibration_records(merged_scenario, tmp_path, monkeypatch):
    """A candidate chosen inside a tuned run gives the fixed run's weights; held-out records are not in them.

    The winner is forced (λ = 1e-1 of two) so that the comparison does not depend on the criterion, and
    the criterion is flat so that the candidate kept while searching (the first, λ = 1e-3) is not the
    winner: the winner must be solved again.
    """
    real = tuned_module.coordinate_search

    def forced(search, score):
        return real(search, lambda h: (score(h), 0.0 if h.lam == 1e-1 else 1.0)[1])

    monkeypatch.setattr(tuned_module, "coordinate_search", forced)
    monkeypatch.setattr(tuned_module, "criterion", lambda *args: 0.0)
    tuned = run_recipe(_tuned(merged_scenario, tmp_path, "tuned", **{"lambda": [1e-3, 1e-1]}), progress=False)
    report = json.loads((tuned / "featcal_tuning.json").read_text())
    assert report["chosen"]["lambda"] == [0.1, 0.1, 0.1] and len(report["layers"][0]["candidates"]) == 2
    data = _calibration_only_data(merged_scenario, tmp_path)
    fixed = run_recipe(
        merged_scenario.write_recipe(tmp_path / "fixed.yaml", output=str(tmp_path / "fixed"), data=data, dtype="float64",
                                     **{"lambda": 1e-1, "alpha": 0.3, "rho": 0.5}),
        progress=False,
    )
    ours, reference, merged = read_weights(tuned), read_weights(fixed), read_weights(merged_scenario.root / "merged")
    errors = {n: relative_error(ours[n] - merged[n], reference[n] - merged[n]) for n in ours if "proj" in n}
    worst = max(errors.values())
    print(f"tuned (forced λ = 0.1) vs fixed run on the calibration records: worst relative ΔW difference {worst:.2e}")
    assert worst <= 1e-6
    everything = read_weights(run_recipe(
        merged_scenario.write_recipe(tmp_path / "all.yaml", output=str(tmp_path / "all"), dtype="float64", **{"lambda": 1e-1, "alpha": 0.3, "rho": 0.5}),
        progress=False,
    ))
    assert min(relative_error(ours[n] - merged[n], everything[n] - merged[n]) for n in errors) > 1e-3  # the held-out records matter


def test_held_out_records_never_enter_the_statistics(merged_scenario, tmp_path):
    """Rewriting only the held-out records changes what is measured, never the weights."""
    first = run_recipe(_tuned(merged_scenario, tmp_path, "first"), progress=False)
    records = {str(merged_scenario.experts[n]): path.read_text().splitlines()[:16] for n, path in merged_scenario.data.items()}
    _, held = split_holdout({n: [[i] for i in range(len(r))] for n, r in records.items()}, 0.25, 0, "x")
    data = {}
    for number, (name, lines) in enumerate(records.items()):
        for [index] in held[name]:
            lines[index] = json.dumps({"text": f"something else entirely {index} " * 3})
        path = tmp_path / f"changed-{number}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        data[name] = {"path": str(path), "format": "text", "text": "text"}
    second = run_recipe(_tuned(merged_scenario, tmp_path, "second", data=data), progress=False)
    a, b = read_weights(first), read_weights(second)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert (first / "featcal_drift.json").read_text() != (second / "featcal_drift.json").read_text()


def test_tuned_run_records_its_choice_and_is_deterministic(merged_scenario, tmp_path):
    recipe = merged_scenario.write_recipe(tmp_path / "auto.yaml", output=str(tmp_path / "out"), **{"lambda": [1e-4, 1e-2, 1.0], "alpha": [0.3, 0.8], "rho": 1.0})
    hashes, stderr = [], ""
    for _ in range(2):
        result = CliRunner().invoke(main, ["run", "--force", str(recipe)])
        assert result.exit_code == 0, result.stderr
        hashes.append(tree_hash(tmp_path / "out"))
        stderr = result.stderr
    assert hashes[0] == hashes[1]
    output = tmp_path / "out"
    report = json.loads((output / "featcal_tuning.json").read_text())
    assert report["search"]["evaluations_per_layer"] == 4 and report["search"]["values"]["rho"] == [1.0]
    for layer in report["layers"]:
        assert len(layer["candidates"]) == 4
        best = min(layer["candidates"], key=lambda row: row["criterion"])
        assert layer["chosen"]["criterion"] == best["criterion"]
    front = read_run_record(output)["hyperparameters"]
    written = yaml.safe_load((output / "featcal_recipe.yml").read_text())["featcal"]
    for key in ("lambda", "alpha", "rho"):
        assert front[key] == report["chosen"][key]
        assert written[key] == {"per_layer": report["chosen"][key]}
    assert stderr.count("<- chosen") == 3 and "most common choice: lambda" in stderr


def test_tuned_run_resumes_to_the_same_bytes(merged_scenario, tmp_path, monkeypatch):
    recipe = _tuned(merged_scenario, tmp_path, "out", **{"lambda": [1e-3, 1e-1], "dtype": "float32"})
    resumes_to_the_same_bytes(recipe, tmp_path / "out", 2, monkeypatch)


BAD = {
    "lambda list with zero": ({"lambda": [1e-3, 0.0]}, ["featcal.lambda:", "greater than 0"]),
    "alpha list above one": ({"alpha": [0.3, 1.2]}, ["featcal.alpha:", "less than or equal to 1"]),
    "rho list with text": ({"rho": [1.0, "x"]}, ["featcal.rho:", "expected a finite number, auto or a list"]),
    "empty list": ({"alpha": []}, ["featcal.alpha:", "non-empty list"]),
    "tune without candidates": ({"tune": {"holdout": 0.25}}, ["featcal.tune: nothing to tune"]),
    "a search key beside refine and fixed values": ({"refine": True, "tune": {"holdout": 0.5, "budget": 5}},
                                                    ["featcal.tune.budget: nothing to tune", "with refine only tune.holdout applies"]),
    "refine holding out one record": ({"refine": True, "samples": 4}, ["featcal.tune.holdout: 0.25 of expert", "4 records leaves 1 "
                                                                        "held out and 3 for calibration (need at least 2 on each side)"]),
    "unknown tune key": ({"lambda": "auto", "tune": {"holdot": 0.2}}, ["featcal.tune.holdot: unknown key"]),
    "holdout leaving one record": ({"lambda": "auto", "tune": {"holdout": 0.95}}, ["featcal.tune.holdout:", "need at least 2 on each side"]),
    "budget too small": ({"lambda": "auto", "tune": {"budget": 4}}, ["featcal.tune.budget:", "evaluates 7 settings"]),
    "unknown criterion": ({"lambda": "auto", "tune": {"criterion": "loss"}}, ["featcal.tune.criterion:"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tuning_input_is_one_line_naming_the_key(merged_scenario, tmp_path, case):
    overrides, expected = BAD[case]
    recipe = merged_scenario.write_recipe(tmp_path / "bad.yaml", output=str(tmp_path / "out"), **overrides)
    result = CliRunner().invoke(main, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal-llm: error: ") and str(tmp_path / "bad.yaml") in lines[0]
    for fragment in expected:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.featcal-partial").exists()
    validated = CliRunner().invoke(main, ["validate", str(recipe)])  # validate refuses it in the same words, before any work
    assert validated.exit_code == 2 and lines[0] in validated.stderr.splitlines(), validated.output


def test_refine_with_fixed_values_takes_its_held_out_share_from_tune_holdout(merged_scenario, tmp_path, monkeypatch):
    """docs/refine.md: refine holds records out by tune.holdout, so that key is accepted beside fixed values."""
    import featcal_llm.stages.prepare as prepare

    from featcal_llm.io.validate import check_recipe

    recipe = merged_scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), refine=True, tune={"holdout": 0.5})
    assert check_recipe(recipe, plan=False).problems == []
    shares = []

    def stop(sequences, share, seed, where):
        shares.append(share)
        raise KeyboardInterrupt  # the split is all this test needs to see

    monkeypatch.setattr(prepare, "split_holdout", stop)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe, progress=False)
    assert shares == [0.5]


def test_shipped_auto_recipe_is_the_one_demo_auto_writes():
    from pathlib import Path

    from featcal_llm.demo.config import FULL
    from featcal_llm.demo.run import recipe_text

    shipped = (Path(__file__).parent.parent / "featcal_llm" / "recipes" / "demo-auto.yaml").read_text()
    assert shipped == recipe_text(FULL.replace(auto=True))
    assert "lambda: auto" in shipped and "alpha: auto" in shipped and "rho: auto" in shipped
    assert "tune: {criterion: output}" in shipped  # the criterion that did at least as well as the drift on every demo seed


def test_tuning_cost_benchmark_runs_every_mode(tmp_path):
    """The cost-factor benchmark at tiny shapes: every mode runs and is reported (times are printed, never asserted)."""
    from featcal_llm.benchmark.tuning_cost import main as tuning_cost

    arguments = ["--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2", "--layers", "1", "--sequences", "8",
                 "--seq-len", "16", "--repeats", "1", "--workdir", str(tmp_path), "--json"]
    result = CliRunner().invoke(tuning_cost, arguments, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["factor"]) == {"fixed", "fixed+drift", "auto"} and data["factor"]["fixed"] == 1.0
    assert all(len(values) == 1 and values[0] > 0 for values in data["seconds"].values())


def _featcal(values: dict, budget: int | None = None):
    """What build_search reads of a featcal: block (its hyper-parameters as given, its tune: settings)."""
    from types import SimpleNamespace

    from featcal_llm.io.block_sections import TuneSpec

    tune = TuneSpec() if budget is None else TuneSpec(budget=budget)
    return SimpleNamespace(hyper_values=lambda: dict(values), tune_settings=lambda: tune, eps=1e-8)


def test_the_default_budget_covers_an_all_auto_search_and_one_less_does_not():
    """All three keys `auto` evaluate 12 settings a layer, the default budget: exactly enough, not refused."""
    from featcal_llm.engine.tuning import build_search
    from featcal_llm.errors import FeatCalError

    auto = {"lambda": "auto", "alpha": "auto", "rho": "auto"}
    assert build_search(_featcal(auto), "r.yaml").evaluations() == 12
    with pytest.raises(FeatCalError, match="evaluates 12 settings per layer, more than the budget of 11"):
        build_search(_featcal(auto, budget=11), "r.yaml")


def test_candidates_are_searched_in_sorted_order_from_the_lower_middle():
    from featcal_llm.engine.tuning import build_search

    search = build_search(_featcal({"lambda": (1.0, 1e-3, 0.1, 1e-3), "alpha": 0.3, "rho": 0.5}), "r.yaml")
    assert search.values["lambda"] == (1e-3, 0.1, 1.0) and search.start()["lambda"] == 0.1


def test_ties_keep_the_earlier_candidate_and_nan_loses_to_every_score():
    search = Search({"lambda": (1e-3, 1e-2, 1e-1), "alpha": (0.3,), "rho": (0.5,)}, 1e-8, 0.25, 12, "hidden")
    winner, _ = coordinate_search(search, lambda h: 1.0)  # every candidate ties: the first in the list stays
    assert winner.lam == 1e-3
    # the first candidate scores NaN: a finite later score wins, and the table records the NaN as inf
    winner, table = coordinate_search(search, lambda h: float("nan") if h.lam == 1e-3 else 5.0)
    assert winner.lam == 1e-2 and [score for h, score in table if h.lam == 1e-3] == [float("inf")]


def test_the_summary_breaks_ties_toward_the_smaller_value():
    from featcal_llm.engine.tuning import summary

    chosen = [{"lambda": 1.0, "alpha": 0.5, "rho": 1.0}, {"lambda": 0.1, "alpha": 0.5, "rho": 1.0}]
    assert summary(chosen)["lambda"] == 0.1


def test_the_replay_recipe_pins_a_precision_written_as_auto_too():
    """`stats_dtype: auto` written out, or left out, is what this machine chose (float64 here), so the replay on another
    machine computes the same; a precision the recipe names stays as named."""
    from types import SimpleNamespace

    from featcal_llm.io.saved_recipe import replay_text

    tuning = {"chosen": {"lambda": [1e-3]}, "search": {"holdout": 0.25}}
    precisions = {"dtype": torch.float32, "stats_dtype": torch.float64}
    for written in ("  stats_dtype: auto\n", ""):
        recipe = SimpleNamespace(text=f"merge_method: task_arithmetic\nfeatcal:\n  dtype: bfloat16\n{written}")
        block = yaml.safe_load(replay_text(recipe, tuning, precisions))["featcal"]
        assert (block["stats_dtype"], block["dtype"], block["lambda"]) == ("float64", "bfloat16", {"per_layer": [1e-3]})



def test_the_head_s_statistics_precision_is_not_pinned_in_the_replay_recipe():
    """`head_stats_dtype` is the run's own (float64 whatever the layers'), not a recipe key: pinning it would write a
    key the replay's block refuses."""
    import torch

    from featcal_llm.io.saved_recipe import pinned_precisions

    resolved = {"dtype": torch.float32, "stats_dtype": torch.float32, "head_stats_dtype": torch.float64}
    assert pinned_precisions({}, resolved) == {"dtype": "float32", "stats_dtype": "float32"}
    assert pinned_precisions({"dtype": "bfloat16"}, resolved) == {"stats_dtype": "float32"}  # a key set stays as written
