"""`head:`: the LM head re-fitted after the last layer, against a brute force on each family's full model forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import brute_force_featcal, brute_force_head
from test_exactness import TOLERANCE, calibration_sequences, delta_error, load, read_weights

from featcal_llm.errors import FeatCalError
from featcal_llm.io.run_record import read_run_record
from featcal_llm.pipeline import run_recipe

HEAD = {"lambda": 1e-3, "alpha": 0.7, "rho": 0.4}


def reference_models(scenario):
    def load64(path):
        return load(path, torch.float64)

    merged, base = load64(scenario.root / "merged"), load64(scenario.base)
    experts = {str(p): load64(p) for p in scenario.experts.values()}
    sequences = {str(scenario.experts[n]): s for n, s in calibration_sequences(scenario, 12, 64).items()}
    return merged, base, experts, sequences


@pytest.mark.parametrize("family", ["llama", "llama-tied"])  # an untied head; a tied one (Gemma-2's stays tied: below)
def test_the_head_update_matches_the_brute_force_and_the_layers_are_unchanged(family_scenarios, family, tmp_path):
    scenario = family_scenarios(family)
    plain = run_recipe(scenario.write_recipe(tmp_path / "plain.yaml", output=str(tmp_path / "plain"), batch_tokens=150, dtype="float64", head=False), progress=False)
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150, dtype="float64", head=HEAD), progress=False)
    merged, base, experts, sequences = reference_models(scenario)
    cal = brute_force_featcal(merged, base, experts, sequences, 1e-3, 0.3, 0.5, 1e-8)
    expected = brute_force_head(cal, merged, base, experts, sequences, HEAD["lambda"], HEAD["alpha"], HEAD["rho"], 1e-8)
    ours, without = read_weights(output), read_weights(plain)
    merged_head = merged.get_output_embeddings().weight
    error = delta_error(ours["lm_head.weight"], expected, merged_head)
    print(f"{family}: head ΔW relative error {error:.2e}, ‖ΔW‖/‖W‖ {float((expected - merged_head).norm() / merged_head.norm()):.3f}")
    assert error <= TOLERANCE
    assert set(ours) == set(without) | {"lm_head.weight"}
    assert all(torch.equal(ours[name], without[name]) for name in without if name != "lm_head.weight")  # the layers: as without head
    config = json.loads((output / "config.json").read_text())
    model = load(output, torch.float64)
    assert torch.equal(model.get_output_embeddings().weight, ours["lm_head.weight"])
    assert torch.equal(model.get_input_embeddings().weight, merged.get_input_embeddings().weight)
    card = (output / "README.md").read_text()
    assert "the LM head was re-fitted" in card
    # the re-fit untied it, not a refinement; its statistics took the layers' float64, so the card names no precision of its own
    assert "The refinement trained the LM head" not in card and "the LM head's re-fit:" not in card
    # neither merge is tied and stores a head of its own (llama stores one, untied; llama-tied stores none): no such sentence
    assert "The merge's config ties the LM head" not in (plain / "README.md").read_text()
    head = read_run_record(output)["settings"]["head"]  # what the run resolved, beside the card
    assert {key: head[key] for key in ("lambda", "alpha", "rho")} == {"lambda": 0.001, "alpha": 0.7, "rho": 0.4}
    assert head["untied"] is (family == "llama-tied")  # tied in the merge, untied in the output
    if family == "llama-tied":  # tied in the merge: untied in the output, or transformers would tie the embeddings back
        assert "lm_head.weight" not in read_weights(scenario.root / "merged")
        assert config["tie_word_embeddings"] is False and "now a tensor of its own" in card
    ids = torch.tensor([sequences[next(iter(sequences))][0]])
    logits = model(input_ids=ids).logits  # the model transformers loads computes with the calibrated head
    features = model.model(input_ids=ids).last_hidden_state
    expected_logits = features @ ours["lm_head.weight"].T
    assert torch.allclose(logits, expected_logits, atol=1e-10)


def reshard(directory, tmp_path):
    """The merge in two shards with an index, as a large mergekit merge is written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, directory / shard, metadata={"format": "pt"})
    (directory / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    parameters = sum(t.numel() for t in tensors.values())  # transformers 5 writes both
    index = {"metadata": {"total_size": total, "total_parameters": parameters},
             "weight_map": {n: shard for shard, part in halves.items() for n in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_a_sharded_merge_gets_the_untied_head_in_its_last_shard_and_index(tmp_path):
    from scenario import build_scenario

    from test_exactness import scenario_family

    scenario = build_scenario(tmp_path / "s", experts=2, layers=2, samples=8, dtype="float64", **scenario_family("llama-tied"))
    run_recipe(scenario.write_recipe(tmp_path / "first.yaml", output=str(tmp_path / "first")), progress=False)  # makes the merge
    merged_index = reshard(scenario.root / "merged", tmp_path)
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=True), progress=False)
    index = json.loads((output / "model.safetensors.index.json").read_text())
    head = read_weights(output)["lm_head.weight"]
    assert index["weight_map"] == {**merged_index["weight_map"], "lm_head.weight": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == merged_index["metadata"]["total_size"] + head.numel() * head.element_size()
    assert index["metadata"]["total_parameters"] == merged_index["metadata"]["total_parameters"] + head.numel()
    assert torch.equal(load(output, torch.float64).get_output_embeddings().weight, head)


@pytest.mark.parametrize(
    ("head", "message"),
    [
        ({"alpha": 1.5}, "featcal.head.alpha"),
        ({"lambda": 0}, "featcal.head.lambda"),
        ({"lamda": 1e-3}, "featcal.head.lamda: unknown key; did you mean 'lambda'?"),
        ("sometimes", "featcal.head"),
        (None, "featcal.head: empty; write auto, true, false or a mapping of its keys"),  # it read as false (default auto)
    ],
)
def test_a_bad_head_setting_is_one_line_naming_the_key(family_scenarios, tmp_path, head, message):
    scenario = family_scenarios("llama")
    with pytest.raises(FeatCalError) as error:
        run_recipe(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=head), progress=False)
    assert message in str(error.value)
    assert not (tmp_path / "out").exists()


def test_regmean_refuses_the_head(family_scenarios, tmp_path):
    scenario = family_scenarios("llama")
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), method="regmean++", head=True)
    for key in ("lambda", "alpha", "rho"):
        text = recipe.read_text().replace(f"  {key}:", f"  # {key}:")
        recipe.write_text(text)
    with pytest.raises(FeatCalError, match=r"featcal\.head: only method featcal reads it"):
        run_recipe(recipe, progress=False)
    recipe.write_text(recipe.read_text().replace("head: {}", "head: false").replace("head: true", "head: false"))
    assert "head: false" in recipe.read_text()
    run_recipe(recipe, progress=False)  # what RegMean does anyway: said, not refused


