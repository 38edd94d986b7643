"""`featcal_llm.evaluate`: it scores models and returns their summaries and table, and refuses what is not a model, a
backend or an output in one FeatCalError, before scoring any."""

from __future__ import annotations

import json
from pathlib import Path

import pytest



@pytest.mark.slow
def test_evaluate_scores_models_and_returns_their_summaries_and_table(tmp_path, monkeypatch):
    """`featcal_llm.evaluate` on a tiny model with lm-eval's hf backend (one local fixture task): the same summary file
    and table as `featcal-llm eval` writes."""
    pytest.importorskip("lm_eval")
    import featcal_llm
    from featcal_llm.tiny import build_char_tokenizer, new_tiny_llama, save_model, tiny_llama_config

    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("OMP_NUM_THREADS", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    tokenizer = build_char_tokenizer()
    model = save_model(new_tiny_llama(tiny_llama_config(len(tokenizer), max_position_embeddings=1024), 0), tokenizer, tmp_path / "tiny")
    fixture = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench" / "arc_challenge.jsonl"
    result = featcal_llm.evaluate({"mine": model}, tasks=["arc_challenge"], backend={"name": "hf"}, output="scores",
                                  chat_template="off", limit=2, data={"arc_challenge": str(fixture)}, quiet=True)
    assert result.output == tmp_path / "scores" and list(result.summaries) == ["mine"]
    summary = json.loads((tmp_path / "scores" / "mine.json").read_text())
    assert result.summaries["mine"] == summary and list(summary["tasks"]) == ["arc_challenge"]
    assert "| mine |" in result.table and (tmp_path / "scores" / "last-eval.md").read_text() == result.table
    from featcal_llm.errors import FeatCalError

    with pytest.raises(FeatCalError, match="two models have the same label"):
        featcal_llm.evaluate([tmp_path / "a" / "m", tmp_path / "b" / "m"])
    with pytest.raises(FeatCalError, match="two models have the same label"):  # one summary file, a_b.json, for both
        featcal_llm.evaluate({"a b": model, "a_b": model})
    with pytest.raises(FeatCalError, match=r"^evaluate\(\) limit: Input should be greater than 0"):  # the argument, not a flag
        featcal_llm.evaluate(model, limit=0)
    with pytest.raises(FeatCalError, match=r"^evaluate\(\) limitt: unknown argument; did you mean 'limit'\?$"):
        featcal_llm.evaluate(model, limitt=2)
    with pytest.raises(FeatCalError, match=r"^evaluate\(\) backend.batch_size: Input should be a valid integer or 'auto' \(got 'max'\)$"):
        featcal_llm.evaluate(model, backend={"name": "hf", "batch_size": "max"})  # one line for the union, not one per member


@pytest.mark.parametrize("models", [None, 3, b"/tmp/model"])
def test_evaluate_refuses_models_that_are_no_paths(tmp_path, monkeypatch, models):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="model"):
        featcal_llm.evaluate(models, tasks=["arc_challenge"], quiet=True)


@pytest.mark.parametrize("which", ["list int", "list None", "list dict", "mapping int", "mapping None"])
def test_evaluate_refuses_a_model_entry_that_is_no_path(small, tmp_path, monkeypatch, which):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    models = {"list int": [small.base, 3], "list None": [small.base, None], "list dict": [{"a": small.base}],
              "mapping int": {"a": 3}, "mapping None": {"a": None}}[which]
    with pytest.raises(featcal_llm.FeatCalError):
        featcal_llm.evaluate(models, tasks=["arc_challenge"], quiet=True)


@pytest.mark.parametrize("backend", [3, None, ["hf"]])
def test_evaluate_refuses_a_backend_that_is_neither_a_name_nor_a_mapping(small, tmp_path, monkeypatch, backend):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="backend") as caught:
        featcal_llm.evaluate(small.base, tasks=["arc_challenge"], backend=backend, quiet=True)
    assert "backend.h" not in str(caught.value)


def test_evaluate_names_a_missing_model_first_as_eval_does(tmp_path, monkeypatch):
    import featcal_llm

    monkeypatch.chdir(tmp_path)
    with pytest.raises(featcal_llm.FeatCalError, match="nowhere"):
        featcal_llm.evaluate(tmp_path / "nowhere", quiet=True)


def test_evaluate_checks_every_model_before_scoring_any(small, tmp_path, monkeypatch):
    import featcal_llm
    from featcal_llm.evaluation import runner

    class Scored(Exception):
        pass

    def scoring(path, label, section, **kwargs):
        if Path(path).is_dir():
            raise Scored(path)  # the real one would run lm-eval here, minutes per model
        return runner.check_model_dir(Path(path))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "evaluate_model", scoring)
    with pytest.raises(featcal_llm.FeatCalError, match="nowhere"):
        featcal_llm.evaluate([small.base, tmp_path / "nowhere"], tasks=["arc_challenge"], quiet=True)


def test_evaluate_refuses_output_none(small, tmp_path, monkeypatch):
    import featcal_llm
    from featcal_llm.evaluation import runner

    class Scored(Exception):
        pass

    def scoring(path, label, section, **kwargs):
        raise Scored(section.output)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "evaluate_model", scoring)
    with pytest.raises(featcal_llm.FeatCalError, match="output"):
        featcal_llm.evaluate(small.base, tasks=["arc_challenge"], output=None, quiet=True)
