"""The differential test's machinery: the same candidates graded by EvalPlus and by us.

EvalPlus's verdict is what `evalplus evaluate` computes for one sample: its tree-sitter sanitizer,
then `untrusted_check` on the base inputs and on the plus inputs (check_correctness), passing only
if both pass, with EvalPlus 0.3.1's code plus its later find_zero fix (commit 6eb1e19, "record
results before continue"; without it every find_zero program fails). Ours is `evalplus.grade` on the
hub row that EvalPlus's exporter writes (tests/evalplus_export.py) and on the EvalPlus-format row.

    PYTHONPATH=$PWD python tests/evalplus_diff.py    # the agreement table and grading times
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from evalplus_cases import CANDIDATES, DEVIATIONS, PROBLEMS
from evalplus_export import export

MIN_TIME_LIMIT_S, TIME_LIMIT_FACTOR = 2.0, 4.0
FORMATS = ("hub", "release")


def fixed_unsafe_execute():
    """EvalPlus 0.3.1's unsafe_execute with commit 6eb1e19 applied (find_zero records its pass)."""
    import evalplus.eval as module

    source = inspect.getsource(module.unsafe_execute).replace("\r\n", "\n")
    indent = " " * 28
    old = f"assert abs(_poly(*inp, out)) <= atol\n{indent}continue"
    if old not in source:
        raise RuntimeError("evalplus.eval.unsafe_execute is not 0.3.1's: update the find_zero fix")
    fixed = source.replace(old, f"assert abs(_poly(*inp, out)) <= atol\n{indent}details[i] = True\n"
                                f"{indent}progress.value += 1\n{indent}continue")
    namespace = dict(vars(module))
    exec(compile(fixed, module.__file__, "exec", dont_inherit=True), namespace)  # not our __future__ flags
    return namespace["unsafe_execute"]


@contextlib.contextmanager
def evalplus_with_fix():
    import evalplus.eval as module

    original = module.unsafe_execute
    module.unsafe_execute = fixed_unsafe_execute()
    try:
        yield
    finally:
        module.unsafe_execute = original


def evalplus_passes(problem: dict, truth: dict, candidate: str) -> bool:
    from evalplus.eval import PASS, untrusted_check
    from evalplus.sanitize import sanitize

    dataset = "mbpp" if problem["task_id"].startswith("Mbpp/") else "humaneval"
    code = sanitize(candidate, problem["entry_point"])
    for part in ("base", "plus"):
        try:
            status, _ = untrusted_check(dataset, code, problem[f"{part}_input"], problem["entry_point"],
                                        expected=truth[part], atol=problem["atol"], ref_time=truth[f"{part}_time"],
                                        fast_check=True, min_time_limit=MIN_TIME_LIMIT_S,
                                        gt_time_limit_factor=TIME_LIMIT_FACTOR)
        except KeyError:  # the program wrote over EvalPlus's shared-memory status (forge_write_every_fd)
            return False
        if status != PASS:
            return False
    return True


def _rows(problem: dict, hub_row: dict) -> dict[str, dict]:
    from featcal_llm.evaluation import evalplus

    dataset = "mbpp" if problem["task_id"].startswith("Mbpp/") else "humaneval"
    rows = {}
    for name, row in (("hub", hub_row), ("release", {k: v for k, v in problem.items() if k not in ("text", "test_list")})):
        doc = dict(row)
        try:
            doc.update(evalplus._add_fields(doc, dataset))
        except KeyError:  # a grader that reads hub rows only
            continue
        rows[name] = doc
    return rows


def our_passes(doc: dict, candidate: str) -> tuple[bool, float]:
    from featcal_llm.evaluation import evalplus

    started = time.perf_counter()
    verdict = evalplus.grade(candidate, doc)
    return bool(verdict["passed"]), time.perf_counter() - started


def configure_ours(workers: int = 2) -> None:
    from featcal_llm.evaluation import evalplus

    evalplus.configure(allow=True, cap_s=20.0, min_time_limit_s=MIN_TIME_LIMIT_S,
                       time_limit_factor=TIME_LIMIT_FACTOR, workers=workers, memory_mib=4096)


