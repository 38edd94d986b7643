"""`refine:`: the block's errors and the stage end to end on a tiny merge (the top-k KL: test_topk_kl.py; the
precision and memory rules: test_refine_memory.py; which check is kept and when progress is saved: test_refine_rules.py).

The end-to-end runs share one scenario (two experts, two layers, experts far from the merge so that the closed form leaves
a gap for the gradient steps to close); each run is a few seconds of CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_topk_kl import full_kl



@pytest.mark.parametrize("value, message", [
    ({"stpes": 3}, "featcal.refine.stpes: unknown key; did you mean 'steps'?"),
    ({"lr": -1}, "featcal.refine.lr: Input should be greater than 0"),
    ({"top_k": 0}, "featcal.refine.top_k: Input should be greater than or equal to 1"),
    ({"steps": 10**8}, "featcal.refine.steps: Input should be less than or equal to 100000"),  # every step planned first
    ({"batch_records": 10**6}, "featcal.refine.batch_records: Input should be less than or equal to 65536"),
    ({"params": "lora"}, "featcal.refine.params:"),
    ({"params": True}, "featcal.refine.params: Input should be 'auto', 'full' or 'adapter' (got true)"),  # as YAML spells it
    ({"precision": "float16"}, "featcal.refine.precision:"),
    ({"gradient_checkpointing": "sometimes"}, "featcal.refine.gradient_checkpointing: Input should be 'auto', true or false (got 'sometimes')"),
    ("yes", "featcal.refine: expected true, false or a mapping"),
    (None, "featcal.refine: empty; write true for its defaults, a mapping of its keys, or false"),  # keys commented out
    ({"steps": True}, "featcal.refine.steps: expected a number, got true"),  # pydantic's lax mode read it as 1 step
    ({"lr": True}, "featcal.refine.lr: expected a number, got true"),  # and as a learning rate of 1.0
    ({"warmup": False}, "featcal.refine.warmup: expected a number, got false"),
])
def test_bad_refine_keys_are_one_line(tmp_path, value, message):
    from scenario import build_scenario

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.validate import check_before_run

    scenario = build_scenario(tmp_path / "s", experts=2, layers=1, samples=4)
    recipe = scenario.write_recipe(tmp_path / "bad.yaml", refine=value)
    with pytest.raises(FeatCalError) as error:
        check_before_run(recipe)
    text = str(error.value)
    assert message in text and "\n" not in text.strip()


def test_refine_true_takes_the_defaults_and_holds_records_out(tmp_path):
    from featcal_llm.io.block import FeatCalConfig

    block = {"merged": "m", "output": "o", "data": {}}
    assert FeatCalConfig(**block).refine is None and not FeatCalConfig(**block).holds_out
    on = FeatCalConfig(**block, refine=True)
    assert on.refine.steps == 40 and on.refine.learning_rate("full") == 1e-4 and on.refine.learning_rate("adapter") == 3e-4
    assert on.holds_out  # the held-out records choose the step count
    assert FeatCalConfig(**block, refine=False).refine is None


# ---- the stage end to end on a tiny merge -------------------------------------------------------------------------

REFINE = {"steps": 6, "eval_every": 2, "patience": 2, "lr": 3e-4, "batch_records": 8, "params": "full", "top_k": 128,
          "precision": "float32"}  # the same numbers on every CPU (auto picks bf16 where the CPU has AVX512-BF16 or AMX)


def kind_texts(kind: int, count: int) -> list[str]:
    """Two kinds of text a model can tell apart: words (expert0's records) and arithmetic-like symbols (expert1's), so
    that held-out records of a kind can be predicted from the training records of that kind."""
    import random
    import string

    from scenario import WORDS

    rng = random.Random(kind)
    if kind == 0:
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(count)]
    symbols = string.digits + "+-*/=()"
    return [" ".join("".join(rng.choice(symbols) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(4, 10)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def far_scenario(tmp_path_factory):
    """Two experts far from their merge (noise 0.6), two layers, each with its own kind of text; merged once by mergekit."""
    from scenario import build_scenario

    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("refine"), experts=2, layers=2, samples=12, noise=0.6)
    for kind, path in enumerate(sorted(scenario.data.values())):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in kind_texts(kind, 16)))
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


def run(scenario, name: str, **featcal) -> Path:
    from featcal_llm.pipeline import run_recipe

    recipe = scenario.write_recipe(scenario.root / f"{name}.yaml", output=str(scenario.root / name), **featcal)
    return run_recipe(recipe, force=True, progress=False)


@pytest.fixture(scope="module")
def closed_form(far_scenario) -> Path:
    """The same run (records held out alike) with the refine stage replaced by one that returns the closed form's tensors:
    what every refinement of this scenario starts from (the refine settings do not change the closed form)."""
    import featcal_llm.engine.refine as refine_module

    def stand_in(job):
        return job.replacements, {"params": "full", "lr": 0.0, "steps_run": 0, "chosen_step": 0, "max_steps": 0, "top_k": 1,
                                  "held_out_kl": {"before": 0.0, "after": 0.0}, "teachers": {}}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(refine_module, "refine", stand_in)
        return run(far_scenario, "closed", refine=REFINE)


@pytest.fixture(scope="module")
def refined(far_scenario) -> Path:
    """REFINE's run, shared by the tests that read it."""
    return run(far_scenario, "refined", refine=REFINE)


def held_out_records(scenario, recipe_path: Path) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from featcal_llm.engine.tuning import split_holdout
    from featcal_llm.io.data import calibration_sequences
    from featcal_llm.io.recipe import load_recipe

    featcal = load_recipe(recipe_path).featcal
    tokenizer = AutoTokenizer.from_pretrained(scenario.base)
    sequences = calibration_sequences(featcal.data, list(featcal.data), tokenizer, featcal.samples, featcal.max_length,
                                      featcal.shuffle, featcal.seed, recipe_path)
    return split_holdout(sequences, featcal.tune_settings().holdout, featcal.seed, "test")[1]


