"""The specialised setting's sizes, its rows' recipes and its per-record scorer (``studies.specialised`` runs them).

Kept apart from the CLI so that the distillation and the report import these without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from studies.quality_setup import paper_rule
from studies.real_data import read_jsonl
from studies.specialised_data import KINDS

SETTING = "specialised"
TA_WEIGHT = 0.5
RECORD_TOKENS = 128
SIZES = {"test": 64, "val": 32, "cal": 80, "train": 1024}
CAL_RECORDS = 64  # records per expert FeatCal calibrates on (the first of the cal split)
MIN_LEAD = 0.15  # nats a token, net, on each expert's calibration records: what "specialised" means here
AS_TRAINED = "-bos"
SCORED = {"test": 48, "val": 32}  # records scored per domain (two loaded cores: 48 test records, not the 64 split off)


DATA, GENERATE = "data", "generate"  # a row's data: key: the experts' own samples instead of the cal split
MIXED = "mixed"  # ...or the cal split's records followed by the 256 each expert wrote for the data-free rows (`mix`)
SAMPLES = "samples"  # a row's own featcal.samples (default CAL_RECORDS)

HELD_AT_MERGE = {"lambda": 1e9, "rho": 1.0, "head": False}  # the closed form's update ~0: lambda 1e9 toward an anchor at the merge

ROWS = {  # row name → the featcal: keys set beyond the data and the study's sizes
    "featcal defaults": {},
    "featcal paper rule": paper_rule(),
    "featcal defaults + refine": {"refine": True},
    # each expert's records taught by the expert that predicts them best (the broad setting's lever)
    "featcal teachers best": {"teachers": "best"},
    "featcal teachers best + refine": {"teachers": "best", "refine": True},
    # every expert teaching its own records (the default before `teachers: best`)
    "featcal teachers own": {"teachers": "own"},
    "featcal teachers own + refine": {"teachers": "own", "refine": True},
    "featcal defaults + refine, adapter": {"refine": {"params": "adapter"}},
    "featcal defaults + refine, adapter, float32": {"refine": {"params": "adapter", "precision": "float32"}},
    # the adapter's budget (8B's mode): what 20 and 80 steps give beside the default 40
    "featcal defaults + refine, adapter, 20 steps": {"refine": {"params": "adapter", "steps": 20}},
    "featcal defaults + refine, adapter, 80 steps": {"refine": {"params": "adapter", "steps": 80}},
    "featcal defaults + refine, full": {"refine": {"params": "full"}},
    # the step budget (the held-out records still stop it early; the schedule spans the budget), chosen on the val split
    "featcal defaults + refine, 80 steps": {"refine": {"steps": 80}},
    "featcal defaults + refine, 120 steps": {"refine": {"steps": 120}},
    "featcal defaults + refine, 160 steps": {"refine": {"steps": 160}},  # the budget the distillation's val split chose
    # at that budget, the distillation's split of the records (56 to train, 8 to choose) instead of a quarter held out
    "featcal defaults + refine, 160 steps, an eighth held out": {"refine": {"steps": 160}, "tune": {"holdout": 0.125}},
    # and with the teachers' top 1,024 tokens instead of 64 (the distillation keeps the whole vocabulary)
    "featcal defaults + refine, 160 steps, an eighth held out, top-1024 teachers": {"refine": {"steps": 160, "top_k": 1024},
                                                                                    "tune": {"holdout": 0.125}},
    # the peak learning rate at the default 40 steps, chosen on the val split too
    "featcal defaults + refine, lr 2e-4": {"refine": {"lr": 2e-4}},
    "featcal defaults + refine, lr 3e-4": {"refine": {"lr": 3e-4}},
    # half the records a step for twice the steps: the same records, tokens and held-out checks (every 10 steps), twice
    # the updates; chosen on the val split
    "featcal defaults + refine, 4 records a step, 80 steps": {"refine": {"batch_records": 4, "steps": 80, "eval_every": 10}},
    # `refine: true` again, its held-out quarter drawn as the product draws it now (by the expert's position); beside it, the
    # results keep a row run at commit a3bab8a whose refinement weighed each token's KL as the closed form weighs the token
    # (`refine.token_weights: expert_lead`, removed after that row: 0.99x this one)
    "featcal defaults + refine, held-out drawn by position": {"refine": True},
    # an eighth of the records held out (the distillation's 8 of 64) instead of a quarter: the closed form and the
    # refinement fit 56 records per expert instead of 48, the stopping rule judges 8
    "featcal defaults + refine, an eighth held out": {"refine": True, "tune": {"holdout": 0.125}},
    # refinement from the merge itself (the closed form held there), in full and with the adapter 8B uses: what the
    # closed form's start is worth at refinement's own budget
    "refine from the merge (closed form held at it)": {**HELD_AT_MERGE, "refine": True},
    "refine from the merge (closed form held at it), adapter": {**HELD_AT_MERGE, "refine": {"params": "adapter"}},
    # the memory-matched reference at 8B: an adapter distillation of the merge given the 160 steps (its held-out records
    # still stop it)
    "refine from the merge (closed form held at it), adapter, 160 steps": {**HELD_AT_MERGE, "refine": {"params": "adapter", "steps": 160}},
    # ...and twice that, the 160 steps having improved to their last check: the val split chooses between the two
    "refine from the merge (closed form held at it), adapter, 320 steps": {**HELD_AT_MERGE, "refine": {"params": "adapter", "steps": 320}},
    # the teachers' top 1,024 tokens kept per position instead of 64 (the distillation it ties keeps the whole vocabulary)
    "featcal defaults + refine, top-1024 teachers": {"refine": {"top_k": 1024}},
    # every layer recomputed in the backward, as every refinement was before `gradient_checkpointing: auto` (off on a CPU
    # for this model): the same update, the time it costs
    "featcal defaults + refine, gradient checkpointing": {"refine": {"gradient_checkpointing": True}},
    # another draw of the held-out records and of the training order (featcal.seed): the refinement's own spread
    "featcal defaults + refine, seed 1": {"seed": 1, "refine": True},
    # the broad setting's probes of where a domain's harm comes from (studies/specialised_broad.py)
    "featcal defaults, rho 1": {"rho": 1.0},
    "featcal defaults, no head": {"head": False},
    "featcal defaults, equal weights": {"expert_weights": "equal", "token_weights": "equal"},
    "featcal defaults, trailing records kept": {"trailing_records": "keep"},  # the defaults before trailing_records: drop
    "featcal defaults, lambda 1e-3": {"lambda": 1e-3},
    "featcal defaults, expert weights equal": {"expert_weights": "equal"},
    "featcal defaults, trailing keep": {"trailing_experts": "keep"},
    # data-free: each expert writes its own calibration records (`generate: {}`, its defaults), the same count
    "featcal data-free": {DATA: GENERATE},
    "featcal data-free + refine": {DATA: GENERATE, "refine": True},
    "featcal data-free + refine, adapter": {DATA: GENERATE, "refine": {"params": "adapter"}},
    # data-free users have no records to run out of: each expert writes twice as many
    "featcal data-free, 128 records": {DATA: GENERATE, SAMPLES: 128},
    "featcal data-free, 128 records + refine": {DATA: GENERATE, SAMPLES: 128, "refine": True},
    "featcal data-free, 256 records + refine": {DATA: GENERATE, SAMPLES: 256, "refine": True},  # generate's default count
    # the 64 real records and the 256 each expert wrote, in one file per expert (`python -m studies.specialised mix`)
    "featcal real + generated records + refine": {DATA: MIXED, SAMPLES: CAL_RECORDS + 256, "refine": True},
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name).strip("-")


MIXED_FILE = "cal-and-generated.jsonl"


def write_mixed(work: Path, experts: tuple[str, ...] = KINDS, generated: str = "runs/featcal_generated") -> dict[str, int]:
    """Per expert, data/<name>/cal-and-generated.jsonl: its first CAL_RECORDS real calibration records (as trained, with
    the BOS text), then every record it wrote for the data-free rows, as prompt/completion pairs (a generated record's
    prompt is what it answered, judged as generate: judges it; a real record's prompt is empty). Returns the counts."""
    import json

    counts = {}
    for name in experts:
        real = read_jsonl(work / "data" / name / f"cal{AS_TRAINED}.jsonl")[:CAL_RECORDS]
        written = read_jsonl(work / generated / f"{name}.jsonl")
        rows = [{"prompt": "", "completion": record["text"]} for record in real]
        for record in written:
            prompt = record.get("prompt") or ""
            if not record["text"].startswith(prompt):
                raise ValueError(f"{name}: a generated record's text does not start with its prompt")
            rows.append({"prompt": prompt, "completion": record["text"][len(prompt):]})
        (work / "data" / name / MIXED_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
        counts[name] = len(rows)
    return counts


def _yaml(value) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip().removesuffix("...").strip()  # a scalar ends its document


def recipe_text(keys: dict, output: str, *, samples: int = CAL_RECORDS, device: str = "cpu",
                experts: tuple[str, ...] = KINDS) -> str:
    """mergekit Task Arithmetic (½ each) of `experts` (experts/<name>, calibrated on data/<name>, or on what each writes
    itself where the row's `data` is `generate`) with the row's featcal: block; paths relative to the workdir."""
    lines = ["merge_method: task_arithmetic", "base_model: base", "models:"]
    for name in experts:
        lines += [f"  - model: experts/{name}", f"    parameters: {{weight: {TA_WEIGHT}}}"]
    lines += ["dtype: float32", "featcal:", "  merged: merged/ta", f"  output: {output}", "  data:"]
    sources = {GENERATE: lambda name: "{generate: {}}",
               MIXED: lambda name: f"{{path: data/{name}/{MIXED_FILE}, format: completion}}"}
    source = sources.get(keys.get(DATA), lambda name: f"{{path: data/{name}/cal{AS_TRAINED}.jsonl, format: text}}")
    lines += [f"    experts/{name}: " + source(name) for name in experts]
    lines += [f"  samples: {keys.get(SAMPLES, samples)}", f"  max_length: {RECORD_TOKENS + 1}", f"  device: {device}", "  dtype: float32"]
    lines += [f"  {key}: {_yaml(value)}" for key, value in keys.items() if key not in (DATA, SAMPLES)]
    return "\n".join(lines) + "\n"


SCORE_BF16 = True  # forward passes under bfloat16 autocast (the CPU's bf16 units): ~10× faster than float32 on two
# loaded cores; the weights, logits' softmax and sums stay float32, and every model is scored the same way


def score_model(work: Path, directory: Path, threads: int | None = None, splits: tuple[str, ...] = ("test",)) -> dict:
    """Per split (test; val where a model's val score chooses something) and domain: each record's (summed NLL,
    token count) on the split's first ``SCORED[split]`` records, BOS given, every text token scored."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studies.real_models import encode, record_nlls

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(work / "base")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=SCORE_BF16):
        for split in splits:
            out[split] = {}
            for kind in KINDS:
                texts = [r["text"] for r in read_jsonl(work / "data" / kind / f"{split}.jsonl")][:SCORED[split]]
                out[split][kind] = record_nlls(model, [(ids, 1) for ids in encode(tokenizer, texts)], tokenizer.pad_token_id)
    return out