@pytest.mark.parametrize("crash_in", ["calibrate_head", "output_divergence"])  # before the head is staged, after it
def test_a_run_with_the_head_resumes_to_the_same_bytes(family_scenarios, tmp_path, monkeypatch, capsys, crash_in):
    import featcal_llm.engine.calibrate as calibrate_module
    from test_reliability import tree_hash

    scenario = family_scenarios("llama-tied")
    recipe = scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), head=True)
    digest = tree_hash(run_recipe(recipe, progress=False))
    real = getattr(calibrate_module, crash_in)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(calibrate_module, crash_in, crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(recipe, force=True, progress=False)
    monkeypatch.setattr(calibrate_module, crash_in, real)
    state = json.loads((tmp_path / ".out.featcal-partial" / "state.json").read_text())
    assert state["completed_layers"] == (2 if crash_in == "calibrate_head" else 3)  # two layers, then the head
    capsys.readouterr()
    run_recipe(recipe, force=True, progress=False)
    kept = "2 of 2 layers" if crash_in == "calibrate_head" else "all 2 layers and the LM head"  # the head is no layer
    assert f"resuming from {tmp_path / '.out.featcal-partial'}: {kept} already calibrated" in capsys.readouterr().err
    assert tree_hash(tmp_path / "out") == digest


# --- head: auto (the default): re-fitted only where an expert's head is not the base's ------------------------------
def test_a_head_differs_only_beyond_the_precision_it_is_stored_in():
    from featcal_llm.maths.head import differs_at_stored_precision

    generator = torch.Generator().manual_seed(0)
    head = torch.randn(64, 16, generator=generator)
    assert not differs_at_stored_precision(head.clone(), head)
    assert not differs_at_stored_precision(head.to(torch.bfloat16), head)  # the base saved again in bf16: the same head
    assert not differs_at_stored_precision(head.to(torch.float16), head.to(torch.bfloat16))  # two roundings of one head
    nudged = head.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(float("inf")))
    assert differs_at_stored_precision(nudged, head)  # one unit in the last place, same dtype: a trained head
    tuned = head.clone()
    tuned[7, 2] *= 1.05
    assert differs_at_stored_precision(tuned.to(torch.bfloat16), head)  # beyond bf16's rounding
    slightly = head.clone()
    slightly[7, 2] *= 1 + 2 * 2**-7  # two bf16 units: still more than one after the bf16 rounding (at most half a unit)
    assert differs_at_stored_precision(slightly.to(torch.bfloat16), head)
    assert differs_at_stored_precision(head[:-1], head)  # a resized vocabulary