def teacher_kl(model_dir: Path, scenario, records: dict[str, list[list[int]]]) -> float:
    """Mean over experts of the token mean of the full-vocabulary KL(expert ‖ model) on its held-out records (transformers alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    values = []
    for task, rows in records.items():
        expert = AutoModelForCausalLM.from_pretrained(task, dtype=torch.float64).eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for row in rows:
                ids = torch.tensor([row])
                total += float(full_kl(model(ids).logits[0, :-1], expert(ids).logits[0, :-1]))
                count += len(row) - 1
        values.append(total / count)
    return sum(values) / len(values)


def test_refine_lowers_the_held_out_kl_to_the_teachers(far_scenario, refined, closed_form):
    closed = closed_form
    report = json.loads((refined / "featcal_refine.json").read_text())
    assert report["chosen_step"] > 0 and report["held_out_kl"]["after"] < report["held_out_kl"]["before"]
    records = held_out_records(far_scenario, far_scenario.root / "refined.yaml")
    before, after = teacher_kl(closed, far_scenario, records), teacher_kl(refined, far_scenario, records)
    # the stage's own numbers (top-128 of a 100-token vocabulary: every token, in float16) against transformers' full KL
    assert before == pytest.approx(report["held_out_kl"]["before"], rel=1e-2)
    assert after == pytest.approx(report["held_out_kl"]["after"], rel=1e-2)
    assert after < before
    assert "## Refinement" in (refined / "README.md").read_text() and "warm-up then cosine, in float32 throughout)" in (refined / "README.md").read_text()
    assert "The drift report (`featcal_drift.json`) measures the closed form's output, before this refinement." in (refined / "README.md").read_text()
    # the records the checks read, counted as the independent split counts them, left out of both stages' fits
    assert report["held_out_records"] == {Path(task).name: len(rows) for task, rows in records.items()} and all(report["held_out_records"].values())
    card = " ".join((refined / "README.md").read_text().split())
    assert "were held out of the closed form's statistics too (`tune.holdout`): both stages fitted the rest." in card
    assert "calibration tokens (in the records not held out: `tune.holdout`)" in card  # the experts' counts say which records
    assert ("These held-out KLs are the stage's own measure, over each teacher's top-k tokens in the precision it trained in, "
            "not the drift report's full-vocabulary KL to each expert, and need not equal it.") in card
    # the body's account of what was re-fitted is the closed form's: it says what the refinement trained after it
    assert ("That is the closed form; the refinement after it (see Refinement) then trained every parameter (the embeddings, "
            "norms and LM head included), so those too now differ from the merged model.") in card
    assert "That is the closed form" not in (closed / "README.md").read_text()  # no refinement kept: the body stands
    assert json.loads((refined / "featcal_drift.json").read_text())["measured_on"].startswith("the closed form's output, before refine:")
    # the saved recipe replays to the same bytes
    replayed = far_scenario.root / "replayed.yaml"
    saved = yaml.safe_load((refined / "featcal_recipe.yml").read_text())
    saved["featcal"]["output"] = str(far_scenario.root / "replayed")
    replayed.write_text(yaml.safe_dump(saved, sort_keys=False))
    from featcal_llm.pipeline import run_recipe

    again = run_recipe(replayed, force=True, progress=False)
    assert (again / "model.safetensors").read_bytes() == (refined / "model.safetensors").read_bytes()


def test_no_improvement_leaves_the_closed_form_unchanged(far_scenario, closed_form, capsys, monkeypatch):
    """A learning rate far too high: every check is worse than the closed form, so its tensors are written, bit for bit;
    the log and the card say why (the training KL rose too) and what to try."""
    import featcal_llm.engine.refine as refine_module

    losses = []
    step = refine_module.train_step
    monkeypatch.setattr(refine_module, "train_step", lambda *args: losses.append(step(*args)) or losses[-1])
    wild = {**REFINE, "lr": 1.0}
    refined = run(far_scenario, "wild", refine=wild)
    closed = closed_form
    report = json.loads((refined / "featcal_refine.json").read_text())
    assert report["chosen_step"] == 0 and report["steps_run"] == 2 * wild["eval_every"]  # patience 2: two worse checks
    # step 0's training KL: the first step's, before any update; each check's: the mean over the steps since the last
    every = wild["eval_every"]
    assert [check.get("train_kl") for check in report["history"]] == pytest.approx(
        [losses[0], sum(losses[:every]) / every, sum(losses[every:]) / every], rel=1e-12)
    assert report["history"][-1]["train_kl"] > 10 * report["history"][0]["train_kl"]
    err = " ".join(capsys.readouterr().err.split())
    import statistics

    assert [check.get("train_kl_sd") for check in report["history"][1:]] == pytest.approx(
        [statistics.stdev(losses[:every]), statistics.stdev(losses[every:])], rel=1e-9)
    assert [check["above_closed_form"] for check in report["history"][1:]] == [["expert0", "expert1"]] * 2
    assert re.search(r"so the closed form's output stands unchanged; every check raised every expert's held-out KL above the "
                     r"closed form's beyond two standard errors: the steps overshoot; a smaller refine.lr \(say 0.1\) may help; "
                     r"\d+ s in all; progress saved at [12] of 2 checks \(\d+ s\)", err)
    assert "the steps overshoot; a smaller refine.lr (say 0.1) may help." in " ".join((refined / "README.md").read_text().split())
    assert (refined / "model.safetensors").read_bytes() == (closed / "model.safetensors").read_bytes()
    assert "measured_on" not in json.loads((refined / "featcal_drift.json").read_text())  # the weights it measured


def test_a_check_that_raises_one_experts_kl_is_not_kept(far_scenario, closed_form, monkeypatch, capsys):
    """The held-out KLs scripted: every check lowers the mean, but expert1's KL ends above its closed-form value at the
    later checks, so only the first check (every expert lower) is kept and written."""
    import featcal_llm.engine.refine as refine_module

    measured = refine_module.heldout_kl
    checks = []

    def scaled(kl, factor):
        return {"sums": [value * factor for value in kl["sums"]], "counts": kl["counts"]}

    def scripted(*args):
        real = measured(*args)
        first, second = sorted(real)
        if not checks:
            checks.append(real)
            return real  # before the first step: the closed form's
        start = checks[0]
        index = len(checks)
        checks.append(real)
        if index == 1:  # every expert a little lower
            return {first: scaled(start[first], 0.9), second: scaled(start[second], 0.9)}
        # a far lower mean, bought with expert1's loss: its KL on every held-out record twice and more what it was
        return {first: scaled(start[first], 0.1), second: scaled(start[second], 2.0 + 0.1 * index)}

    monkeypatch.setattr(refine_module, "heldout_kl", scripted)
    refined = run(far_scenario, "guarded", refine=REFINE)
    report = json.loads((refined / "featcal_refine.json").read_text())
    assert report["chosen_step"] == 2 and report["steps_run"] == 6  # two checks without a kept improvement: stop
    assert str(far_scenario.root) in sorted(checks[0])[1]  # the experts are local paths, which the file names by short name
    assert [h["above_closed_form"] for h in report["history"][1:]] == [[], ["expert1"], ["expert1"]]
    assert str(far_scenario.root) not in (refined / "featcal_refine.json").read_text()
    assert "above the closed form's beyond two standard errors for expert1, so not kept" in capsys.readouterr().err
    assert (refined / "model.safetensors").read_bytes() != (closed_form / "model.safetensors").read_bytes()


def test_gradient_checkpointing_changes_the_time_not_the_update(far_scenario, refined):
    """Recomputing each layer and logits chunk in the backward (on where the memory model says a run needs it) computes the
    same gradients as keeping the activations (auto's choice for this tiny merge): the same refined tensors."""
    whole = json.loads((refined / "featcal_refine.json").read_text())
    assert whole["gradient_checkpointing"] is False  # auto: the stage fits half the machine's memory without it
    recomputed = run(far_scenario, "checkpointed", refine={**REFINE, "gradient_checkpointing": True})
    report = json.loads((recomputed / "featcal_refine.json").read_text())
    assert report["gradient_checkpointing"] is True and report["chosen_step"] == whole["chosen_step"] > 0
    merged = load_file(far_scenario.root / "merged" / "model.safetensors")
    kept, again = load_file(refined / "model.safetensors"), load_file(recomputed / "model.safetensors")
    for name, tensor in kept.items():  # the updates W* − W_mer, not the whole weights
        update, other = tensor.double() - merged[name].double(), again[name].double() - merged[name].double()
        assert torch.allclose(other, update, rtol=1e-5, atol=1e-7 * float(update.abs().max()) + 1e-12), name


def killed_after_check(scenario, name: str, refine: dict, at: int, monkeypatch) -> Path:
    """Run `name` and kill it right after its held-out check at step `at`, as a crash would; its staging area."""
    import featcal_llm.engine.refine as refine_module

    def crash(step, saved):
        if step == 2:
            assert saved  # the first check always saves
        if step == at:
            raise RuntimeError(f"killed after step {at}")

    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "after_check", crash)
        with pytest.raises(RuntimeError, match=f"killed after step {at}"):
            run(scenario, name, refine=refine)
    return scenario.root / f".{name}.featcal-partial"


