"""The demo's synthetic tasks and its generic pre-training text.

Each task turns a seeded random generator into ``(prompt, answer)`` pairs whose
prompt format alone identifies the task, so one merged model can serve all of
them.  ``make_splits`` draws unique prompts and deals them into disjoint
train / cal / dev / test splits; nothing in a held-out split is ever trained on.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    example: Callable[[random.Random], tuple[str, str]]


def _addends(rng: random.Random) -> tuple[int, int]:
    """Two numbers below 100 whose digit-wise sums never carry (3025 pairs)."""
    tens_a, ones_a = rng.randrange(10), rng.randrange(10)
    tens_b, ones_b = rng.randrange(10 - tens_a), rng.randrange(10 - ones_a)
    return 10 * tens_a + ones_a, 10 * tens_b + ones_b


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = _addends(rng)
    return f"{a}+{b}=", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 7)))
    return f"rev:{word}=", word[::-1]


def _pattern(rng: random.Random) -> tuple[str, str]:
    unit = "".join(rng.sample(LETTERS, rng.randint(2, 4)))
    shown = rng.randint(len(unit) + 2, 2 * len(unit) + 3)
    stream = unit * 8
    return f"pat:{stream[:shown]}=", stream[shown : shown + 4]


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("arithmetic", "two-digit addition without carries, `12+35=47`", _arithmetic),
        Task("reverse", "reverse a word, `rev:abc=cba`", _reverse),
        Task("pattern", "continue a periodic pattern by 4, `pat:abcab=cabc`", _pattern),
    )
}

SPLITS = ("train", "cal", "dev", "test")


def make_splits(task: Task, sizes: dict[str, int], seed: int) -> dict[str, list[dict]]:
    """Disjoint splits of unique prompts: held-out splits first, training gets the rest drawn."""
    rng = random.Random(f"{seed}:{task.name}")
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {}
    for split in ("test", "dev", "cal", "train"):
        records: list[dict] = []
        misses = 0
        while len(records) < sizes[split]:
            prompt, answer = task.example(rng)
            if prompt in seen:
                misses += 1
                if misses > 100 * sizes[split] + 10_000:
                    raise RuntimeError(f"task {task.name} has too few distinct prompts for {sizes}")
                continue
            seen.add(prompt)
            records.append({"prompt": prompt, "answer": answer, "text": prompt + answer})
        splits[split] = records
    return {split: splits[split] for split in SPLITS}


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def prose(task: str, record: dict) -> str:
    """A record retold as a sentence of generic text, never in the task's prompt format."""
    body = record["prompt"][:-1]
    if task == "arithmetic":
        a, b = body.split("+")
        return f"The sum of {a} and {b} is {record['answer']}."
    if task == "reverse":
        return f"Backwards, {body.removeprefix('rev:')} reads {record['answer']}."
    return f"The sequence {body.removeprefix('pat:')} goes on {record['answer']}."


def pretraining_corpus(allowed: str, train: dict[str, list[dict]], seed: int, skill_fraction: float = 0.5) -> str:
    """Prose paragraphs interleaved with skill sentences, about ``skill_fraction`` of the characters.

    Like a web corpus that happens to contain sums, word games and sequences, this
    gives the base latent skills; the experts then learn their task's prompt format.
    The sentences retell records of the *train* splits only, so no calibration, dev
    or test item is ever seen in any form during training.
    """
    rng = random.Random(f"{seed}:corpus")
    tasks = sorted(train)
    paragraphs = generic_text(allowed).split("\n")
    pieces: list[str] = []
    skill_chars = prose_chars = 0
    for line in paragraphs:
        pieces.append(line)
        prose_chars += len(line)
        while skill_chars < prose_chars * skill_fraction / (1 - skill_fraction):
            task = rng.choice(tasks)
            sentence = prose(task, rng.choice(train[task]))
            pieces.append(sentence)
            skill_chars += len(sentence)
    return "\n".join(pieces)


def generic_text(allowed: str) -> str:
    """Generic English prose shipped with every CPython: the reference manual's help topics.

    Characters outside ``allowed`` are dropped, runs of blank space are folded.
    """
    import re
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    text = "".join(ch for ch in text if ch in allowed)
    return re.sub(r"[ \t]+", " ", re.sub(r"\n{2,}", "\n", text))
