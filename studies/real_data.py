"""Real text found offline on any machine with Python (and glibc headers): three kinds, split into records.

Kinds: ``code`` (the interpreter's own standard library, ``Lib/*.py``), ``prose`` (Python's reference
documentation: the English text of ``pydoc_data.topics``, 79 documents, or, given a folder, every reStructuredText
source under it, e.g. Debian's ``python3.11-doc``, ``/usr/share/doc/python3.11/html/_sources``, 497 documents) and
``c`` (C headers under ``/usr/include``, their licence banner removed). Documents, not records, are assigned to the
splits, so no file's text is in two splits; records are windows of ``record_tokens`` contiguous tokens, decoded back
to text.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

from featcal_llm.errors import FeatCalError

KINDS = ("code", "prose", "c")
DEBIAN_DOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"  # the prose kind's documents (apt-get install python3.11-doc)
_LICENCE = re.compile(r"\A\s*/\*.*?\*/", re.S)  # a header's leading comment, dropped when it is a licence


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SplitSizes:
    """Records per split; test and cal take at most ``per_document`` records from one document (variety), train at
    most ``train_per_document`` (None: all its windows; then a few long files can fill the train split)."""

    train: int
    cal: int
    test: int
    per_document: int = 4
    train_per_document: int | None = None
    val: int = 0  # records that choose hyper-parameters, from files in neither test nor cal (0: no val split)

    def items(self) -> list[tuple[str, int]]:
        val = [("val", self.val)] if self.val else []
        return [("test", self.test), *val, ("cal", self.cal), ("train", self.train)]  # small splits first


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _strip_licence(text: str) -> str:
    head = _LICENCE.match(text)
    return text[head.end():].lstrip("\n") if head and "Copyright" in head.group(0) else text


def documents(kind: str, include: Path = Path("/usr/include"), prose_dir: Path | None = None
              ) -> list[tuple[str, str]]:
    """(name, text) of every document of a kind, sorted by name, so that a seed alone fixes the split."""
    if kind == "code":
        lib = Path(sysconfig.get_paths()["stdlib"])
        return [(p.name, _read(p)) for p in sorted(lib.glob("*.py"))]
    if kind == "prose" and prose_dir is not None:
        paths = sorted(p for p in prose_dir.rglob("*") if p.name.endswith((".rst", ".rst.txt")) and p.is_file())
        if not paths:
            raise FeatCalError(f"{prose_dir}: expected reStructuredText sources (*.rst, *.rst.txt); none found")
        return [(str(p.relative_to(prose_dir)), _read(p)) for p in paths]
    if kind == "prose":
        from pydoc_data.topics import topics
        return sorted(topics.items())
    if kind == "c":
        paths = sorted(set(include.glob("*.h")) | set(include.glob("*/*.h")))
        if not paths:
            raise FeatCalError(f"{include}: expected C headers (*.h); none found")
        return [(str(p.relative_to(include)), _strip_licence(_read(p))) for p in paths]
    raise FeatCalError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping windows of exactly ``size`` tokens; a shorter tail is dropped."""
    return [ids[start:start + size] for start in range(0, len(ids) - size + 1, size)]


def split_records(docs: Iterable[tuple[str, str]], tokenizer: Tokenizer, sizes: SplitSizes, record_tokens: int,
                  seed: int) -> dict[str, list[dict]]:
    """test / cal / train records from documents shuffled by ``seed``; each document feeds one split only.

    Documents are taken in shuffled order; each gives its first windows (up to the split's per-document cap) to
    the first split that still needs records (test, then cal, then train). Refused if the documents run out first.
    """
    order = list(docs)
    random.Random(seed).shuffle(order)
    splits: dict[str, list[dict]] = {name: [] for name, _ in sizes.items()}
    wanted = dict(sizes.items())
    for name, text in order:
        open_splits = [s for s, n in sizes.items() if len(splits[s]) < n]
        if not open_splits:
            break
        split = open_splits[0]
        cap = sizes.train_per_document if split == "train" else sizes.per_document
        for window in windows(tokenizer.encode(text, add_special_tokens=False), record_tokens)[:cap]:
            if len(splits[split]) == wanted[split]:
                break
            splits[split].append({"text": tokenizer.decode(window), "source": name})
    short = [f"{s} {len(splits[s])}/{n}" for s, n in sizes.items() if len(splits[s]) < n]
    if short:
        raise FeatCalError(f"records: not enough text for {', '.join(short)} records of {record_tokens} tokens")
    return splits


def prompt_records(records: list[dict], tokenizer: Tokenizer, prompt_tokens: int) -> list[dict]:
    """The beginning (first ``prompt_tokens`` tokens) of each record, as ``{"prompt": ...}``."""
    return [{"prompt": tokenizer.decode(tokenizer.encode(r["text"], add_special_tokens=False)[:prompt_tokens])}
            for r in records]


def write_jsonl(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def interleave(lists: list[list], total: int | None = None) -> list:
    """One item of each list in turn (a shorter list drops out when it ends), so that any prefix mixes the lists
    evenly: a broad expert's training or calibration records over several kinds. At most `total` items."""
    out = []
    for index in range(max((len(items) for items in lists), default=0)):
        out += [items[index] for items in lists if index < len(items)]
    return out[:total]


def gap_recovered(nll_expert: float, nll_merged: float, nll_calibrated: float) -> float | None:
    """Share of the merge→expert NLL gap closed: (merged − calibrated) / (merged − expert); None without a gap."""
    gap = nll_merged - nll_expert
    return (nll_merged - nll_calibrated) / gap if gap > 0 else None


def recovery(nll: dict[str, dict[str, float]], kinds: Iterable[str], calibrated: str,
             merged: str = "merged") -> dict:
    """Per kind and mean share of the gap recovered by model ``calibrated``; ``nll[model][kind]``."""
    per_kind = {k: gap_recovered(nll[f"expert:{k}"][k], nll[merged][k], nll[calibrated][k]) for k in kinds}
    known = [v for v in per_kind.values() if v is not None]
    return {"per_kind": per_kind, "mean": sum(known) / len(known) if known else None}

