"""Grade given completions with a suite task's exact lm-eval pipeline (filters, metrics, EvalPlus
execution), without a model: an lm-eval LM that replays the completions.

Used by the grader tests, and to re-grade saved completions after a grader fix without
regenerating them. Code still runs only with `allow_code_execution`, one subprocess per sample.
"""

from __future__ import annotations

from pathlib import Path

from featcal_llm.evaluation.suite import Suite


def _replay_lm(completions: list):
    from lm_eval.api.model import LM

    class ReplayLM(LM):
        """Answers generate_until requests by document index; a list of completions for a document
        answers its repeated samples in turn (tasks with `repeats`)."""

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            served: dict[int, int] = {}
            answers = []
            for request in requests:
                given = completions[request.doc_id]
                if isinstance(given, list):
                    index = served.get(request.doc_id, 0)
                    served[request.doc_id] = index + 1
                    given = given[index % len(given)]
                answers.append(given)
            return answers

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("replay grades generative tasks only")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("replay grades generative tasks only")

    return ReplayLM()


def grade_completions(suite: Suite, task_id: str, completions: list, *, data: Path | None,
                      allow_code_execution: bool = False, code_limits: dict | None = None) -> tuple[float, list[dict]]:
    """The suite's primary metric over the items, and lm-eval's per-sample records (by doc_id)
    restricted to the metric's filter."""
    import lm_eval

    from featcal_llm.evaluation import evalplus
    from featcal_llm.evaluation.tasks import resolve_task_config, task_manager
    from featcal_llm.evaluation.worker import block_nltk_downloads

    spec = suite.tasks[task_id]
    if (spec.lm_eval_task or "").startswith("ifeval"):
        block_nltk_downloads()
    manager = task_manager(suite)
    config = resolve_task_config(suite, task_id, data=data, max_gen_toks=None)
    (name, task), = manager.load([config])["tasks"].items()
    if spec.executes_code:
        evalplus.configure_task(spec, allow=allow_code_execution, **(code_limits or {}))
    try:
        output = lm_eval.simple_evaluate(model=_replay_lm(completions), tasks=[task], task_manager=manager,
                                         log_samples=True, confirm_run_unsafe_code=True)  # the gate is evalplus.configure
    finally:
        evalplus.configure(allow=False)
    metric, filter_name = spec.metric.split(",", 1)
    samples = sorted((s for s in output["samples"][name] if s["filter"] == filter_name), key=lambda s: s["doc_id"])
    for sample in samples:
        sample["primary"] = float(sample[metric])
    return float(output["results"][name][spec.metric]), samples
