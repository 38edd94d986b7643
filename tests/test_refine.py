"""`refine:`: the block's errors and the stage end to end on a tiny merge (the top-k KL: test_topk_kl.py; the
precision and memory rules: test_refine_memory.py; which check is kept and when progress is saved: test_refine_rules.py;
resumes: test_refine_resume.py; precisions and the adapter end to end: test_refine_precision.py).

The end-to-end runs share one scenario (tests/refine_scenario.py: two experts, two layers, experts far from the merge so
that the closed form leaves a gap for the gradient steps to close); each run is a few seconds of CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from refine_scenario import REFINE, run
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


def test_patience_counts_checks_in_a_row_the_last_step_is_checked_and_gradients_are_clipped(far_scenario, monkeypatch):
    """Held-out KLs scripted per check (× the closed form's: 1.1, 0.9, 0.95, 0.8, 0.7) over 9 steps checked every 2:
    a worse check, a better one, a worse one, two better; with patience 2 the two worse checks are not in a row, so the
    run goes on to step 9, which is checked although 9 is no multiple of eval_every, and kept. Every step's global
    gradient norm, as AdamW receives it, is at most max_grad_norm (1e-3, far below this merge's unclipped norms)."""
    import featcal_llm.engine.refine as refine_module

    measured, calls = refine_module.heldout_kl, []
    factors = [1.0, 1.1, 0.9, 0.95, 0.8, 0.7]

    def scripted(*args):
        real = measured(*args)
        start = calls[0] if calls else real
        factor = factors[len(calls)]
        calls.append(real)
        return {task: {"sums": [v * factor for v in kl["sums"]], "counts": kl["counts"]} for task, kl in start.items()}

    norms, adamw_step = [], torch.optim.AdamW.step

    def measured_step(self, *args, **kwargs):
        grads = [p.grad.detach().double() for group in self.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(refine_module, "heldout_kl", scripted)
    monkeypatch.setattr(torch.optim.AdamW, "step", measured_step)
    output = run(far_scenario, "patience", refine={**REFINE, "steps": 9, "eval_every": 2, "patience": 2, "max_grad_norm": 1e-3})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert [check["step"] for check in report["history"]] == [0, 2, 4, 6, 8, 9]
    assert report["steps_run"] == 9 and report["chosen_step"] == 9, report
    assert len(norms) == 9 and max(norms) <= 1e-3 * (1 + 1e-6), norms


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
        assert loss == pytest.approx(float(total / count), rel=1e-2)  # the step's training KL, as the history keeps it
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


def test_one_expert_with_every_record_left_out_does_not_skip_the_others(monkeypatch):
    """Expert a trails the merge on each of its records (all left out), b has one to train on: the refinement goes on
    (past the skip, to the vocabulary check that starts it) rather than keep the closed form for both."""
    from types import SimpleNamespace

    import featcal_llm.engine.refine as refine_module

    class Started(Exception):
        pass

    def started(*args):
        raise Started

    monkeypatch.setattr(refine_module, "within_vocabulary", started)
    job = SimpleNamespace(train={"a": [], "b": [[1, 2, 3, 4]]}, replacements={}, spec=None, config=SimpleNamespace(vocab_size=8))
    with pytest.raises(Started):
        refine_module.refine(job)


def test_a_diverged_check_is_written_as_null_in_strict_json(tmp_path):
    """A learning rate that diverges gives NaN KLs; featcal_refine.json holds null there, which every JSON parser reads."""
    from featcal_llm.io.refine_card import append_refinement

    (tmp_path / "README.md").write_text("# card\n\n## Usage\n")
    nan = float("nan")
    refined = {"params": "full", "lr": 1e10, "top_k": 64, "steps_run": 4, "max_steps": 4, "chosen_step": 0, "teachers": {"a": "own expert"},
               "held_out_kl": {"before": 0.5, "after": 0.5}, "autocast": None, "master": "float32",
               "history": [{"step": 2, "train_kl": nan, "held_out_kl": float("inf"), "per_expert": {"a": nan}, "above_closed_form": ["a"]}]}
    append_refinement(tmp_path, refined)

    def refuse(constant):
        raise ValueError(constant)

    written = json.loads((tmp_path / "featcal_refine.json").read_text(), parse_constant=refuse)
    assert written["history"][0] == {"step": 2, "train_kl": None, "held_out_kl": None, "per_expert": {"a": None}, "above_closed_form": ["a"]}


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
