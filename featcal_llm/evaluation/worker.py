"""The per-model worker: `python -m featcal_llm.evaluation.worker JOB.json`.

One process per model, because vLLM does not give GPU memory back between models. The worker
builds every pending task first (datasets, IFEval/code preflight) so that data problems show up
before a model is loaded, then loads the model once and runs the tasks one by one through
lm-eval's `simple_evaluate`, writing each finished task to the cache before starting the next:
a crash loses at most the task in flight.

Exit codes: 0 done; 3 a user error, whose one-line message is in the job's `error_file`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError

USER_ERROR_EXIT = 3
PUNKT_INSTRUCTIONS = {"length_constraints:number_sentences", "change_case:capital_word_frequency"}


def block_nltk_downloads() -> None:
    """lm-eval's IFEval module calls nltk.download('punkt_tab') at import; offline that hangs or
    fails noisily. Nothing is downloaded at evaluation time: the preflight below reports instead."""
    import nltk

    def refuse(*_args, **_kwargs) -> bool:
        return False

    nltk.download = refuse


def quiet_git_hash() -> str | None:
    """lm-eval's `get_git_commit_hash`, without git's "fatal: not a git repository" on stderr: it asks git in the
    current folder for every task, and an installed featcal-llm runs from folders that are no repository."""
    import subprocess

    try:
        found = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except OSError:  # no git: lm-eval's own fallback reads the hash from a .git folder
        from lm_eval.loggers.utils import get_commit_from_path

        return get_commit_from_path(os.getcwd())
    return (found.stdout.strip() or None) if found.returncode == 0 else None


def punkt_available(directory: str | None = None) -> bool:
    """NLTK's punkt_tab in `directory` (--nltk-data, eval.nltk_data) or where NLTK looks (NLTK_DATA, its defaults)."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/", paths=[directory, *nltk.data.path] if directory else None)
    except LookupError:
        return False
    return True


def missing_punkt(task_id: str, needs: list[str], given: str | None = None) -> str:
    """The refusal, naming the directory given (`given`: eval's --nltk-data or the recipe's featcal.eval.nltk_data)
    when punkt_tab is not in it, and else both ways to give one."""
    where = f"not in {given}" if given else "not installed"
    how = ("copy it into that directory" if given else
           "copy DIR here and name it with eval's --nltk-data DIR or the recipe's featcal.eval.nltk_data (or set NLTK_DATA)")
    return (f"{task_id}: IFEval needs NLTK's punkt_tab data (for {', '.join(needs)}) and it is {where}; on a machine "
            f"with internet run `python -m nltk.downloader -d DIR punkt_tab`, then {how}")


def preflight_ifeval(task_id: str, task) -> None:
    """Two IFEval checkers (sentence counts, capital-word counts) need NLTK's punkt_tab; fail
    before the model loads rather than after hours of generation."""
    needs = sorted({i for doc in task.eval_docs for i in doc.get("instruction_id_list", []) if i in PUNKT_INSTRUCTIONS})
    if needs and not punkt_available():
        raise FeatCalError(missing_punkt(task_id, needs, os.environ.get("NLTK_DATA")))


def punkt_refusal(task_id: str, data: str | None, nltk_data: str | None) -> str | None:
    """preflight_ifeval's refusal, before the run: the hub's IFEval set uses both checkers; a local JSON-lines copy is
    read for its instructions (other formats are left to the preflight)."""
    if data is None:
        needs = sorted(PUNKT_INSTRUCTIONS)
    elif Path(data).suffix == ".jsonl" and Path(data).is_file():
        needs = set()
        for line in Path(data).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line) if line.strip() else {}
            except ValueError:
                return None  # the data's own check names it
            ids = record.get("instruction_id_list") if isinstance(record, dict) else None
            needs.update(i for i in ids or [] if i in PUNKT_INSTRUCTIONS)
        needs = sorted(needs)
    else:
        return None
    try:
        available = punkt_available(nltk_data)
    except ImportError:
        return None  # lm-eval without its ifeval extra: the worker says so
    return missing_punkt(task_id, needs, nltk_data) if needs and not available else None


def keep_prefix_whitespace(apply_chat_template):
    """Chat templates `trim` message contents (Llama-3.x), so an assistant turn pre-filled with
    "...```python\n" renders as "...```python": the model then starts its code on the fence line.
    EvalPlus keeps the prefix byte for byte; so do we: put back the whitespace the template cut."""

    def apply(chat_history, add_generation_prompt: bool = True) -> str:
        rendered = apply_chat_template(chat_history, add_generation_prompt)
        last = chat_history[-1] if chat_history else None
        if add_generation_prompt or not last or last.get("role") != "assistant":
            return rendered
        content = last.get("content") or ""
        trimmed = content.rstrip()
        if trimmed and content != trimmed and rendered.endswith(trimmed):
            rendered += content[len(trimmed):]
        return rendered

    return apply


