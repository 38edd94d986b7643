"""Whether an output directory can be written, asked before any work (by `validate` and by `run`), without torch."""

from __future__ import annotations

import os
from pathlib import Path


def unwritable(output: Path) -> str | None:
    """Why `output` cannot be created or replaced (None: it can): its nearest existing ancestor decides."""
    ancestor = output.parent.resolve()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{output}: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK):
        return f"{output}: directory is not writable"
    return None


NAME_MAX = 255  # bytes in one name: ext4, XFS, btrfs, APFS and NTFS alike (Linux's NAME_MAX)


TEMPORARY_RECIPE_PREFIX = ".featcal-recipe-"  # a recipe given to the API as a dict, written for the run and removed after


def name_problem(path: Path) -> str | None:
    """Why `path` cannot name a file at all (line breaks: text given for a path; a name past the file system's
    limit, on which Python 3.11's path tests raise), or None."""
    text = str(path)
    if "\n" in text:
        return "a file name with line breaks: recipe text given in place of a path? give the file's path, or the text read by yaml.safe_load (a mapping)"
    longest = max(path.parts or [text], key=lambda part: len(part.encode()))
    if len(longest.encode()) > NAME_MAX:
        return f"a name of {len(longest.encode())} bytes ({longest[:24]}...), past the {NAME_MAX} a file system takes"
    return None


def shown(path: Path) -> str:
    """A path as an error names it: its first line, cut short where it is long."""
    text = str(path).splitlines()[0] if str(path).strip() else str(path)
    return text if len(text) <= 80 and "\n" not in str(path) else text[:60] + "..."


def argument_problem(value: object) -> str | None:
    """Why an output given as an argument (`run RECIPE OUTPUT`, `calibrate(output=...)`) is no path a run can write,
    before any path test: pathlib would raise on a number or a NUL byte, and on a name past the file system's limit."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes):
        return f"expected the output directory as a path (a string or os.PathLike), got {type(value).__name__} {value!r}"
    text = os.fspath(value)
    if not text.strip():
        return f"{text!r} is empty; name the directory the calibrated model is written to"
    if "\0" in text:
        return f"{text!r} holds a NUL character, which no file system takes in a name"
    return name_problem(Path(text))


RECIPE_FILE = "featcal_recipe.yml"  # in every finished run's output: the recipe as it ran (io/saved_recipe.py)

# hidden siblings a run keeps beside its output: its progress, and an old output while --force swaps it out (folders),
# and the lock the run holds (a file: io/output_lock.py)
PARTIAL_SUFFIX = "featcal-partial"
SIBLINGS = {PARTIAL_SUFFIX: "its progress", "featcal-old": "an old output while --force replaces it"}
LOCK_SUFFIX = "featcal-lock"


def intermediate_dir(output: Path, first: str) -> Path:
    """Where a stack's stage 1 writes its merge: a hidden sibling of the output, named after the method."""
    return output.with_name(f".{output.name}.{first}")


def scored_merge(featcal, output: Path) -> Path:
    """What an evaluation scores beside the output: the merged model, or a stack's first stage (engine/stack.py)."""
    return intermediate_dir(output, featcal.method[0]) if featcal.stacked else Path(featcal.merged)


def hidden_sibling(output: Path, suffix: str) -> Path:
    """`.NAME.suffix` beside the output NAME: where a run keeps what belongs to that output."""
    return output.with_name(f".{output.name}.{suffix}")


def partial_dir(output: Path) -> Path:
    """Where a run keeps its progress: a hidden sibling of the output."""
    return hidden_sibling(output, PARTIAL_SUFFIX)


