"""`refine:`'s precisions and parameters: the adapter merged back as peft computes it and in each weight's stored
precision, bf16 near float32, gradient checkpointing changing the time only, and the memory it frees or names (the
shared runs: refine_scenario.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from refine_scenario import REFINE, run


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
            one_d = [name for name, p in student.module.named_parameters() if p.dim() == 1]
            seen["norms"], seen["frozen_norms"] = one_d, [name for name in one_d if name not in student.trainable]
        return written(student)

    monkeypatch.setattr(refine_module.Student, "written", capture)
    output = run(far_scenario, "adapter", refine={**REFINE, "params": "adapter", "rank": 4, "lr": 1e-3})
    report = json.loads((output / "featcal_refine.json").read_text())
    assert report["params"] == "adapter" and report["rank"] == 4 and report["chosen_step"] > 0
    assert seen["lora"]  # a LoRA was trained, not the whole model
    assert seen["norms"] and not seen["frozen_norms"], seen  # and the norms (biases) in full, as the card says below
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
    assert reports[0]["autocast"] is None and reports[1]["autocast"] == "bfloat16"
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
    assert report["params"] == "adapter" and report["autocast"] is None and report["steps_run"] == 2


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
    assert report["autocast"] == "bfloat16" and report["chosen_step"] > 0
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
