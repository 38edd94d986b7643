"""The specialised study's parts that need no real model: its splits, its rows' recipes, its shares' intervals, and
the provenance every results file now takes from a run's own card and log (a tiny real run of the product)."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import numpy as np
import pytest

from featcal_llm.io.recipe import load_recipe
from featcal_llm.tiny import build_char_tokenizer
from studies.common import bootstrap_nll, bootstrap_share_ratio, bootstrap_shares, mean_nll, percentile_interval, shares
from studies.specialised_data import split_documents
from studies.specialised_setup import AS_TRAINED, KINDS, ROWS, recipe_text

STUDIES = Path(__file__).resolve().parents[1] / "studies"


def test_no_study_module_imports_one_that_imports_it_back():
    """The all-gap scripts imported each other in a circle; shared helpers live in studies/common.py now."""
    graph = {}
    for path in STUDIES.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("studies."):
                deps.add(node.module.split(".")[1])
        graph[path.stem] = deps - {path.stem}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(d == goal or (d not in seen and reaches(d, goal, seen | {d})) for d in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m, {m})] == []


def test_splits_take_whole_files_and_val_comes_from_files_of_its_own():
    tokenizer = build_char_tokenizer()
    docs = [(f"doc{i}", "abcdefgh" * (3 + i % 5)) for i in range(60)]
    splits = split_documents(docs, tokenizer, {"test": 6, "val": 4, "cal": 6, "train": 20}, 8, seed=1)
    assert {s: len(r) for s, r in splits.items()} == {"test": 6, "val": 4, "cal": 6, "train": 20}
    owners = {}
    for split, records in splits.items():
        for record in records:
            assert owners.setdefault(record["source"], split) == split  # no file's text in two splits
    assert list(splits) == ["test", "val", "cal", "train"]


@pytest.mark.parametrize("row", list(ROWS))
def test_every_row_writes_a_recipe_the_product_accepts(tmp_path, monkeypatch, row):
    monkeypatch.chdir(tmp_path)
    for kind in KINDS:
        (tmp_path / "data" / kind).mkdir(parents=True)
        (tmp_path / "data" / kind / f"cal{AS_TRAINED}.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(ROWS[row], "runs/out"))
    recipe = load_recipe(path)
    assert recipe.merge_config.merge_method == "task_arithmetic"
    assert [e.name for e in recipe.experts] == [f"experts/{k}" for k in KINDS]
    assert recipe.featcal.samples == ROWS[row].get("samples", 64) and recipe.featcal.max_length == 129
    assert (recipe.featcal.refine is not None) == ("refine" in ROWS[row])
    if row == "featcal paper rule":
        assert (recipe.featcal.balancing, recipe.featcal.token_weighting, recipe.featcal.trailing) == ("equal", "equal", "keep")


def test_percentile_interval_is_numpys_linear_percentile():
    values = [random.Random(3).gauss(0, 1) for _ in range(101)] + [5.0, -7.0]
    assert percentile_interval(values) == pytest.approx(list(np.percentile(values, [2.5, 97.5])))


def _records(nll_per_token: list[float], tokens: int = 10) -> list[list[float]]:
    return [[v * tokens, tokens] for v in nll_per_token]


def test_the_share_is_a_ratio_of_sums_of_token_weighted_means():
    merged = {"a": _records([3.0, 3.0]), "b": _records([2.0, 2.0])}
    expert = {"a": _records([2.0, 2.0]), "b": _records([1.9, 1.9])}
    model = {"a": [[25.0, 10], [5.0, 2]], "b": _records([1.99, 1.99])}  # a: 30 nats over 12 tokens, not (2.5 + 2.5) / 2
    nll = {d: mean_nll(v) for d, v in model.items()}
    assert nll["a"] == pytest.approx(30 / 12)
    total, per = shares({d: mean_nll(v) for d, v in merged.items()}, {d: mean_nll(v) for d, v in expert.items()}, nll)
    assert per == pytest.approx({"a": 0.5, "b": 0.1})
    assert total == pytest.approx((0.5 + 0.01) / (1.0 + 0.1))  # 0.464, not the mean of the domains' shares (0.3)


def test_bootstrap_intervals_are_paired_over_records():
    rng = random.Random(0)
    merged = {d: _records([3 + rng.random() for _ in range(40)]) for d in ("a", "b")}
    expert = {d: [[s - 10 * (0.5 + rng.random()), n] for s, n in merged[d]] for d in merged}
    # the merge itself recovers nothing on every resample, the expert everything: intervals collapse onto 0 and 1
    assert bootstrap_shares(merged, expert, merged, 200)["share"] == pytest.approx([0.0, 0.0])
    assert bootstrap_shares(merged, expert, expert, 200)["share"] == pytest.approx([1.0, 1.0])
    # a model half-way on every record: 0.5 on every resample only if merge, expert and model share the resample
    half = {d: [[(m[0] + e[0]) / 2, m[1]] for m, e in zip(merged[d], expert[d])] for d in merged}
    ci = bootstrap_shares(merged, expert, half, 200)
    assert ci["share"] == pytest.approx([0.5, 0.5]) and ci["share_per_domain"]["a"] == pytest.approx([0.5, 0.5])
    nll = bootstrap_nll(merged, 500)
    assert nll["nll"]["a"][0] < mean_nll(merged["a"]) < nll["nll"]["a"][1]
    # the ratio of two rows' shares, both from each resample: half-way over all the way is 0.5 on every resample
    assert bootstrap_share_ratio(merged, expert, half, expert, 200) == pytest.approx([0.5, 0.5])
    noisy = {d: [[h[0] + rng.gauss(0, 2), h[1]] for h in half[d]] for d in half}
    lo, hi = bootstrap_share_ratio(merged, expert, noisy, half, 500)
    assert lo < shares(*({d: mean_nll(v) for d, v in rows.items()} for rows in (merged, expert, noisy)))[0] / 0.5 < hi


def test_a_results_row_records_what_its_run_resolved_and_logged(tmp_path):
    """Provenance from the run's own card and log (issue 56), not the defaults of the day the report is written."""
    from scenario import build_scenario

    from featcal_llm import runlog
    from featcal_llm.pipeline import run_recipe
    from studies.provenance import run_record

    import yaml

    scenario = build_scenario(tmp_path / "s", experts=2, layers=2, samples=8)
    plain = yaml.safe_load(scenario.recipe.read_text())
    for key in ("expert_weights", "token_weights", "trailing_experts"):  # the scenario pins the paper's; defaults: none set
        plain["featcal"].pop(key, None)
    scenario.recipe.write_text(yaml.safe_dump(plain, sort_keys=False))
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), alpha=0.4, head=False)
    logfile = tmp_path / "run.log"
    with runlog.session(logfile, runlog.QUIET):
        run_recipe(recipe, progress=False)
    record = run_record(tmp_path / "out", logfile)
    resolved = record["featcal_effective"]
    # set in the recipe: as set; not set: what the product resolved then (its defaults of the day, from its card)
    assert (resolved["alpha"], resolved["head"], resolved["lambda"]) == (0.4, "false", plain["featcal"]["lambda"])
    assert (resolved["expert_weights"], resolved["token_weights"], resolved["trailing_experts"]) == ("coverage", "expert_lead", "merge")
    assert record["featcal"]["alpha"] == 0.4  # the block as the run's featcal_recipe.yml replays it
    leads = record["record_leads"]  # the log line's signed leads, one per expert, by its short name
    assert sorted(leads) == sorted(Path(name).name for name in scenario.experts) or len(leads) == len(scenario.experts)
    taught = record["card"].get("taught_by_merge", {})
    for name, lead in taught.items():  # the card's signed lead of a trailing expert: the same number as logged
        assert leads[Path(name).name] == pytest.approx(lead, abs=5e-4)
    assert all((lead <= 0) == any(Path(n).name == name for n in taught) for name, lead in leads.items())