def merge_storing_a_head(scenario, tmp_path, stored: str) -> tuple[Path, torch.Tensor]:
    """The scenario's merge (made by a first run) with an `lm_head.weight` added under its tied config, as mergekit
    writes one when an input stores it: the embedding (`equal`) or another tensor (`differs`: a random merge)."""
    import shutil

    from safetensors.torch import load_file, save_file

    run_recipe(scenario.write_recipe(tmp_path / "first.yaml", output=str(tmp_path / "first"), head=False), progress=False)  # the merge
    merged = tmp_path / "merged-with-head"
    shutil.copytree(scenario.root / "merged", merged)
    shards = sorted(merged.glob("*.safetensors"))
    tensors = load_file(shards[-1])
    embedding = read_weights(merged)["model.embed_tokens.weight"]
    head = embedding + (0.01 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0), dtype=embedding.dtype)
                        if stored == "differs" else 0)
    save_file({**tensors, "lm_head.weight": head.contiguous()}, shards[-1], metadata={"format": "pt"})
    index = merged / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = shards[-1].name
        index.write_text(json.dumps(data))
    return merged, head


@pytest.mark.parametrize("stored", ["differs", "equal"])
def test_a_tied_merge_that_stores_a_head_of_its_own_is_written_untied(family_scenarios, tmp_path, capsys, stored):
    """A merge whose config ties the head but whose files store an `lm_head.weight` (a random merge method drops other
    entries of it than of the embedding): transformers serves that stored head, and the run calibrates with it, while
    vLLM would serve the embedding. Where the two differ the output is written untied, so both serve the stored head;
    where they are equal, tied as it was."""
    from transformers import AutoModelForCausalLM

    scenario = family_scenarios("llama-tied")
    merged, head = merge_storing_a_head(scenario, tmp_path, stored)
    capsys.readouterr()
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", merged=str(merged), output=str(tmp_path / "out"), head=False), progress=False)
    log, card = capsys.readouterr().err, (output / "README.md").read_text()
    config = json.loads((output / "config.json").read_text())
    assert torch.equal(read_weights(output)["lm_head.weight"], head)
    if stored == "equal":
        assert config["tie_word_embeddings"] is True and "store an lm_head.weight of its own" not in log
        return
    assert config["tie_word_embeddings"] is False
    assert "the merge's config ties the LM head to the input embeddings, but its files store an lm_head.weight of its own" in log
    assert "the config now says `tie_word_embeddings: false`, so that vLLM serves that head too." in card
    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float64)
    assert torch.equal(model.get_output_embeddings().weight, head)  # what vLLM serves too: the config no longer ties it