def test_resume_mid_refinement_writes_the_same_bytes(far_scenario, refined, monkeypatch):
    import featcal_llm.engine.refine as refine_module

    settings, whole = REFINE, refined
    # the step written comes after the crash: the resumed steps (optimizer, schedule, order restored) decide the bytes
    assert json.loads((whole / "featcal_refine.json").read_text())["chosen_step"] > 2

    partial = killed_after_check(far_scenario, "resumed", settings, 2, monkeypatch)
    assert (partial / "pass-refine.pt").is_file() and not (far_scenario.root / "resumed").exists()
    saved = torch.load(partial / "pass-refine.pt", weights_only=True)  # the best state lives in its own file, written once
    assert saved["best"] is None and saved["best_step"] == 2
    assert [p.name for p in partial.glob("pass-refine-best-*")] == ["pass-refine-best-2.pt"]
    calls, step = [], refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "train_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        resumed = run(far_scenario, "resumed", refine=settings)
    assert len(calls) == json.loads((whole / "featcal_refine.json").read_text())["steps_run"] - 2  # only the steps after the check
    differ = sorted(path.name for path in whole.iterdir() if path.read_bytes() != (resumed / path.name).read_bytes())
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in whole.iterdir())
    assert differ == ["README.md", "featcal_recipe.yml"], differ  # the card and the recipe name the output (refined, resumed)


def test_a_best_state_lost_from_the_saved_progress_starts_the_refinement_over(far_scenario, refined, monkeypatch, capsys):
    """The progress names a best state whose file is gone (removed by hand, a damaged disk): the rerun says so and
    refines again from the calibrated layers, to the uninterrupted run's bytes (it had refused, advising a --force
    that never clears the progress)."""
    import featcal_llm.engine.refine as refine_module

    partial = killed_after_check(far_scenario, "lost", REFINE, 2, monkeypatch)
    (partial / "pass-refine-best-2.pt").unlink()
    calls, step = [], refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "train_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        resumed = run(far_scenario, "lost", refine=REFINE)
    assert "the saved progress names step 2 as best, but its state is missing" in capsys.readouterr().err
    assert len(calls) == json.loads((refined / "featcal_refine.json").read_text())["steps_run"]  # every step again
    assert (resumed / "model.safetensors").read_bytes() == (refined / "model.safetensors").read_bytes()