def not_an_output(output: Path) -> str | None:
    """Why `output` cannot be written, or `--force` may not replace it (None: it may, or it does not exist): it
    replaces an earlier featcal-llm output (its `featcal_recipe.yml` says so) or an empty folder, never a file or a
    folder of other things (`run recipe.yaml ~ --force` would have replaced the home folder). A run writes beside its
    output (its progress, then a rename into place), so the output is a folder of its own name, not a dangling link,
    and the hidden folders beside it are folders."""
    if output.name in ("", ".", ".."):
        return f"{output} names no folder of its own: the run writes beside its output and renames it into place; name a new folder"
    problem = in_a_kept_sibling(output)
    if problem is not None:
        return problem
    size, room = len(output.name.encode()), NAME_MAX - len(f"..{PARTIAL_SUFFIX}")  # .NAME.featcal-partial, its longest sibling
    if size > room:
        return (f"{shown(output)}: a name of {size} bytes ({output.name[:24]}...), past the {room} an output's name may "
                f"take: the run keeps .NAME.{PARTIAL_SUFFIX} beside it, in the {NAME_MAX} bytes a file system takes; "
                "name a shorter directory")
    if output.is_symlink() and not output.exists():
        return f"{output} is a link to {os.readlink(output)}, which does not exist; name a folder"
    for suffix, what in SIBLINGS.items():
        sibling = hidden_sibling(output, suffix)
        if (sibling.exists() or sibling.is_symlink()) and (sibling.is_symlink() or not sibling.is_dir()):
            return f"{sibling} is where featcal-llm keeps {what}, but it is not a folder; remove it"
    lock = hidden_sibling(output, LOCK_SUFFIX)
    if lock.is_symlink() or (lock.exists() and not lock.is_file()):
        return f"{lock} is the lock file a run holds while it writes {output.name}, but it is not a file; remove it"
    if not output.exists() or (output.is_dir() and (not any(output.iterdir()) or (output / RECIPE_FILE).is_file())):
        return None
    kind = "a file" if not output.is_dir() else f"a folder that is no featcal-llm output (it has no {RECIPE_FILE})"
    return f"{output} is {kind}: --force replaces only an earlier output; name another directory"


def in_a_kept_sibling(target: Path) -> str | None:
    """Why a folder the run writes may not be `target` (None: it may): it is or lies inside a hidden folder
    `.NAME.featcal-partial` or `.NAME.featcal-old`, which a run of the output NAME empties (when it starts over,
    finishes or swaps its output), deleting what was written there."""
    for path in _spellings(target):
        for folder in (path, *path.parents):
            for suffix, what in SIBLINGS.items():
                if folder.name.startswith(".") and folder.name.endswith(f".{suffix}") and len(folder.name) > len(suffix) + 2:
                    owner = folder.with_name(folder.name[1:-len(suffix) - 1])
                    where = "is" if same(target, folder) else f"lies inside {folder},"
                    return (f"{target} {where} the hidden folder featcal-llm keeps beside the output {owner} ({what}), "
                            "which that output's runs empty; name a folder outside it")
    return None


def overwrites_input(target: Path, inputs: dict[str, Path], merged: Path | None = None, what: str = "output") -> str | None:
    """Why writing `target` would destroy what the run reads (None: it would not): the run replaces its output, and a
    merge it makes, as a whole, so the folder may not be an input (`inputs`: what names it → its path), hold one (a
    link to a model included), or lie inside the merge (`merged`), which mergekit writes again when the recipe's merge
    changes. With `merged` and `output` the same directory, a first run wrote the calibrated model over its merge, and
    the next run calibrated that output again as if it were the merge."""
    if merged is not None and inside(target, merged):
        return f"{target} lies inside featcal.merged {merged}, which a new merge replaces; name a directory outside it"
    if merged is not None:
        from featcal_llm.io.merge import staging_folder

        staging = staging_folder(merged)
        if same(target, staging) or inside(target, staging):
            return (f"{target} is where a merge into featcal.merged {merged} is staged ({staging}, emptied before mergekit "
                    "writes there); name another directory")
    for label, path in inputs.items():
        if same(target, path):
            return f"{target} is also {label}: the run replaces its {what} as a whole; name another directory"
        if inside(path, target):
            return f"{target} holds {label}: the run replaces its {what} as a whole, deleting it; name another directory"
    return None


def same(a: Path, b: Path) -> bool:
    return any(x == y for x, y in zip(_spellings(a), _spellings(b)))


def inside(path: Path, folder: Path) -> bool:
    """Whether `path` lies below `folder`, as written or with links followed."""
    return any(f in p.parents for p, f in zip(_spellings(path), _spellings(folder)))


def _spellings(path: Path) -> tuple[Path, Path]:
    """The path made absolute as written (a link is itself) and with every link followed; `~` is a folder of that
    name, as run reads it (validate refuses such a path: it is rarely what was meant)."""
    return Path(os.path.abspath(path)), path.resolve()
