"""Resume under the default settings (issue 45): the passes' results are staged with the layers, and the fingerprint
holds the settings the run used, not the keys as written."""

from __future__ import annotations


import yaml
from test_coverage import trained_scenario
from test_reliability import resumes_to_the_same_bytes

import featcal_llm.pipeline as pipeline
import featcal_llm.stages.prepare as prepare
from featcal_llm.io.recipe import load_recipe
from featcal_llm.io.run_record import read_run_record


def _default_recipe(scenario, path, output):
    """The scenario's recipe with every weighting key removed: expert and token weights are the product's defaults."""
    raw = yaml.safe_load(scenario.recipe.read_text())
    for key in ("balance", "expert_weights", "token_weights", "trailing_experts"):
        raw["featcal"].pop(key, None)
    raw["featcal"].update(output=str(output), dtype="float64", batch_tokens=150)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_default_run_resumes_to_the_same_bytes_without_running_its_passes_again(tmp_path, monkeypatch):
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    recipe = _default_recipe(scenario, tmp_path / "r.yaml", tmp_path / "out")
    passes = {"experts": 0, "tokens": 0}
    experts, tokens = pipeline.expert_weights, pipeline.advantage_weights

    def counted(name, function):
        def run(*args, **kwargs):
            passes[name] += 1
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(pipeline, "expert_weights", counted("experts", experts))
    monkeypatch.setattr(pipeline, "advantage_weights", counted("tokens", tokens))
    resumes_to_the_same_bytes(recipe, tmp_path / "out", 1, monkeypatch)
    # the uninterrupted run and the crashed one ran both passes; the resume reused the crashed run's
    assert passes == {"experts": 2, "tokens": 2}
    front = read_run_record(tmp_path / "out")
    assert front["coverage_nll"] and front["expert_lead"]  # the card still reports both passes


def test_the_fingerprint_holds_the_resolved_settings(tmp_path):
    """Written as the default or left out: the same run. A default that changes changes the fingerprint."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    implicit = load_recipe(_default_recipe(scenario, tmp_path / "implicit.yaml", tmp_path / "out")).featcal
    settings = prepare.resolved_settings(implicit)
    assert settings["expert_weights"] == implicit.balancing == "coverage"
    assert settings["token_weights"] == implicit.token_weighting
    assert settings["token_weights"] == "expert_lead" and settings["tune"]["holdout"] > 0
    assert settings["trailing_experts"] == implicit.trailing == "merge"
    raw = yaml.safe_load((tmp_path / "implicit.yaml").read_text())
    raw["featcal"]["token_weights"] = settings["token_weights"]
    (tmp_path / "explicit.yaml").write_text(yaml.safe_dump(raw))
    assert prepare.resolved_settings(load_recipe(tmp_path / "explicit.yaml").featcal) == settings
    raw["featcal"]["token_weights"] = "equal"
    (tmp_path / "equal.yaml").write_text(yaml.safe_dump(raw))
    assert prepare.resolved_settings(load_recipe(tmp_path / "equal.yaml").featcal) != settings
    raw["featcal"]["token_weights"] = settings["token_weights"]
    raw["featcal"]["trailing_experts"] = "keep"
    (tmp_path / "keep.yaml").write_text(yaml.safe_dump(raw))
    assert prepare.resolved_settings(load_recipe(tmp_path / "keep.yaml").featcal) != settings


def test_progress_saved_by_other_weight_code_is_not_resumed(monkeypatch):
    from featcal_llm.engine import resume

    digest = resume.source_digest()
    assert len(digest) == 64 and digest == resume.source_digest()
    assert {"maths", "engine", "family"} <= set(resume.WEIGHT_CODE)


def test_where_a_records_response_starts_is_part_of_the_data_digest():
    """Records of the same ids whose responses start elsewhere (a changed prompt template) are other data: saved
    progress made on one does not resume the other."""
    from featcal_llm.engine.resume import sequences_digest
    from featcal_llm.io.records import Record

    digest = lambda start: sequences_digest({"a": [Record([1, 2, 3, 4], start)]})  # noqa: E731
    assert digest(1) != digest(2) != sequences_digest({"a": [[1, 2, 3, 4]]})


def test_each_assistant_turn_s_span_is_part_of_the_data_digest():
    """A conversation judged on every assistant turn is other data than the same ids judged on the last turn alone (the
    rule before): progress saved under one is not resumed under the other. A record with one span to its end (a
    single-turn one, alpaca, completion) digests as it did, written out here by hand."""
    import hashlib

    import numpy as np

    from featcal_llm.engine.resume import sequences_digest
    from featcal_llm.io.records import Record

    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    every, last = Record(ids, spans=[(2, 4), (6, 8)]), Record(ids, 6)
    ended_early = Record(ids, spans=[(2, 4)])  # a conversation that ends on a user's turn
    digests = {sequences_digest({"a": [record]}) for record in (every, last, ended_early, Record(ids, 2), list(ids))}
    assert len(digests) == 5
    by_hand = hashlib.sha256(b"a" + np.array(ids, dtype=np.int64).tobytes() + b"@6|").hexdigest()
    assert sequences_digest({"a": [last]}) == sequences_digest({"a": [Record(ids, spans=[(6, 8)])]}) == by_hand


def test_a_damaged_saved_pass_is_computed_again(tmp_path):
    from featcal_llm.engine.resume import StagingArea

    staging = StagingArea(tmp_path / "partial", "fingerprint")
    staging.save_pass("lead", {"x": 1})
    assert staging.load_pass("lead") == {"x": 1}
    staging.pass_file("lead").write_bytes(b"not a torch file")
    assert staging.load_pass("lead") is None