@pytest.mark.parametrize("refine", [False, True, "unchanged"])
def test_gemma2s_stored_head_is_written_as_the_embedding_it_stays_tied_to(family_scenarios, tmp_path, capsys, monkeypatch, refine):
    """vLLM serves Gemma-2 only tied (its loader asserts tie_word_embeddings and reads logits off the embedding), so a
    merge storing an `lm_head.weight` of its own is not untied as other families are: that tensor is written as the
    output's embedding, which transformers then serves as well; also where every expert trails the merge and no layer is
    re-fitted ("unchanged"), and the card says so. Refined, the student trains tied, and the stored head follows its
    refined embedding."""
    from transformers import AutoModelForCausalLM

    import featcal_llm.engine.refine as refine_module
    import featcal_llm.pipeline as pipeline

    scenario = family_scenarios("gemma2")
    merged, head = merge_storing_a_head(scenario, tmp_path, "equal" if refine is True else "differs")
    keys = {"refine": {"steps": 2, "eval_every": 1, "lr": 1e-3, "params": "full"}} if refine is True else {}
    if refine == "unchanged":
        monkeypatch.setattr(pipeline, "every_expert_taught_by_the_merge", lambda taught, weights: True)
    trained = []
    if refine is True:  # every check kept, so that the refined embedding is written
        monkeypatch.setattr(refine_module, "improves", lambda value, above, best: True)
        student = refine_module.Student
        monkeypatch.setattr(refine_module, "Student", lambda *args: trained.append(student(*args)) or trained[-1])
    capsys.readouterr()
    from featcal_llm.calibration_result import CalibrationResult
    from featcal_llm.pipeline import run_recipe_outcome

    outcome = run_recipe_outcome(scenario.write_recipe(tmp_path / "r.yaml", merged=str(merged), output=str(tmp_path / "out"),
                                                       head=False, **keys), progress=False)
    output = outcome.output
    log = capsys.readouterr().err
    written, before = read_weights(output), read_weights(merged)
    assert outcome.head_changed == (refine == "unchanged")  # the run's last line says so (CalibrationResult.headline)
    result = CalibrationResult(output, merged, {}, 0.0, 0, None, unchanged=outcome.unchanged, head_changed=outcome.head_changed)
    assert result.headline().startswith(f"checkpoint written to {output}: the merged model, unchanged but for its LM head "
                                        "(see its card)") == (refine == "unchanged")
    embedding = written["model.embed_tokens.weight"]
    assert json.loads((output / "config.json").read_text())["tie_word_embeddings"] is True
    assert torch.equal(written["lm_head.weight"], embedding) and written.keys() == before.keys()
    if refine is True:
        assert json.loads((output / "featcal_refine.json").read_text())["chosen_step"] > 0
        assert not torch.equal(embedding, before["model.embed_tokens.weight"])  # the tied head trained with it
        assert "model.embed_tokens.weight" in trained[0].trainable and "lm_head.weight" not in trained[0].trainable
    else:
        assert "its files store an lm_head.weight of its own; vLLM serves Gemma2ForCausalLM only tied, so the output's lm_head.weight is the input embedding" in log
        card = (output / "README.md").read_text()
        assert not torch.equal(head, embedding) and "so that vLLM serves that head too" not in card
        assert "so the output's `lm_head.weight` is written as the input embedding, the head transformers then serves too." in card
        if refine == "unchanged":
            assert "this model is the merged model, unchanged, but for its LM head, as below." in card
            assert all(torch.equal(written[name], before[name]) for name in before if name != "lm_head.weight")
    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float64)
    assert torch.equal(model.get_output_embeddings().weight, embedding)


