"""`refine:`: a few gradient steps after the closed form, toward each record's teacher, stopped by the held-out records.

The closed form re-fits each layer on its own; refinement then trains the
whole calibrated model at once on the same calibration records, label-free:
each record's teacher is its own expert (the merged model for an expert the
merge teaches, `trailing_experts: merge`), the loss the token mean of
KL(teacher ‖ model) over the tokens each expert is judged on (a response's for
prompt/response records, every token of plain text and generated records).
The teachers' distributions are computed once, one whole expert at a time,
and kept top-k on the host (engine/refine_data.py, maths/topk_kl.py).

The records held out of the statistics choose the step count: the held-out
KL is measured before the first step and every `eval_every` steps; the best
state is kept (the lowest mean over experts among the checks where no
expert's KL is above the closed form's beyond two standard errors over its
held-out records), training stops after `patience`
checks without improvement, and if no check improves on the closed form, its
output stands unchanged.
After a check the trainable state, the optimizer, the schedule, the RNG and
the best state are saved in the staging area, as often as keeps saving near
a twentieth of the stage's time (engine/refine_progress.py): a rerun after a
crash resumes from the last save and writes the same bytes. docs/refine.md has the
keys and the memory model.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.checkpoint import checkpoint

from featcal_llm import runlog
from featcal_llm.errors import warn
from featcal_llm.engine.devices import native_bf16
from featcal_llm.engine.drift import LM_HEAD
from featcal_llm.engine.refine_data import Key, TeacherStore, final_hidden, judged_positions, logit_chunk, micro_batches, teach
from featcal_llm.engine.refine_memory import Shape, autocasts, refine_memory, resolve_checkpointing, resolve_params
from featcal_llm.engine.refine_models import build_causal_lm, logits_of
from featcal_llm.io.checkpoint import checkpoint_tensors
from featcal_llm.engine.refine_progress import (REFINED_FOLDER, ProgressSaver, MissingBest, forget_progress, load_best, rng_state,
                                                saved_progress, set_rng_state)
from featcal_llm.engine.resume import sequences_digest
from featcal_llm.io.names import short_names
from featcal_llm.engine.refine_rules import KEPT_RULE, expert_kls, improves, mean_kl, raised, spread, why_none_kept
from featcal_llm.engine.refine_schedule import lr_factor, record_order
from featcal_llm.engine.refine_student import Student, student_names, student_parameters
from featcal_llm.maths.topk_kl import topk_kl, topk_kl_rows

MICRO_BATCH_TOKENS = 8192  # at most this many padded tokens a forward (4 records of 2048): Llama-3.1-8B in 40 GB (docs/refine.md)
REFINED_FILE = "refined.safetensors"


def device_memory(device: torch.device) -> int:
    """Bytes of memory on the compute device (the GPU's, or the machine's RAM)."""
    import os

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def refine_dtypes(precision: str, compute: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(master dtype of trained weights, autocast dtype or None) for `refine.precision`: float32 masters under bf16
    autocast (never float16: its gradients would need loss scaling), or float32 throughout; a float64 run stays float64
    (the exactness tests)."""
    if compute == torch.float64:
        return torch.float64, None
    if autocasts(precision, native_bf16(device)):
        return torch.float32, torch.bfloat16
    return torch.float32, None


@dataclass
class RefineJob:
    """What the stage needs from the run: the spec, the checkpoints, the closed form's tensors, the records, the device."""

    spec: Any  # io/block_sections.RefineSpec
    seed: int
    batch_tokens: int
    config: Any  # the merged model's config
    merged: Any  # CheckpointReader of the merged model
    teachers: dict[str, Any]  # expert → the reader of its records' teacher (the merge for a trailing expert)
    taught: dict[str, float]  # the experts the merge teaches
    replacements: dict[str, Path]  # the closed form's tensors
    train: dict[str, list[list[int]]]
    held_out: dict[str, list[list[int]]]
    projections: frozenset[str]
    device: torch.device
    compute_dtype: torch.dtype
    staging: Any  # engine/resume.StagingArea
    trust_remote_code: bool = False
    progress: bool = False  # a step bar on the terminal (the log has a line per check either way)
    left_out: dict[str, int] = field(default_factory=dict)  # per expert, records not in `train`: it trails the merge on them
    head_tied_only: bool = False  # a family vLLM serves only tied (Gemma-2): the student's head is its input embedding
    held_out_left_out: dict[str, int] = field(default_factory=dict)  # per expert, held-out records not in `held_out`: as `left_out`
    chosen: dict[str, str] = field(default_factory=dict)  # `teachers: best`: expert → the other expert that teaches its records


