"""`refine:` probed as a user reads it: what the saved recipe, the log, the card and `featcal_refine.json` say ran
against what ran (each test one finding; the stage end to end: test_refine.py)."""

from __future__ import annotations

import yaml
from refine_scenario import REFINE, run


def test_a_float64_runs_saved_recipe_does_not_say_its_refinement_ran_in_float32():
    """`dtype: float64` refines in float64 whatever `precision` says (engine/refine.refine_dtypes): the report's master
    is float64, the card says "in float64 throughout". The saved recipe ("the recipe as run") pinned `precision:
    float32` there, a precision that did not run; `precision` has no effect on a float64 run, so nothing is pinned."""
    from featcal_llm.io.saved_recipe import with_refine_pinned

    text = yaml.safe_dump({"featcal": {"output": "o", "dtype": "float64", "refine": {"steps": 5}}}, sort_keys=False)
    report = {"params": "full", "autocast": None, "master": "float64"}
    pinned = yaml.safe_load(with_refine_pinned(text, report))["featcal"]["refine"]
    assert pinned.get("precision", "auto") == "auto", pinned
    assert pinned["params"] == "full"  # the memory's choice is still pinned


def test_the_teachers_run_in_the_students_precision_over_half_precision_layers(far_scenario, monkeypatch):
    """docs/refine.md: "The teachers' pass runs in the same precision as the student". Layers in bf16 (a GPU's default,
    or a bf16 checkpoint on a CPU with native bf16) and `precision: float32`: the student is float32 throughout, so
    its teachers' top-k log-probabilities are computed in float32 too, not from bf16 logits."""
    import torch

    import featcal_llm.engine.refine as refine_module

    teachers, student = [], []
    teach, Student = refine_module.teach, refine_module.Student

    def spy_teach(store, model, *args):
        teachers.append({p.dtype for p in model.parameters()})
        return teach(store, model, *args)

    def spy_student(*args, **kwargs):
        built = Student(*args, **kwargs)
        student.append({p.dtype for p in built.model.parameters()})
        return built

    monkeypatch.setattr(refine_module, "teach", spy_teach)
    monkeypatch.setattr(refine_module, "Student", spy_student)
    output = run(far_scenario, "teachers-bf16-layers", dtype="bfloat16",
                 refine={**REFINE, "steps": 2, "eval_every": 2})  # REFINE: precision float32
    assert student == [{torch.float32}] and len(teachers) == 2
    assert all(dtypes == {torch.float32} for dtypes in teachers), teachers
    assert (output / "featcal_refine.json").exists()