def test_an_untied_gemma2_merge_refines_its_own_head(family_scenarios, tmp_path, monkeypatch):
    """A Gemma-2 merge whose config does not tie (vLLM refuses such a model; transformers serves its stored head): the
    output keeps its config, and refinement trains the head it serves, not a tied stand-in."""
    import featcal_llm.engine.refine as refine_module

    scenario = family_scenarios("gemma2")
    merged, head = merge_storing_a_head(scenario, tmp_path, "differs")
    config = json.loads((merged / "config.json").read_text())
    (merged / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    trained = []
    monkeypatch.setattr(refine_module, "improves", lambda value, above, best: True)
    student = refine_module.Student
    monkeypatch.setattr(refine_module, "Student", lambda *args: trained.append(student(*args)) or trained[-1])
    output = run_recipe(scenario.write_recipe(tmp_path / "r.yaml", merged=str(merged), output=str(tmp_path / "out"), head=False,
                                              refine={"steps": 2, "eval_every": 1, "lr": 1e-3, "params": "full"}), progress=False)
    assert "lm_head.weight" in trained[0].trainable and "model.embed_tokens.weight" in trained[0].trainable
    assert json.loads((output / "config.json").read_text())["tie_word_embeddings"] is False
    assert not torch.equal(read_weights(output)["lm_head.weight"], head)  # trained


def test_the_heads_statistics_are_float64_whatever_the_layers_take(family_scenarios, tmp_path, monkeypatch):
    """The layers at λ = 3 sum their statistics in float32; the head, re-fitted at λ = 1e-5 (its default), in float64
    (it had taken the layers' float32), and so with `stats_dtype: float32` written out, as a tuned run's replay writes
    the layers' resolved precision: the replay re-fits the head alike. The card says both."""
    import featcal_llm.engine.head as head_module
    from featcal_llm.io.recipe import load_recipe
    from featcal_llm.io.saved_recipe import replay_text

    scenario = family_scenarios("llama")
    seen = []
    accumulate = head_module.accumulate_gram
    monkeypatch.setattr(head_module, "accumulate_gram", lambda total, rows, dtype: seen.append(dtype) or accumulate(total, rows, dtype))
    for stats in ("auto", "float32"):
        recipe = scenario.write_recipe(tmp_path / f"{stats}.yaml", output=str(tmp_path / stats), dtype="float32",
                                       head={"lambda": 1e-5}, stats_dtype=stats, **{"lambda": 3.0})
        output = run_recipe(recipe, progress=False)
        assert seen and set(seen) == {torch.float64}
        seen.clear()
        assert "- statistics' precision: float32 (the LM head's re-fit: float64)\n" in (output / "README.md").read_text()
    tuning = {"chosen": {"lambda": [3.0, 3.0]}, "search": {"holdout": 0.25}}
    replayed = replay_text(load_recipe(tmp_path / "auto.yaml"), tuning, {"dtype": torch.float32, "stats_dtype": torch.float32,
                                                                         "head_stats_dtype": torch.float64})
    assert "stats_dtype: float32" in replayed and "head_stats_dtype" not in replayed


def test_the_heads_float32_fallback_on_a_gpu_without_fast_float64_names_the_head(monkeypatch, capsys):
    """The one case the head's statistics are float32: its warning names the head and its λ, not `stats_dtype`, which
    does not set the head's precision."""
    import featcal_llm.engine.devices as devices

    monkeypatch.setattr(devices, "fast_float64", lambda device: False)
    assert devices.head_stats_dtype(1e-5, torch.bfloat16, torch.device("cuda")) == torch.float32
    err = capsys.readouterr().err
    assert "featcal.head: the LM head's statistics use float32 products on a GPU without fast float64" in err
    assert "at its lambda 1e-05" in err and "stats_dtype" not in err
    assert devices.head_stats_dtype(1e-5, torch.float64, torch.device("cuda")) == torch.float64
    monkeypatch.setattr(devices, "fast_float64", lambda device: True)
    assert devices.head_stats_dtype(1.0, torch.bfloat16, torch.device("cuda")) == torch.float64


def test_the_head_solved_in_row_blocks_is_the_head_solved_at_once_in_the_dtype_asked():
    """A 128k-row head is solved in blocks of rows (one factor of lhs for all): a 7-row head in blocks of 3 equals the
    one-block solve, every block's rows its own, and comes back in the dtype asked for (the checkpoint's)."""
    from featcal_llm.maths.head import HeadStatistics, solve_head
    from featcal_llm.maths.objective import Hyperparameters

    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    statistics = []
    for _ in range(2):
        x_cal, x_exp = rand(40, 5), rand(40, 5)
        statistics.append(HeadStatistics(x_cal.T @ x_cal, x_exp.T @ x_cal, 40))
    heads, merged, base = [rand(7, 5), rand(7, 5)], rand(7, 5), rand(7, 5)
    hyper = Hyperparameters(lam=1e-2, alpha=0.3, rho=0.8, eps=1e-8)
    whole = solve_head(statistics, heads, merged, base, hyper, rows=7)
    assert torch.allclose(solve_head(statistics, heads, merged, base, hyper, rows=3), whole, rtol=1e-12, atol=1e-12)
    single = solve_head(statistics, heads, merged, base, hyper, dtype=torch.float32, rows=3)
    assert single.dtype == torch.float32 and torch.equal(single, whole.float())