def test_a_changed_refine_setting_keeps_the_layers_and_refines_again(far_scenario, monkeypatch, capsys):
    """Killed in its refinement (as by running out of memory) and rerun with `gradient_checkpointing: true`: the calibrated
    layers and the teachers are reused, the refinement starts over under its new settings, and the bytes are those of a
    fresh run with them."""
    import featcal_llm.engine.calibrate as calibrate_module
    import featcal_llm.engine.refine as refine_module

    partial = killed_after_check(far_scenario, "changed", REFINE, 4, monkeypatch)
    assert (partial / "pass-refine.pt").is_file() and list(partial.glob("pass-refine-best-*"))
    changed = {**REFINE, "gradient_checkpointing": True}
    capsys.readouterr()
    with monkeypatch.context() as patch:  # killed again before its first step: none of the old progress is left to mix in
        patch.setattr(refine_module, "train_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed at step 1")))
        with pytest.raises(RuntimeError, match="killed at step 1"):
            run(far_scenario, "changed", refine=changed)
    assert "its settings changed since the saved progress, so it starts over" in capsys.readouterr().err
    assert sorted(p.name for p in partial.glob("pass-refine*")) == ["pass-refine-teachers.pt"]
    layers, steps = [], []
    fit, step = calibrate_module.calibrate_layer, refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(calibrate_module, "calibrate_layer", lambda *a, **k: layers.append(1) or fit(*a, **k))
        patch.setattr(refine_module, "train_step", lambda *a, **k: steps.append(1) or step(*a, **k))
        resumed = run(far_scenario, "changed", refine=changed)
    err = capsys.readouterr().err
    assert layers == [] and "the teachers' distributions reused" in err
    report = json.loads((resumed / "featcal_refine.json").read_text())
    assert report["gradient_checkpointing"] is True and len(steps) == report["steps_run"] > 4  # from step 0, not step 4
    fresh = run(far_scenario, "changed-fresh", refine=changed)
    assert (resumed / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


def test_keep_layers_lets_a_rerun_with_another_lr_refine_from_the_calibrated_layers(far_scenario, monkeypatch, capsys):
    """`run --keep-layers`: the finished run keeps its saved progress and says so; the rerun into the same output with
    another `lr` calibrates no layer and computes no teacher again, writes a fresh run's bytes and, without the flag,
    removes the progress. Without `refine:` the flag is refused in one line, before any work."""
    import featcal_llm.engine.calibrate as calibrate_module
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.api import calibrate
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.output_dir import partial_dir
    from featcal_llm.pipeline import run_recipe

    recipe = far_scenario.write_recipe(far_scenario.root / "kept.yaml", output=str(far_scenario.root / "kept"), refine=REFINE)
    output = run_recipe(recipe, force=True, progress=False, keep_layers=True)
    partial = partial_dir(output)
    assert re.search(rf"kept {re.escape(str(partial))} \(\d+\.\d\d GiB\): rerunning this recipe into {re.escape(str(output))} "
                     r"\(with --force, or after moving it aside\) with other refine: settings starts from its calibrated layers",
                     " ".join(capsys.readouterr().err.split()))
    assert (partial / "pass-refine-teachers.pt").is_file() and (output / "model.safetensors").is_file()
    # what no rerun with other settings reads is not kept: the refinement's progress, its best state, its tensors
    assert not (partial / "pass-refine.pt").exists() and not list(partial.glob("pass-refine-best-*")) and not (partial / "refine").exists()
    slower = {**REFINE, "lr": 1e-4}
    again = far_scenario.write_recipe(far_scenario.root / "kept-slower.yaml", output=str(output), refine=slower)
    layers, teachers = [], []
    fit, teach = calibrate_module.calibrate_layer, refine_module.teach
    with monkeypatch.context() as patch:
        patch.setattr(calibrate_module, "calibrate_layer", lambda *a, **k: layers.append(1) or fit(*a, **k))
        patch.setattr(refine_module, "teach", lambda *a, **k: teachers.append(1) or teach(*a, **k))
        rerun = run_recipe(again, force=True, progress=False)
    assert layers == [] and teachers == [] and not partial.exists()
    assert json.loads((rerun / "featcal_refine.json").read_text())["lr"] == 1e-4
    fresh = run(far_scenario, "kept-fresh", refine=slower)
    assert (rerun / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    bare = far_scenario.write_recipe(far_scenario.root / "bare.yaml", output=str(far_scenario.root / "bare"))
    with pytest.raises(FeatCalError) as error:
        calibrate(bare, keep_layers=True, progress=False)
    line = f"{bare}: --keep-layers (keep_layers=True): featcal has no refine: block;"
    assert str(error.value).startswith(line) and "\n" not in str(error.value)
    assert not (far_scenario.root / "bare").exists()
    from click.testing import CliRunner

    from featcal_llm.cli import main

    checked = CliRunner().invoke(main, ["validate", str(bare), "--keep-layers"])  # what run refuses, validate refuses
    assert checked.exit_code == 2 and line in checked.output, checked.output


def test_teachers_saved_at_another_top_k_are_computed_again(far_scenario, monkeypatch, capsys):
    """The teachers' saved top-k distributions hold `top_k` tokens a position: a rerun asking for fewer computes them
    again (reusing them would train on a KL over other bins), to the bytes of a fresh run at the new top_k."""
    killed_after_check(far_scenario, "topk", REFINE, 2, monkeypatch)
    fewer = {**REFINE, "top_k": 16}
    capsys.readouterr()
    resumed = run(far_scenario, "topk", refine=fewer)
    err = capsys.readouterr().err
    assert "the teachers' distributions reused" not in err and "the teachers' top-16 next-token distributions" in err
    fresh = run(far_scenario, "topk-fresh", refine=fewer)
    assert (resumed / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


def test_a_steps_gradient_is_that_of_the_token_mean_kl_over_its_records(far_scenario, monkeypatch):
    """The first step's gradient, micro-batched over padded batches of top-k teachers, against autograd of the textbook
    token mean of the full-vocabulary KL(expert ‖ model) over the step's judged tokens, one record at a time (top_k 128
    covers this 100-token vocabulary; the teachers' float16 log-probabilities are the only difference: measured 1.6e-3)."""
    import featcal_llm.engine.refine as refine_module
    from transformers import AutoModelForCausalLM

    from featcal_llm.engine.refine_data import judged_positions

    compared, original = [], refine_module.train_step

    def checked(student, store, keys, records, job, autocast):
        loss = original(student, store, keys, records, job, autocast)
        if compared:
            return loss
        ours = {name: p.grad.detach().clone() for name, p in student.trainable.items()}
        for p in student.trainable.values():
            p.grad = None
        total, count = 0.0, 0
        for task, index in keys:
            row = records[task][index]
            ids, positions = torch.tensor([list(row)]), list(judged_positions(row))
            teacher = AutoModelForCausalLM.from_pretrained(task, dtype=torch.float32).eval()
            with torch.no_grad():
                target = teacher(ids).logits[0, positions]
            total = total + full_kl(student.model(input_ids=ids).logits[0, positions], target)
            count += len(positions)
        (total / count).backward()
        for name, p in student.trainable.items():
            reference, p.grad = p.grad.detach().double(), ours[name]  # the run goes on with its own gradient
            compared.append(float((ours[name].double() - reference).norm() / reference.norm().clamp_min(1e-30)))
        return loss

    monkeypatch.setattr(refine_module, "train_step", checked)
    output = run(far_scenario, "gradient", refine={**REFINE, "steps": 1, "eval_every": 1, "batch_records": 4})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert set(report["teachers"].values()) == {"own expert"}, report["teachers"]
    assert report["top_k"] == 100  # top_k 128 asked of a 100-token vocabulary: the report names the top-k that ran
    assert len(compared) > 10 and max(compared) < 1e-2, max(compared)


def test_out_of_memory_in_the_refinement_names_its_own_levers(far_scenario, monkeypatch):
    """The refinement's memory is set by its own keys, which keep the calibrated layers; featcal.batch_tokens (the
    layers' lever) would start the whole run over."""
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.errors import RunFailure

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(refine_module, "train_step", exhausted)
    with pytest.raises(RunFailure) as failure:
        run(far_scenario, "exhausted", refine=REFINE)
    assert str(failure.value) == ("out of memory (CUDA out of memory. Tried to allocate 4.00 GiB); in the refinement: set "
                                  "featcal.refine.gradient_checkpointing: true (or featcal.refine.params: adapter where it "
                                  "trains every parameter) and rerun the same command: the calibrated layers are kept")
    assert not (far_scenario.root / "exhausted").exists()
    assert list((far_scenario.root / ".exhausted.featcal-partial" / "layers").glob("layer-*.safetensors")), "the layers stay staged"
    monkeypatch.setattr(refine_module, "train_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other error keeps its traceback
        run(far_scenario, "exhausted", refine=REFINE)


def test_progress_saved_under_other_settings_is_forgotten_whole(tmp_path):
    """The old progress and every old best state go before a refinement starts over: a best state of the same step
    written under other settings must never be read back as the new run's."""
    from featcal_llm.engine.refine_progress import best_pass, forget_progress
    from featcal_llm.engine.resume import StagingArea

    staging = StagingArea(tmp_path / "partial", "fingerprint")
    for name in ("refine", best_pass(2), best_pass(4), "refine-teachers"):
        staging.save_pass(name, {"step": 0})
    forget_progress(staging)
    assert sorted(p.name for p in staging.root.glob("pass-*")) == ["pass-refine-teachers.pt"]


def test_a_crash_after_an_unsaved_check_resumes_from_the_last_save(far_scenario, refined, monkeypatch):
    """Saves only at the first check (as when saving is slow against the steps): killed after the check at step 4, which
    found a new best but saved nothing, the rerun resumes after step 2 and still writes the unbroken run's bytes."""
    import featcal_llm.engine.refine as refine_module
    import featcal_llm.engine.refine_progress as progress_module

    whole = json.loads((refined / "featcal_refine.json").read_text())
    assert [h["step"] for h in whole["history"]] == [0, 2, 4, 6] and whole["chosen_step"] >= 4
    seen = []

    def crash(step, saved):
        seen.append((step, saved))
        if step == 4:
            raise RuntimeError("killed after step 4")

    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "after_check", crash)
        patch.setattr(progress_module, "save_due", lambda since, cost, share=0.1: since is None)
        with pytest.raises(RuntimeError, match="killed after step 4"):
            run(far_scenario, "unsaved", refine=REFINE)
    assert seen == [(2, True), (4, False)]
    partial = far_scenario.root / ".unsaved.featcal-partial"
    assert torch.load(partial / "pass-refine.pt", weights_only=True)["step"] == 2
    calls, step = [], refine_module.train_step
    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "train_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        resumed = run(far_scenario, "unsaved", refine=REFINE)
    assert len(calls) == whole["steps_run"] - 2
    assert (resumed / "model.safetensors").read_bytes() == (refined / "model.safetensors").read_bytes()


def _has_biases(output: Path) -> bool:
    return any(name.endswith(".bias") for name in load_file(output / "model.safetensors"))


def test_adapter_merged_back_gives_the_peft_models_logits(far_scenario, monkeypatch, recwarn):
    """params: adapter: the written checkpoint, loaded by transformers, predicts as the in-memory peft model did."""
    import featcal_llm.engine.refine as refine_module

    ids = torch.tensor([[1, 20, 31, 44, 57, 60, 71, 82, 93, 5]])
    seen = {}
    written = refine_module.Student.written

    def capture(student):
        with torch.no_grad():
            seen["logits"] = student.module(input_ids=ids).logits.detach().clone()
            seen["lora"] = [name for name in student.trainable if "lora_" in name]
        return written(student)

    monkeypatch.setattr(refine_module.Student, "written", capture)
    output = run(far_scenario, "adapter", refine={**REFINE, "params": "adapter", "rank": 4, "lr": 1e-3})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert report["params"] == "adapter" and report["rank"] == 4 and report["chosen_step"] > 0
    assert seen["lora"]  # a LoRA was trained, not the whole model
    assert not [w for w in recwarn if "is_gradient_checkpointing" in str(w.message)]  # peft's use of a deprecated name, silenced
    card = " ".join((output / "README.md").read_text().split())
    biases, tied = _has_biases(output), report["tied_head"]
    trained = ("a rank-4 LoRA on the calibrated projections, merged back into the weights, with the norms"
               + (", biases and LM head" if biases else " and LM head") + " in full"
               + (" (the LM head is tied to the input embeddings: they trained as one)" if tied else ""))
    assert f"the refinement after it (see Refinement) then trained {trained}, so those too" in card  # the body
    assert f"`refine:` trained {trained} (AdamW" in card  # and the Refinement section, alike
    config = json.loads((output / "config.json").read_text())
    assert tied == bool(config.get("tie_word_embeddings")) and not biases  # Llama without attention_bias
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, seen["logits"], atol=1e-5, rtol=1e-5)


def test_bf16_refinement_lands_near_the_float32_one(far_scenario, closed_form, monkeypatch):
    """The GPU path's precision (bf16 autocast, float32 masters), here on the CPU, against float32 throughout, from the same
    closed form: the held-out KL within 2 % and the refinement's update to the weights within 15 % (relative, Frobenius;
    measured: 0.02 % and 5.6 %)."""
    import featcal_llm.engine.refine as refine_module

    settings = {**REFINE, "steps": 4, "eval_every": 4}
    teaching, teach = [], refine_module.teach  # the teachers' forwards run in the student's precision
    monkeypatch.setattr(refine_module, "teach", lambda *a: teaching.append(a[-1]) or teach(*a))
    fp32 = run(far_scenario, "fp32", refine={**settings, "precision": "float32"})
    assert teaching and set(teaching) == {None}
    refine = refine_module.refine

    def in_bf16(job):
        job.compute_dtype = torch.bfloat16  # the GPU path's compute dtype: the teachers (and an adapter's frozen weights) in bf16
        return refine(job)

    with monkeypatch.context() as patch:
        patch.setattr(refine_module, "refine", in_bf16)
        bf16 = run(far_scenario, "bf16", refine={**settings, "precision": "bfloat16"})
    closed = closed_form
    reports = [json.loads((path / "featcal_refine.json").read_text()) for path in (fp32, bf16)]
    assert reports[0]["autocast"] == "None" and reports[1]["autocast"] == "torch.bfloat16"
    assert "warm-up then cosine, under bf16 autocast with float32 master weights)" in (bf16 / "README.md").read_text()
    assert set(teaching[len(teaching) // 2:]) == {torch.bfloat16}
    assert reports[0]["chosen_step"] == reports[1]["chosen_step"] == 4
    assert reports[1]["held_out_kl"]["after"] == pytest.approx(reports[0]["held_out_kl"]["after"], rel=0.02)
    start, a, b = (load_file(path / "model.safetensors") for path in (closed, fp32, bf16))
    update = torch.cat([(a[name] - start[name]).flatten() for name in start])
    difference = torch.cat([(b[name] - a[name]).flatten() for name in start])
    assert float(update.norm()) > 0 and float(difference.norm() / update.norm()) < 0.15


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_adapter_over_half_precision_layers_refines_in_float32_throughout(far_scenario, dtype):
    """Layers computed in bf16/fp16 and `precision: float32` (or `auto` on a CPU without native bf16): no autocast casts
    the matmuls, so the adapter's frozen weights are float32 as well (they met float32 activations in bf16 before)."""
    output = run(far_scenario, f"adapter-{dtype}", dtype=dtype, refine={**REFINE, "params": "adapter", "rank": 4, "steps": 2,
                                                                       "eval_every": 2})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert report["params"] == "adapter" and report["autocast"] == "None" and report["steps_run"] == 2


def test_only_refines_presence_enters_the_fingerprint_and_a_stack_refines_once():
    from featcal_llm.io.block import FeatCalConfig
    from featcal_llm.stages.prepare import resolved_settings

    block = {"merged": "m", "output": "o", "data": {}}
    settings = [json.dumps(resolved_settings(FeatCalConfig(**block, refine=value)), sort_keys=True)
                for value in (False, True, {"steps": 41}, {"params": "adapter"})]
    # refine holds records out of the closed form, so turning it on starts over; its keys are the refine stage's to check
    assert settings[0] != settings[1] == settings[2] == settings[3]
    stack = FeatCalConfig(**block, method=["regmean", "featcal"], refine=True)
    assert stack.stage(0, "intermediate").refine is None and stack.stage(1, "intermediate").refine is not None
    assert stack.stage(0, "intermediate").holds_out  # RegMean's Grams never see the records that stop the refinement


def test_an_expert_at_weight_0_neither_trains_nor_stops_the_refinement(far_scenario, capsys):
    """One expert's records alone train, so a step of 24 records repeats them: the run says so, once."""
    data = yaml.safe_load(far_scenario.recipe.read_text())["featcal"]["data"]
    silent = sorted(data)[1]
    data[silent]["weight"] = 0
    output = run(far_scenario, "weight0", data=data, refine={**REFINE, "steps": 2, "eval_every": 2, "batch_records": 24})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert list(report["teachers"]) == ["expert0"] and list(report["per_expert"]["before"]) == ["expert0"]
    err = capsys.readouterr().err
    trained = re.search(r"KL\(teacher ‖ model\) over each teacher's top-\d+ tokens on (\d+) records", err)
    assert trained is not None and int(trained.group(1)) < 24
    assert err.count(f"featcal.refine.batch_records: 24 is more than the {trained.group(1)} training records") == 1
    assert re.search(r"refine: full parameters, lr 0\.0003, float32, gradient checkpointing o", err)  # the precision it ran in


def test_data_free_records_refine_the_same_way(far_scenario, capsys):
    """`generate:`: an expert's own samples are its records, split, taught and judged on every token like plain text;
    the run warns once that the held-out records are generated (what validate says too)."""
    data = yaml.safe_load(far_scenario.recipe.read_text())["featcal"]["data"]
    writer = sorted(data)[1]
    data[writer] = {"generate": {"samples": 8, "max_new_tokens": 24, "chat_template": "off", "temperature": 1.0}}
    output = run(far_scenario, "generated", data=data, refine={**REFINE, "steps": 2, "eval_every": 2})
    assert capsys.readouterr().err.count(f"featcal.refine: {writer} calibrates on generated records") == 1
    report = json.loads((output / "featcal_refine.json").read_text())
    assert set(report["teachers"]) == {"expert0", "expert1"} and report["per_expert"]["before"]["expert1"] > 0


def test_refine_runs_after_regmean_with_the_experts_as_teachers(far_scenario):
    """RegMean (trailing_experts: keep, every expert teaches its records) followed by refine: allowed, and it refines."""
    from featcal_llm.pipeline import run_recipe

    recipe = yaml.safe_load(far_scenario.recipe.read_text())
    for key in ("lambda", "alpha", "rho", "token_weights", "expert_weights", "trailing_experts", "head"):  # FeatCal's keys
        recipe["featcal"].pop(key)
    recipe["featcal"].update(method="regmean", output=str(far_scenario.root / "regmean"), refine=REFINE)
    path = far_scenario.root / "regmean.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(path, force=True, progress=False)
    report = json.loads((output / "featcal_refine.json").read_text())
    assert set(report["teachers"].values()) == {"own expert"} and report["chosen_step"] > 0


def test_no_record_left_to_train_on_keeps_the_closed_form(capsys):
    """Every record left out (its expert trails the merge on each): refine writes nothing of its own and says why."""
    from types import SimpleNamespace

    from featcal_llm.engine.refine import refine

    closed = {"model.layers.0.mlp.up_proj.weight": Path("closed.safetensors")}
    job = SimpleNamespace(train={"a": [], "b": []}, replacements=closed)
    assert refine(job) == (closed, None)
    assert "refine: skipped, as no calibration record is left to train on" in capsys.readouterr().err


def test_a_diverged_check_is_written_as_null_in_strict_json(tmp_path):
    """A learning rate that diverges gives NaN KLs; featcal_refine.json holds null there, which every JSON parser reads."""
    from featcal_llm.io.refine_card import append_refinement

    (tmp_path / "README.md").write_text("# card\n\n## Usage\n")
    nan = float("nan")
    refined = {"params": "full", "lr": 1e10, "top_k": 64, "steps_run": 4, "max_steps": 4, "chosen_step": 0, "teachers": {"a": "own expert"},
               "held_out_kl": {"before": 0.5, "after": 0.5}, "autocast": "None", "master": "torch.float32",
               "history": [{"step": 2, "train_kl": nan, "held_out_kl": float("inf"), "per_expert": {"a": nan}, "above_closed_form": ["a"]}]}
    append_refinement(tmp_path, refined)

    def refuse(constant):
        raise ValueError(constant)

    written = json.loads((tmp_path / "featcal_refine.json").read_text(), parse_constant=refuse)
    assert written["history"][0] == {"step": 2, "train_kl": None, "held_out_kl": None, "per_expert": {"a": None}, "above_closed_form": ["a"]}


def test_the_saved_recipe_pins_refines_machine_dependent_choices_and_replays_elsewhere(far_scenario, monkeypatch):
    """`params: auto` (the device's memory) and `precision: auto` (native bf16 or not) are written out as this run
    resolved them: the replay on a machine that would resolve precision the other way writes the same bytes."""
    import featcal_llm.engine.refine as refine_module
    from featcal_llm.engine.devices import native_bf16
    from featcal_llm.io.saved_recipe import REFINE_NOTE
    from featcal_llm.pipeline import run_recipe

    settings = {key: value for key, value in REFINE.items() if key not in ("params", "precision")}
    output = run(far_scenario, "pinned", refine={**settings, "steps": 2, "eval_every": 2})
    report = json.loads((output / "featcal_refine.json").read_text())
    saved = (output / "featcal_recipe.yml").read_text()
    resolved = "bfloat16" if report["autocast"] == "torch.bfloat16" else "float32"
    assert REFINE_NOTE in saved and saved.startswith("# Written by featcal-llm")
    assert yaml.safe_load(saved)["featcal"]["refine"] == {**settings, "steps": 2, "eval_every": 2, "params": report["params"], "precision": resolved}
    monkeypatch.setattr(refine_module, "native_bf16", lambda device: not native_bf16(device))  # the other kind of machine
    replay = yaml.safe_load(saved)
    replay["featcal"]["output"] = str(far_scenario.root / "pinned-replay")
    (far_scenario.root / "pinned-replay.yaml").write_text(yaml.safe_dump(replay, sort_keys=False))
    again = run_recipe(far_scenario.root / "pinned-replay.yaml", force=True, progress=False)
    assert json.loads((again / "featcal_refine.json").read_text())["autocast"] == report["autocast"]
    assert (again / "model.safetensors").read_bytes() == (output / "model.safetensors").read_bytes()


def test_the_runs_summary_table_says_refine_changed_the_weights_after_it_was_measured(far_scenario, refined):
    """The table's drift and KL are measured in the layer loop, on the closed form's output: after a refinement that
    changed the weights it says so, and names the records (held out here) and refine's own change per expert."""
    import featcal_llm

    report = json.loads((refined / "featcal_refine.json").read_text())
    result = featcal_llm.calibrate(far_scenario.root / "refined.yaml", output=str(far_scenario.root / "refined-api"),
                                   force=True, progress=False)
    assert result.probe == "held-out records" and result.refined.chosen_step == report["chosen_step"] > 0
    by_label = {Path(name).name: value for name, value in result.refined.held_out_kl.items()}
    assert set(result.refined.held_out_kl) == set(result.experts)  # the recipe's names, as `experts`
    assert by_label == {label: (report["per_expert"]["before"][label], report["per_expert"]["after"][label])
                        for label in report["per_expert"]["before"]}
    table = result.table().splitlines()
    assert table[0].split() == ["expert", "drift", "merged", "drift", "closed", "form", "KL", "merged", "KL", "closed", "form"]
    assert {len(row) for row in table[:2 + len(result.experts)]} == {len(table[0])}  # each value under its heading's end
    assert "(drift and KL on each expert's held-out records, which the calibration did not fit)" in table
    [line] = [line for line in table if line.startswith("then refine: changed the weights")]
    assert line.startswith(f"then refine: changed the weights (step {report['chosen_step']}): held-out KL to each record's teacher "
                           f"over its top-{report['top_k']} tokens, refine's own measure, ")
    for label, before in report["per_expert"]["before"].items():
        assert f"{label} {before:.4g} → {report['per_expert']['after'][label]:.4g}" in line


def test_a_refinement_that_kept_the_closed_form_leaves_the_table_as_the_closed_forms(far_scenario, monkeypatch):
    """No check improved on the closed form (chosen step 0): the weights written are the ones the table measured."""
    import featcal_llm
    import featcal_llm.engine.refine as refine_module

    def kept(job):
        return job.replacements, {"params": "full", "lr": 1.0, "steps_run": 2, "chosen_step": 0, "max_steps": 2, "top_k": 1,
                                  "held_out_kl": {"before": 0.5, "after": 0.5}, "teachers": {},
                                  "per_expert": {"before": {}, "after": {}}}

    monkeypatch.setattr(refine_module, "refine", kept)
    recipe = far_scenario.write_recipe(far_scenario.root / "kept-api.yaml", output=str(far_scenario.root / "kept-api"), refine=REFINE)
    result = featcal_llm.calibrate(recipe, force=True, progress=False)
    table = result.table().splitlines()
    assert result.refined is None and table[0].split()[-2:] == ["KL", "calibrated"]
    assert not any(line.startswith("then refine:") for line in table)
    assert "(drift and KL on each expert's held-out records, which the calibration did not fit)" in table


def test_an_adapter_under_bf16_autocast_is_merged_into_the_float32_weights_unrounded(far_scenario, monkeypatch):
    """Under autocast the adapter's frozen weights are bf16 copies; the written projections are the stored float32
    tensors plus the adapter's float32 update, not bf16-rounded weights in a float32 file."""
    import featcal_llm.engine.refine_student as student_module
    from peft.tuners.lora import LoraLayer

    from featcal_llm.io.checkpoint import checkpoint_tensors

    seen, written = {}, student_module.Student.written

    def capture(student):
        seen["frozen"] = {f"{name}.weight": module.get_base_layer().weight.dtype for name, module in student.model.named_modules()
                          if isinstance(module, LoraLayer)}
        seen["delta"] = {f"{name}.weight": module.get_delta_weight("default").detach().float().clone()
                         for name, module in student.model.named_modules() if isinstance(module, LoraLayer)}
        _, stored = checkpoint_tensors(student.job.merged, student.job.replacements)  # the closed form's tensors as stored
        seen["start"] = {name: stored(name).clone() for name in seen["delta"]}
        return written(student)

    monkeypatch.setattr(student_module.Student, "written", capture)
    output = run(far_scenario, "adapter-autocast", dtype="bfloat16",
                 refine={**REFINE, "params": "adapter", "rank": 4, "lr": 1e-3, "precision": "bfloat16"})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert report["autocast"] == "torch.bfloat16" and report["chosen_step"] > 0
    assert set(seen["frozen"].values()) == {torch.bfloat16}  # what peft's own merge would have added to
    ours = load_file(output / "model.safetensors")
    for name, delta in seen["delta"].items():
        assert ours[name].dtype == seen["start"][name].dtype == torch.float32
        assert torch.allclose(ours[name] - seen["start"][name], delta, atol=1e-7, rtol=0), name
        assert not torch.equal(ours[name].to(torch.bfloat16).float(), ours[name])  # not bf16 values


def test_an_adapter_is_merged_back_in_each_weights_stored_precision():
    """W + scale·B·A is added in at least float32 and written in W's dtype: a float64 checkpoint keeps float64 (a
    float32 sum would round it), a bf16 one gets the bf16 of the float32 sum."""
    from types import SimpleNamespace

    from featcal_llm.engine.refine_student import Student

    generator = torch.Generator().manual_seed(0)
    delta = torch.randn(6, 4, generator=generator) * 1e-3  # the adapter's update, float32 as peft keeps it
    module = SimpleNamespace(get_delta_weight=lambda adapter: delta)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        stored = torch.randn(6, 4, generator=generator, dtype=torch.float64).to(dtype)
        student = object.__new__(Student)
        student.stored = lambda name, stored=stored: stored
        merged = student._merged_back("w", module)
        expected = (stored.to(torch.promote_types(dtype, torch.float32)) + delta).to(dtype)
        assert merged.dtype == dtype and torch.equal(merged, expected), dtype


def test_the_layer_loops_state_is_dropped_before_the_refinement(far_scenario, monkeypatch):
    """The refinement builds whole models: the hidden-state streams (26 GB of host memory at 8B) and the statistics
    buffers (4 GB of the GPU's) of the finished layer loop are let go first; the drift report keeps what it needs."""
    import featcal_llm.pipeline as pipeline

    seen, original = {}, pipeline._refine

    def spy(context, *args):
        probe = context.probe
        seen.update(cal=len(context.cal), expert=len(context.expert), buffers=len(context.workspace._buffers),
                    probe=sum(len(streams) for streams in (probe.cal, probe.expert, probe.merged)), heads=context.heads)
        return original(context, *args)

    monkeypatch.setattr(pipeline, "_refine", spy)
    output = run(far_scenario, "dropped", refine={**REFINE, "steps": 2, "eval_every": 2})
    assert seen == {"cal": 0, "expert": 0, "buffers": 0, "probe": 0, "heads": None}
    assert json.loads((output / "featcal_drift.json").read_text())["output_divergence"]  # the report kept what it needs