def decode_as_vllm(model) -> None:
    """lm-eval's hf backend calls `model.generate` with the task's settings only, so the checkpoint's
    generation_config.json fills the rest (a repetition penalty, `no_repeat_ngram_size`, a top_k), and transformers'
    defaults what it leaves unset (top_k 50); vLLM, under lm-eval, takes only the stop ids from that file and samples
    from every token. The model's config is replaced by one that keeps its token ids alone, so that both backends decode
    a task alike (greedy is greedy; top_k 0: every token, as vLLM)."""
    from transformers import GenerationConfig

    served = model.generation_config
    neutral = GenerationConfig(bos_token_id=served.bos_token_id, eos_token_id=served.eos_token_id, pad_token_id=served.pad_token_id)
    neutral.top_k = 0  # set after: built with it, a config that does not sample warns that top_k may be ignored
    model.generation_config = neutral


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def as_multiturn(job: dict) -> bool:
    """Few-shot examples as chat turns: only where the chat template is applied (lm-eval ignores it otherwise, and the
    result says what ran)."""
    return bool(job["fewshot_as_multiturn"] and job["chat"]["applied"])


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("lm_eval", "vllm", "transformers", "torch", "datasets", "featcal-llm", "math-verify", "nltk"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    found["python"] = sys.version.split()[0]
    return found


def _write_result(task: dict, job: dict, output: dict, name: str, config: dict, chat_template: str | None,
                  started: float) -> None:
    import hashlib

    from featcal_llm.evaluation.cache import write_entry

    metrics = output["results"][name]
    metric_key = task["metric"]
    if metric_key not in metrics:
        raise FeatCalError(
            f"{job['suite_path']}: tasks.{task['id']}.metric: '{metric_key}' is not in lm-eval's results "
            f"(has {', '.join(k for k in metrics if ',' in k and '_stderr,' not in k)})"
        )
    record = {
        "schema": "featcal-llm/eval-result/1",
        "cache_key": task["key"],
        "key_fields": task["key_fields"],
        "task": {"id": task["id"], "label": task["label"], "lm_eval_name": name, "metric": metric_key,
                 "value": metrics[metric_key], "settings": config},
        "model": job["model"],
        "backend": job["backend"],
        "chat_template": {**job["chat"], "applied_template_sha256":
                          hashlib.sha256(chat_template.encode()).hexdigest() if chat_template else None,
                          "fewshot_as_multiturn": as_multiturn(job)},
        "seeds": job["seeds"],
        "limit": job["limit"],
        "versions": _versions(),
        "metrics": metrics,
        "lm_eval": {key: output.get(key, {}).get(name) for key in ("versions", "n-shot", "higher_is_better", "n-samples")}
        | {"config": output.get("config"), "date": output.get("date"),
           "pretty_env_info": output.get("pretty_env_info"),
           "task_hash": (output.get("task_hashes") or {}).get(name)},
        "started": started,
        "duration_s": round(time.time() - started, 3),
    }
    samples = output.get("samples", {}).get(name, [])
    write_entry(Path(task["dir"]), _jsonable(record), [_jsonable(sample) for sample in samples])


def run(job: dict) -> None:
    if job.get("nltk_data"):
        os.environ["NLTK_DATA"] = job["nltk_data"]
    if any(task["lm_eval_task"].startswith("ifeval") for task in job["tasks"]):
        block_nltk_downloads()

    import lm_eval
    import lm_eval.evaluator
    from lm_eval.api.registry import get_model

    lm_eval.evaluator.get_git_commit_hash = quiet_git_hash  # what each result records as `git_hash`

    from featcal_llm.evaluation import evalplus
    from featcal_llm.evaluation.suite import load_suite
    from featcal_llm.evaluation.tasks import check_metric, describe, resolve_task_config, task_manager

    suite = load_suite(job["suite_path"])
    manager = task_manager(suite)
    built = []
    for task in job["tasks"]:
        spec = suite.tasks[task["id"]]
        if spec.executes_code and not job["allow_code_execution"]:
            raise FeatCalError(f"{task['id']}: executes model-written code; pass --allow-code-execution")
        data = Path(task["data"]) if task.get("data") else None
        config = resolve_task_config(suite, task["id"], data=data, max_gen_toks=job["max_gen_toks"],
                                     revision=task.get("revision"))
        check_metric(suite, task["id"], config)  # before any task's data is read or any model loads
        try:
            loaded = manager.load([config])["tasks"]
        except Exception as error:  # datasets/hub errors: name the task and the data source
            source = task.get("data") or config.get("dataset_path")
            raise FeatCalError(f"{task['id']}: could not load its data from {source} ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''}); pass --data {task['id']}=PATH "
                               "for a local copy") from None
        (name, task_object), = loaded.items()
        if name.startswith("ifeval"):
            preflight_ifeval(task["id"], task_object)
        built.append((task, spec, name, task_object, describe(config)))

    backend = job["backend"]
    print(f"[featcal-eval] loading {job['model']['path']} with lm-eval backend {backend['name']}", flush=True)
    lm = get_model(backend["name"]).create_from_arg_obj(backend["model_args"], {"batch_size": backend["batch_size"]})
    if backend["name"] == "hf":
        decode_as_vllm(lm.model)
    chat_template = lm.chat_template(True) if job["chat"]["applied"] else None
    if job["chat"]["applied"]:
        lm.apply_chat_template = keep_prefix_whitespace(lm.apply_chat_template)

    for task, spec, name, task_object, config in built:
        started = time.time()
        print(f"[featcal-eval] {job['label']}: {task['id']} ({name})", flush=True)
        if spec.executes_code:
            evalplus.configure_task(spec, allow=True, workers=job.get("code_workers"))
        seeds = job["seeds"]
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task_object],
            task_manager=manager,
            batch_size=backend["batch_size"],
            limit=job["limit"],
            log_samples=True,
            apply_chat_template=job["chat"]["applied"],
            fewshot_as_multiturn=as_multiturn(job),
            random_seed=seeds["random"],
            numpy_random_seed=seeds["numpy"],
            torch_random_seed=seeds["torch"],
            fewshot_random_seed=seeds["fewshot"],
            confirm_run_unsafe_code=bool(spec.executes_code and job["allow_code_execution"]),
        )
        evalplus.configure(allow=False)
        _write_result(task, job, output, name, config, chat_template, started)
        print(f"[featcal-eval] {job['label']}: {task['id']} done", flush=True)


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[1]).read_text())
    try:
        run(job)
    except FeatCalError as error:
        Path(job["error_file"]).write_text(json.dumps({"message": str(error)}))
        print(f"[featcal-eval] error: {error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