def test_the_broad_setting_merges_its_own_experts_and_mixes_the_kinds_evenly(tmp_path, monkeypatch):
    from studies.real_data import interleave
    from studies.specialised_broad import EXPERTS

    monkeypatch.chdir(tmp_path)
    for name in EXPERTS:
        (tmp_path / "data" / name).mkdir(parents=True)
        (tmp_path / "data" / name / f"cal{AS_TRAINED}.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(ROWS["featcal defaults, rho 1"], "runs/out", experts=EXPERTS))
    recipe = load_recipe(path)
    assert [e.name for e in recipe.experts] == [f"experts/{name}" for name in EXPERTS]
    assert sorted(recipe.featcal.data) == sorted(f"experts/{name}" for name in EXPERTS) and recipe.featcal.rho == 1.0
    kinds = [[{"kind": k, "i": i} for i in range(n)] for k, n in (("a", 3), ("b", 2), ("c", 3))]
    mixed = interleave(kinds)
    assert [r["kind"] for r in mixed[:6]] == ["a", "b", "c"] * 2 and len(mixed) == 8  # any prefix holds every kind


def test_the_demo_refine_recipe_is_the_demos_with_refine_on():
    """studies/demo_refine.py: the demo's recipe, its own output, `refine: true`; nothing else changed."""
    import yaml

    from featcal_llm.demo.config import FULL
    from featcal_llm.demo.run import OUTPUT_DIR, recipe_text
    from featcal_llm.io.block import FeatCalConfig
    from studies.demo_refine import REFINED_DIR, refine_recipe

    demo, refined = (yaml.safe_load(text) for text in (recipe_text(FULL), refine_recipe(recipe_text(FULL))))
    assert demo["featcal"]["output"] == OUTPUT_DIR and refined["featcal"].pop("output") == REFINED_DIR
    assert refined["featcal"].pop("refine") is True
    demo["featcal"].pop("output")
    assert refined == demo and FeatCalConfig(**{**refined["featcal"], "output": REFINED_DIR, "refine": True}).refine.steps == 40


def test_the_feature_probes_term_against_a_loop_over_tokens():
    """studies/feature_refine.py: per layer, the squared distance to the record's expert over that layer's mean squared
    expert norm; averaged over layers and the text tokens after BOS, whatever the padding."""
    import torch

    from studies.feature_refine import feature_loss, layer_scales

    gen = torch.Generator().manual_seed(0)
    layers, width, d, lengths = 3, 6, 4, [6, 4]
    teachers = [torch.randn(layers, n, d, generator=gen) * (1 + torch.arange(layers))[:, None, None] for n in lengths]
    student = [torch.randn(len(lengths), width, d, generator=gen) for _ in range(layers)]
    scales = layer_scales({"kind": teachers})
    expected_scales = [sum(float(t[l, j] @ t[l, j]) for t in teachers for j in range(1, t.shape[1])) / sum(n - 1 for n in lengths)
                       for l in range(layers)]
    assert scales.tolist() == pytest.approx(expected_scales, rel=1e-6)
    terms = [sum(float((student[l][b, j] - teachers[b][l, j]).pow(2).sum()) / expected_scales[l] for l in range(layers)) / layers
             for b, n in enumerate(lengths) for j in range(1, n)]
    assert float(feature_loss(student, teachers, lengths, scales)) == pytest.approx(sum(terms) / len(terms), rel=1e-6)
