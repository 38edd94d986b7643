"""The specialised setting's text: three kinds of real text found on a Debian machine that share little.

Kinds (none of them code, Python prose or C, the all-gap settings' kinds):

- ``manpage``: English manual pages in their roff source (``/usr/share/man/man?/*.gz``; markup-dense, terse);
- ``changelog``: Debian package changelogs (``/usr/share/doc/*/changelog.Debian.gz``; versions, bug numbers,
  maintainers' names and dates in a fixed layout);
- ``copyright``: Debian copyright files (``/usr/share/doc/*/copyright``; machine-readable headers, holders'
  names and licence text).

Documents, never records, are assigned to the splits (test, val, cal, train, in that order; see
:func:`split_documents`), so no file's text is in two splits: the test and val text comes from files no expert
was trained on and FeatCal never calibrated on.
"""

from __future__ import annotations

import gzip
from pathlib import Path

from featcal_llm.errors import FeatCalError
from studies.real_data import SplitSizes, Tokenizer, split_records

KINDS = ("manpage", "changelog", "copyright")
SPLITS = ("test", "val", "cal", "train")  # small splits first: each takes whole documents


def _text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def _unique_files(paths) -> list[Path]:
    """Regular files, each real file once (``/usr/share/doc/<pkg>`` is often a link to another package's)."""
    seen, out = set(), []
    for path in sorted(paths):
        real = path.resolve()
        if real.is_file() and real not in seen:
            seen.add(real)
            out.append(path)
    return out


def documents(kind: str, root: Path = Path("/usr/share")) -> list[tuple[str, str]]:
    """(name, text) of every document of a kind, sorted by name, so that a seed alone fixes the split."""
    if kind == "manpage":
        paths = _unique_files(root.glob("man/man[1-8]/*.gz"))
        docs = [(str(p.relative_to(root)), _text(p)) for p in paths]
        docs = [(n, t) for n, t in docs if not t.startswith(".so ")]  # one-line redirects to another page
    elif kind == "changelog":
        docs = [(str(p.relative_to(root)), _text(p)) for p in _unique_files(root.glob("doc/*/changelog.Debian.gz"))]
    elif kind == "copyright":
        docs = [(str(p.relative_to(root)), _text(p)) for p in _unique_files(root.glob("doc/*/copyright"))]
    else:
        raise FeatCalError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not docs:
        raise FeatCalError(f"{root}: no {kind} documents found")
    return docs


def split_documents(docs: list[tuple[str, str]], tokenizer: Tokenizer, sizes: dict[str, int], record_tokens: int,
                    seed: int) -> dict[str, list[dict]]:
    """Records of ``record_tokens`` tokens per split (``SPLITS``), each document feeding one split only
    (``real_data.split_records``: at most 4 windows of a test/val/cal document, 16 of a train one)."""
    return split_records(docs, tokenizer, SplitSizes(train=sizes["train"], cal=sizes["cal"], test=sizes["test"],
                                                     val=sizes["val"], train_per_document=16), record_tokens, seed)