def compare(names: list[str] | None = None, workers: int = 2) -> dict:
    """Every candidate's verdict from EvalPlus and from us on each row format, with grading times."""
    configure_ours(workers)
    names = names or sorted(CANDIDATES)
    exported = {key: export(problem) for key, problem in PROBLEMS.items()}
    rows = {key: _rows(PROBLEMS[key], hub) for key, (hub, _truth) in exported.items()}
    evalplus_verdicts, evalplus_times = {}, []
    with evalplus_with_fix():
        for name in names:
            key, candidate = CANDIDATES[name]
            started = time.perf_counter()
            evalplus_verdicts[name] = evalplus_passes(PROBLEMS[key], exported[key][1], candidate)
            evalplus_times.append(time.perf_counter() - started)
            if not evalplus_verdicts[name] and evalplus_times[-1] > MIN_TIME_LIMIT_S / 2:
                # EvalPlus's limits are wall-clock: a fail that took that long may be the machine's
                # load, not the program; it stands only if it happens again
                evalplus_verdicts[name] = evalplus_passes(PROBLEMS[key], exported[key][1], candidate)
    jobs = [(name, fmt) for name in names for fmt in FORMATS if fmt in rows[CANDIDATES[name][0]]]
    from featcal_llm.evaluation import evalplus

    for key in {CANDIDATES[name][0] for name in names}:  # the canonical runs, once, outside the timings
        for doc in rows[key].values():
            evalplus.reference_run(doc)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: our_passes(rows[CANDIDATES[job[0]][0]][job[1]], CANDIDATES[job[0]][1]), jobs))
    ours = {job: result[0] for job, result in zip(jobs, results)}
    return {"evalplus": evalplus_verdicts, "ours": ours, "our_times": [result[1] for result in results],
            "times_by_format": {fmt: [r[1] for job, r in zip(jobs, results) if job[1] == fmt] for fmt in FORMATS},
            "evalplus_times": evalplus_times, "names": names}


def compare_in_a_process_of_its_own(workers: int = 2) -> dict:
    """compare() in a child process (this file's `--json`): EvalPlus forks each program with every descriptor of its
    parent open, so the forges that write to them all would write into the caller's pipes (pytest-xdist's channel to
    its controller, which then waits for ever)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"  # a file, not stdout: the graded programs print
        child = subprocess.run([sys.executable, __file__, "--json", str(out), "--workers", str(workers)],
                               capture_output=True, text=True)
        if child.returncode != 0:
            raise RuntimeError(f"compare() failed in its process (exit {child.returncode}):\n{child.stderr[-4000:]}")
        result = json.loads(out.read_text())
    result["ours"] = {(name, fmt): passed for name, fmt, passed in result["ours"]}
    return result


def disagreements(result: dict) -> dict[tuple[str, str], tuple[bool, bool]]:
    """(candidate, format) -> (EvalPlus, ours) where the two differ."""
    return {job: (result["evalplus"][job[0]], passed) for job, passed in result["ours"].items()
            if passed != result["evalplus"][job[0]]}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="EvalPlus's verdicts against ours")
    parser.add_argument("--json", type=Path, help="write compare()'s result here instead of printing the table")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    result = compare(workers=args.workers)
    if args.json:
        ours = [[name, fmt, passed] for (name, fmt), passed in result["ours"].items()]  # JSON has no tuple keys
        args.json.write_text(json.dumps({**result, "ours": ours}))
        return
    differ = disagreements(result)
    for fmt in FORMATS:
        jobs = [job for job in result["ours"] if job[1] == fmt]
        if not jobs:
            print(f"{fmt} rows: not graded by this grader")
            continue
        agree = sum(job not in differ for job in jobs)
        deliberate = sum(job in differ and DEVIATIONS.get(job) == result["ours"][job] for job in jobs)
        print(f"{fmt} rows: {agree}/{len(jobs)} verdicts agree with EvalPlus; "
              f"{len(jobs) - agree} differ ({deliberate} of them listed as deliberate)")
    for (name, fmt), (theirs, ours) in sorted(differ.items()):
        print(f"  differs: {name} [{fmt}]: EvalPlus {'pass' if theirs else 'fail'}, ours {'pass' if ours else 'fail'}")
    theirs = result["evalplus_times"]
    for fmt, times in result["times_by_format"].items():
        if times:
            print(f"grading time per program, {fmt} rows: ours mean {sum(times) / len(times):.3f} s, "
                  f"median {statistics.median(times):.3f} s ({len(times)} programs, one at a time, canonical runs excluded)")
    print(f"EvalPlus 0.3.1 on the same programs: mean {sum(theirs) / len(theirs):.3f} s, "
          f"median {statistics.median(theirs):.3f} s")


if __name__ == "__main__":
    main()
