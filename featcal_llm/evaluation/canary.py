"""`featcal-llm eval --check-graders`: does our HumanEval+/MBPP+ grading say what EvalPlus says?

On the real data (the hub datasets, or local copies given with --data), every canonical solution
must pass (EvalPlus's ground truth: 164/164 and 378/378), and a known-wrong solution per problem (its
entry point returning None) must fail, except where EvalPlus's oracle accepts any output (Mbpp/164).
Opt-in: it runs ~1,100 programs.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import evalplus
from featcal_llm.evaluation.oracle import oracle_for

DATASETS = {"humaneval_plus": ("evalplus/humanevalplus", "humaneval"), "mbpp_plus": ("evalplus/mbppplus", "mbpp")}


@dataclass
class CanaryReport:
    task: str
    problems: int = 0
    canonical_passed: int = 0
    wrong_checked: int = 0
    wrong_failed: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def line(self) -> str:
        return (f"{self.task}: canonical solutions pass {self.canonical_passed}/{self.problems}; "
                f"known-wrong solutions fail {self.wrong_failed}/{self.wrong_checked}"
                + ("" if self.ok else f"; {len(self.failures)} problem(s): " + "; ".join(self.failures[:10])))


def load_rows(task: str, data: str | None, revision: str | None = None) -> list[dict]:
    """Rows of a local .jsonl copy, or of the hub dataset (needs network or the datasets cache)."""
    if data is not None:
        path = Path(data)
        if not path.is_file() or path.suffix != ".jsonl":
            raise FeatCalError(f"--data {task}={data}: expected a .jsonl file of the hub rows")
        return local_rows(task, path)
    from datasets import load_dataset

    try:
        return list(load_dataset(DATASETS[task][0], split="test", revision=revision))
    except Exception as error:  # noqa: BLE001 - no network, no cache: say which data is missing
        raise FeatCalError(f"--check-graders: could not load {DATASETS[task][0]} ({type(error).__name__}); "
                           f"pass --data {task}=FILE.jsonl with a local copy") from None


def local_rows(task: str, path: Path) -> list[dict]:
    """A local copy's rows, each a problem as the hub (a `test`) or EvalPlus's release (`base_input`) gives it: a
    canary that read no row, or rows of another dataset, would check nothing and report success."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise FeatCalError(f"--data {task}={path}: line {number} is not JSON ({error})") from None
        missing = [key for key in ("task_id", "entry_point" if task == "humaneval_plus" else "prompt")
                   if not isinstance(row, dict) or key not in row]
        if missing or not ("test" in row or "base_input" in row):
            raise FeatCalError(f"--data {task}={path}: line {number} is not a row of {DATASETS[task][0]} (expected its "
                               f"task_id, {'entry_point' if task == 'humaneval_plus' else 'prompt'} and test)")
        rows.append(row)
    if not rows:
        raise FeatCalError(f"--data {task}={path}: no rows, so no grader would be checked")
    return rows


def _stub(entry_point: str) -> str:
    return f"def {entry_point}(*args, **kwargs):\n    return None\n"


def check_task(task: str, rows: list[dict], workers: int) -> CanaryReport:
    dataset = DATASETS[task][1]
    report = CanaryReport(task, problems=len(rows))
    docs = []
    for row in rows:
        doc = dict(row)
        doc.update(evalplus._add_fields(doc, dataset))
        docs.append(doc)

    def check(doc: dict) -> tuple[str, bool, bool | None, str]:
        reference = evalplus.reference_run(doc)
        entry = doc["evalplus_entry_point"]
        if oracle_for(dataset, entry) == "any_output":
            return str(doc["task_id"]), reference.passed, None, reference.detail
        wrong = evalplus.grade_solution(_stub(entry), doc)
        return str(doc["task_id"]), reference.passed, not wrong.passed, reference.detail

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for task_id, canonical_ok, wrong_failed, detail in pool.map(check, docs):
            report.canonical_passed += canonical_ok
            if not canonical_ok:
                report.failures.append(f"{task_id} canonical solution fails ({detail[:120]})")
            if wrong_failed is not None:
                report.wrong_checked += 1
                report.wrong_failed += wrong_failed
                if not wrong_failed:
                    report.failures.append(f"{task_id} a solution returning None passes")
    return report


def check_graders(data: dict[str, str], workers: int, revisions: dict[str, str | None] | None = None) -> list[CanaryReport]:
    unknown = sorted(set(data) - set(DATASETS))
    if unknown:
        raise FeatCalError(f"--data {unknown[0]}: --check-graders checks {', '.join(DATASETS)} only")
    evalplus.configure(allow=True, workers=workers)
    try:
        return [check_task(task, load_rows(task, data.get(task), (revisions or {}).get(task)), workers)
                for task in DATASETS]
    finally:
        evalplus.configure(allow=False)

