"""Every knob of the demo scenario in one frozen dataclass, hashed for the workdir cache.

``FULL`` is the scenario the README reports; ``QUICK`` is the seconds-long variant
the test suite runs end to end.  The featcal and merge settings of ``FULL`` were
chosen on the dev split (see ``docs/studies/demo-sweeps.md``), never on test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    tasks: tuple[str, ...] = ("arithmetic", "reverse", "pattern")
    # split sizes per task (unique prompts, disjoint across splits)
    train_size: int = 2300
    cal_size: int = 256
    dev_size: int = 200
    test_size: int = 200
    # tiny Llama: GQA 4 query heads / 2 key-value heads
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # generic pre-training of the base
    pretrain_steps: int = 1200
    pretrain_batch: int = 32
    pretrain_seq_len: int = 64
    pretrain_lr: float = 3e-3
    skill_fraction: float = 0.75
    # full fine-tuning of each expert until its greedy exact match on its dev split reaches
    # expert_target (%), checked every check_every steps; finetune_max_steps caps it (and spans
    # the learning-rate schedule). An expert that misses the target stops the demo (None: no check).
    finetune_max_steps: int = 1200
    finetune_batch: int = 64
    finetune_lr: float = 2e-4
    expert_target: float | None = 95.0
    check_every: int = 50
    # Task Arithmetic weight of every expert, then the featcal block of the recipe
    ta_weight: float = 0.5
    samples: int = 256
    max_length: int = 64
    lam: float = 1e-3
    alpha: float = 0.3
    rho: float = 1.0
    eps: float = 1e-8
    # True: lambda, alpha and rho are `auto` (chosen by the run on held-out cal records, featcal_llm/engine/tuning.py)
    auto: bool = False
    # also run RegMean and RegMean++ (on a linear merge) with this off-diagonal reduction, and score them (demo/baselines.py)
    baselines: bool = True
    reduction: float = 0.5
    # a warning when an expert is below this on its own test split (None: not checked)
    expert_bar: float | None = 90.0

    def replace(self, **changes) -> "DemoConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def key(self, *names: str) -> str:
        """A short hash of the named fields (all fields if none are named)."""
        values = self.as_dict()
        chosen = {name: values[name] for name in (names or sorted(values))}
        return digest(chosen)


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


FULL = DemoConfig()

QUICK = DemoConfig(
    train_size=600,
    cal_size=16,
    dev_size=16,
    test_size=24,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    pretrain_steps=10,
    pretrain_batch=8,
    pretrain_seq_len=32,
    finetune_max_steps=12,
    finetune_batch=16,
    expert_target=None,
    check_every=6,
    ta_weight=0.5,
    samples=16,
    expert_bar=None,
    baselines=False,
)