def dtype_name(dtype: torch.dtype) -> str:
    """`float32`, as recipes and `featcal_refine.json` spell a dtype (not `torch.float32`)."""
    return str(dtype).removeprefix("torch.")


def checkpointing_for(job: RefineJob, params: str, autocast: bool, records: dict[str, list[list[int]]]) -> bool:
    """refine.gradient_checkpointing resolved by the memory model at the run's shapes (engine/refine_memory), the
    student's head untied where the closed form untied it."""
    shape = Shape.of(job.config, tied=LM_HEAD not in student_names(job))
    length = max((len(row) for rows in records.values() for row in rows), default=1)
    judged = sum(len(judged_positions(row)) for rows in records.values() for row in rows)
    without = refine_memory(shape, params, job.spec.rank, job.batch_tokens, length, job.spec.top_k, judged, job.compute_dtype.itemsize,
                            job.device.type == "cpu", autocast, checkpointing=False, step_records=job.spec.batch_records)
    return resolve_checkpointing(job.spec.gradient_checkpointing, without["peak"], device_memory(job.device))


def heldout_kl(student: Student, store: TeacherStore, keys: dict[str, list[Key]], records, job: RefineJob,
               autocast: torch.dtype | None) -> dict[str, dict[str, list]]:
    """Per expert, per held-out record (in order): KL(teacher ‖ model) summed over its judged tokens, and how many there
    are (`{"sums": [...], "counts": [...]}`): the record is the unit a rise is judged by (refine_rules.raised)."""
    model = student.module
    model.eval()
    chunk = logit_chunk(job.config.vocab_size)
    result = {}
    with torch.no_grad():
        for task, task_keys in keys.items():
            sums, counts = [], []
            for batch in micro_batches(task_keys, records, job.batch_tokens):
                logp, ids, rest = (t.to(job.device) for t in store.batch(batch.keys))  # outside autocast: CPU autocast refuses float16
                with torch.autocast(job.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    hidden = final_hidden(student.model, batch, job.device)  # judged rows, record after record
                    rows_kl = torch.cat([topk_kl_rows(logits_of(student.model, rows), lp, ix, rs)
                                         for rows, lp, ix, rs in zip(hidden.split(chunk), logp.split(chunk), ids.split(chunk), rest.split(chunk))])
                judged = batch.judged.sum(dim=1).tolist()
                sums += [float(part.sum()) for part in rows_kl.split(judged)]
                counts += judged
            result[task] = {"sums": sums, "counts": counts}
    model.train()
    return result


def _chunk_kl(model: torch.nn.Module, rows, logp, ids, rest) -> torch.Tensor:
    return topk_kl(logits_of(model, rows), logp, ids, None, rest)


def train_step(student: Student, store: TeacherStore, keys: list[Key], records, job: RefineJob, autocast) -> float:
    """One optimizer step's gradient (not the update): the token mean of the KL over the step's records, micro-batched."""
    count = sum(len(judged_positions(records[task][index])) for task, index in keys)
    if count == 0:
        return 0.0
    chunk = logit_chunk(job.config.vocab_size)
    total = 0.0
    for batch in micro_batches(keys, records, job.batch_tokens):
        logp, ids, rest = (t.to(job.device) for t in store.batch(batch.keys))
        with torch.autocast(job.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            hidden = final_hidden(student.model, batch, job.device)
            loss = hidden.new_zeros((), dtype=torch.float32)
            for rows, lp, ix, rs in zip(hidden.split(chunk), logp.split(chunk), ids.split(chunk), rest.split(chunk)):
                # checkpointed, the (tokens × vocab) logits are recomputed in the backward pass, never kept for the whole batch
                loss = loss + (checkpoint(_chunk_kl, student.model, rows, lp, ix, rs, use_reentrant=False) if student.checkpointing
                               else _chunk_kl(student.model, rows, lp, ix, rs))
        (loss / count).backward()
        total += float(loss.detach())
    return total / count


def _teachers(job: RefineJob, keys: dict[str, list[Key]], records, autocast, dtype: torch.dtype, covered: str) -> TeacherStore:
    """Each expert's records through their teacher, one whole model on the device at a time, in the precision the student
    computes in (bf16 autocast where it trains under it: a CPU's teachers as a GPU's, whose weights are bf16; without
    it, weights in `dtype`, the student's master dtype, not bf16 layers' dtype); kept in the staging area with the digest
    of the records they cover (`covered`): a store is keyed by each record's place, so one saved for other records (held-
    out records left out otherwise) is computed again, never read for the wrong record."""
    saved = job.staging.load_pass("refine-teachers")
    if (saved is not None and saved.get("top_k") == job.spec.top_k and saved.get("autocast") == str(autocast)
            and saved.get("dtype") == str(dtype) and saved.get("records") == covered):
        runlog.stage("refine: the teachers' distributions reused from the saved progress")
        return TeacherStore.from_dict(saved)
    store = TeacherStore(job.spec.top_k, {}, {}, {})
    started = time.perf_counter()
    for task, task_keys in keys.items():
        reader = job.teachers[task]
        names, get = checkpoint_tensors(reader)
        model = build_causal_lm(job.config, names, get, job.device, dtype, reader.what, job.trust_remote_code)
        teach(store, model, task_keys, records, job.batch_tokens, job.device, autocast)
        del model
        if job.device.type == "cuda":
            torch.cuda.empty_cache()
    job.staging.save_pass("refine-teachers", {**store.as_dict(), "autocast": str(autocast), "dtype": str(dtype), "records": covered})
    runlog.stage(f"refine: the teachers' top-{job.spec.top_k} next-token distributions in {time.perf_counter() - started:.0f} s "
                 f"({store.nbytes() / 2**20:.1f} MiB on the host)")
    return store


def within_vocabulary(spec, vocab: int | None):
    """The spec with `top_k` at most the vocabulary: a teacher has no more tokens to keep, so the log, the card and
    featcal_refine.json name the top-k that ran (the KL is exact either way)."""
    if not vocab or spec.top_k <= vocab:
        return spec
    runlog.stage(f"refine: top_k {spec.top_k} is more than the vocabulary's {vocab} tokens: every token is kept, "
                 f"top_k {vocab}")
    return spec.model_copy(update={"top_k": vocab})


def refine(job: RefineJob) -> tuple[dict[str, Path], dict[str, Any]]:
    """Refine the calibrated model; returns the replacements to write (the closed form's, with the refined tensors in
    place where a check improved on it) and what ran, for the card."""
    if not any(job.train.values()):  # every record left out: its expert trails the merge on it
        runlog.stage("refine: skipped, as no calibration record is left to train on; the closed form's output stands")
        return job.replacements, None
    spec = job.spec = within_vocabulary(job.spec, job.config.vocab_size)
    job.batch_tokens = min(job.batch_tokens, MICRO_BATCH_TOKENS)  # micro-batches: the step's loss and gradient are the same
    parameters = student_parameters(job, student_names(job))
    params = resolve_params(spec.params, parameters, device_memory(job.device))
    lr = spec.learning_rate(params)
    master, autocast = refine_dtypes(spec.precision, job.compute_dtype, job.device)
    records = {task: list(job.train[task]) + list(job.held_out.get(task, [])) for task in job.train}
    checkpointing = checkpointing_for(job, params, autocast is not None, records)
    train_keys = [(task, i) for task in job.train for i in range(len(job.train[task]))]
    # an expert whose held-out records are all left out (it trails the merge on each) has none to check: no KL of 0 for it
    held_keys = {task: [(task, len(job.train[task]) + i) for i in range(len(job.held_out[task]))] for task in job.train
                 if job.held_out.get(task)}
    teacher_keys = {task: [k for k in train_keys if k[0] == task] + held_keys.get(task, []) for task in job.train}
    names = short_names(list(job.train))
    covered = sequences_digest({task: [records[k[0]][k[1]] for k in keys] for task, keys in teacher_keys.items()})
    settings = {**spec.model_dump(mode="json"), "params": params, "lr": lr, "master": str(master), "autocast": str(autocast),
                "gradient_checkpointing": checkpointing, "kept": KEPT_RULE,  # progress saved under another rule starts over
                "records": covered}  # or for other records (each is known by its place)
    left_out, held_left_out = sum(job.left_out.values()), sum(job.held_out_left_out.values())
    precision = f"bf16 autocast, {dtype_name(master)} masters" if autocast is not None else dtype_name(master)
    runlog.stage(f"refine: {params} parameters, lr {lr:g}, {precision}, gradient checkpointing {'on' if checkpointing else 'off'}, "
                 f"at most {spec.steps} steps of {spec.batch_records} records, KL(teacher ‖ model) over each teacher's "
                 f"top-{spec.top_k} tokens on {len(train_keys)} records"
                 + (f" ({left_out} left out, as the closed form weighs them 0: their expert trails the merge on them)" if left_out else "")
                 + f", stopped by {sum(len(v) for v in held_keys.values())} held-out ones"
                 + (f" ({held_left_out} left out alike)" if held_left_out else ""))
    unchecked = [names[task] for task in job.train if job.held_out_left_out.get(task) and task not in held_keys]
    if unchecked:
        one = len(unchecked) == 1
        warn(f"refine: {', '.join(unchecked)} {'trails' if one else 'trail'} the merge on every one of {'its' if one else 'their'} "
             f"held-out records (trailing_records: drop), so no check measures {'it' if one else 'them'}: the stopping rule "
             "reads the other experts' held-out records alone; a larger tune.holdout or more samples give it some")
    if 0 < len(train_keys) < spec.batch_records:
        warn(f"featcal.refine.batch_records: {spec.batch_records} is more than the {len(train_keys)} training records, so "
             f"every step repeats records (each one about {spec.batch_records / len(train_keys):.1f} times); a step "
             f"costs that many more forwards for about the same gradient as one of {len(train_keys)}")
    store = _teachers(job, teacher_keys, records, autocast, job.compute_dtype if autocast is not None else master, covered)
    torch.manual_seed(job.seed)
    student = Student(job, params, master, checkpointing, autocast)
    trainable = list(student.trainable.values())
    # fused: one kernel over every parameter (a 135M model's step 0.3 s on two CPU cores, against 2.4 s for the default
    # per-tensor loop); CPUs and CUDA have it
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=job.device.type in ("cpu", "cuda") or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, spec.steps, spec.warmup))
    order = record_order(train_keys, spec.steps, spec.batch_records, job.seed)
    saved = saved_progress(job.staging, settings)
    if saved is not None:
        try:
            best = load_best(job.staging, saved["best_step"])
        except MissingBest as missing:  # a rerun cannot bring it back: start the refinement over, from the same layers
            warn(f"refine: {missing}; the refinement starts over (the calibrated layers and the teachers are kept)")
            forget_progress(job.staging)
            saved = None
    if saved is not None:
        student.load(saved["current"])
        saved["best"] = best
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"], job.device)
        progress = {key: saved[key] for key in ("step", "best", "best_step", "best_kl", "bad", "history", "done", "before")}
        runlog.stage(f"refine: resuming after step {progress['step']} from the saved progress")
    else:
        before = heldout_kl(student, store, held_keys, records, job, autocast)
        progress = {"step": 0, "best": None, "best_step": 0, "best_kl": mean_kl(before), "bad": 0, "done": False,
                    "history": [{"step": 0, "held_out_kl": mean_kl(before), "per_expert": expert_kls(before)}], "before": before}
    saver = ProgressSaver(job.staging, best_on_disk=progress["best_step"])
    checks = 0
    started = time.perf_counter()
    student.module.train()
    bar = _step_bar(spec.steps, progress["step"], job.progress)
    window = []  # the training KLs since the last check (progress is saved only at checks, so a resume loses none)
    while not progress["done"] and progress["step"] < spec.steps:
        step = progress["step"]
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(student, store, order[step], records, job, autocast)
        if step == 0:  # measured before the first update: the closed form's training KL on the first step's records
            progress["history"][0]["train_kl"] = loss
        window.append(loss)
        torch.nn.utils.clip_grad_norm_(trainable, spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        progress["step"] = step = step + 1
        bar.update(1)
        _note(bar, loss, progress["best_kl"])
        if step % spec.eval_every and step != spec.steps:
            continue
        check = heldout_kl(student, store, held_keys, records, job, autocast)
        value, per_expert = mean_kl(check), expert_kls(check)
        above = raised(check, progress["before"])
        progress["history"].append({"step": step, "train_kl": sum(window) / len(window), "train_kl_sd": spread(window),
                                    "held_out_kl": value, "per_expert": per_expert, "above_closed_form": above})
        window = []
        checks += 1
        if improves(value, above, progress["best_kl"]):
            progress.update(best=student.state(), best_step=step, best_kl=value, bad=0)
        else:
            progress["bad"] += 1
        progress["done"] = progress["bad"] >= spec.patience or step == spec.steps
        runlog.stage(f"refine: step {step}: held-out KL {value:.4g} (" + ", ".join(f"{names[t]} {v:.4g}" for t, v in per_expert.items())
                     + (f"; above the closed form's beyond two standard errors for {', '.join(names[t] for t in above)}, so not kept" if above else "")
                     + f"); best {progress['best_kl']:.4g} at step {progress['best_step']}")
        _note(bar, loss, progress["best_kl"])  # the best as this check left it
        kept = saver.after_check(progress, lambda: {"settings": settings, "current": student.state(), "rng": rng_state(job.device),
                                                      "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})
        after_check(step, kept)
    bar.close()
    report = {"params": params, "lr": lr, "master": dtype_name(master), "autocast": dtype_name(autocast) if autocast else None,
              "tied_head": student.tied,
              "gradient_checkpointing": checkpointing, "steps_run": progress["step"], "chosen_step": progress["best_step"],
              "held_out_kl": {"before": progress["history"][0]["held_out_kl"], "after": progress["best_kl"]},
              "per_expert": {"before": expert_kls(progress["before"]), "after": next(h["per_expert"] for h in progress["history"] if h["step"] == progress["best_step"])},
              "teachers": {task: ("merged model" if task in job.taught else "another expert" if task in job.chosen
                                  else "own expert") for task in job.train},
              "top_k": spec.top_k, "max_steps": spec.steps, "eval_every": spec.eval_every, "patience": spec.patience,
              "history": progress["history"],
              "records": {task: len(job.train[task]) for task in job.train}, "records_left_out": dict(job.left_out),
              "held_out_records": {task: len(job.held_out.get(task, [])) + job.held_out_left_out.get(task, 0) for task in job.train}}
    if job.chosen:  # `teachers: best` handed records over; only then, so `own` runs write the bytes they wrote before
        report["taught_by"] = {task: job.chosen[task] for task in job.train if task in job.chosen}
    if held_left_out:  # only then: a run that leaves none out writes the bytes it wrote before
        report["held_out_left_out"] = {task: job.held_out_left_out.get(task, 0) for task in job.train}
    # no wall times in the report, which the output holds (a resumed run writes the same bytes): the log line says them
    if params == "adapter":
        report["rank"] = spec.rank
    saves_line = (f"{time.perf_counter() - started:.0f} s in all; progress saved at {saver.saves} of {checks} checks "
                  f"({saver.seconds:.0f} s)")
    if progress["best"] is None:
        runlog.stage(f"refine: no check lowered the held-out KL ({report['held_out_kl']['before']:.4g}) without raising an expert's "
                     f"above the closed form's beyond two standard errors, so the closed form's output stands unchanged; "
                     f"{why_none_kept(_named(progress['history'], names), lr)}; {saves_line}")
        return job.replacements, report
    student.load(progress["best"])
    tensors = student.written()
    folder = job.staging.root / REFINED_FOLDER
    folder.mkdir(exist_ok=True)
    path = folder / REFINED_FILE
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, path)  # each in its stored dtype
    runlog.stage(f"refine: held-out KL {report['held_out_kl']['before']:.4g} → {progress['best_kl']:.4g} at step "
                 f"{progress['best_step']} of {progress['step']} run; {len(tensors)} tensors refined; {saves_line}")
    return {**job.replacements, **{name: path for name in tensors}}, report


def _named(history: list[dict], names: dict[str, str]) -> list[dict]:
    """The checks with their raised experts by the short names the log uses."""
    return [{**check, "per_expert": {names[task]: value for task, value in check.get("per_expert", {}).items()},
             "above_closed_form": [names[task] for task in check.get("above_closed_form", [])]} for check in history]


def _note(bar, loss: float, best_kl: float) -> None:
    bar.set_postfix_str(f"train KL {loss:.4g}, best held-out {best_kl:.4g}")


def _step_bar(steps: int, done: int, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=done, desc="refine", unit="step", file=sys.stderr, disable=not show, dynamic_ncols=True)


def after_check(step: int, saved: bool) -> None:
    """Called after each held-out check, `saved` when its progress was saved (a test interrupts a run here)."""


__all__ = ["RefineJob", "after_check", "lr_factor", "record_order", "refine", "resolve_params"]
