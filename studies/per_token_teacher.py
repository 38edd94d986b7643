"""A prototype, not the product: the teacher of each calibration token chosen per token (docs/studies/all-gap.md).

Each expert's records become two tasks over the same batches. The expert teaches the tokens where it leads the
merge at the next token (token weight above ½ under `token_weights: expert_lead`); the merged model (its stream,
layers, final norm and LM head, as `trailing_experts: merge` uses it) teaches the rest, with the same token
weights. The expert's share is split between the two in proportion to their weight mass, so with no token handed
over the run is the product's own with `trailing_experts: keep`. It wraps the pipeline's weight stage, so it needs
the defaults' token weights, and it refines `keep`: a run in which the merge already teaches an expert's records
stops (the measured 0.3 recipe sets `trailing_experts: keep`; on the demo every expert leads on its answers).

    python -m studies.per_token_teacher RECIPE OUTPUT          a `featcal-llm run`, per-token teachers
    python -m studies.per_token_teacher --demo WORKDIR SEED    the demo, calibrated again with them
    python -m studies.per_token_teacher --head-only …          the teachers split at the LM head alone
"""

from __future__ import annotations

import sys
from dataclasses import replace

TWIN = "#merge"  # the name of the task the merge teaches, after its expert's


def merge_taught(roots, batches):
    """Per batch, the kept tokens whose weight is the floor 1 − ADVANTAGE_SHARE (½): where the expert does not lead the
    merge (its advantage is 0; maths/advantage.token_weights)."""
    from featcal_llm.maths.advantage import ADVANTAGE_SHARE

    floor = 1 - ADVANTAGE_SHARE
    return [((root * root - floor).abs() < 1e-12) & batch.keep for root, batch in zip(roots, batches)]


def split_teachers(context, resolved, hand_over=merge_taught) -> dict[str, float]:
    """Give every expert's records a twin task the merged model teaches (in place); returns each expert's share handed over."""
    plan, roots = context.plan, context.token_roots
    if roots is None:
        raise SystemExit("per-token teachers need token_weights: expert_lead")
    batches, new_roots, experts = dict(context.batches), {}, dict(context.models.experts)
    weights, handed = dict(plan.task_weights or {}), {}
    for task, task_roots in roots.items():
        masks = hand_over(task_roots, context.batches[task])
        mass = sum(float((r * r).sum()) for r in task_roots)
        handed[task] = sum(float((r * r * m).sum()) for r, m in zip(task_roots, masks)) / mass
        twin = task + TWIN
        batches[twin], experts[twin] = context.batches[task], context.models.merged
        new_roots[task] = [r * (~m).double() for r, m in zip(task_roots, masks)]
        new_roots[twin] = [r * m.double() for r, m in zip(task_roots, masks)]
        share = plan.task_weight(task)
        weights[task], weights[twin] = share * (1 - handed[task]), share * handed[task]
        if context.probe is not None:
            context.probe.batches[twin] = context.probe.batches[task]
    context.batches, context.token_roots = batches, new_roots
    context.models = replace(context.models, experts=experts)
    context.plan = resolved.plan = replace(plan, task_weights=weights)
    return handed


def install(hand_over=merge_taught, head_only: bool = False) -> None:
    """Wrap the pipeline's weight stage; the drift report (keyed by the recipe's experts) is skipped.

    `head_only`: the layers keep every expert as the teacher of all its tokens (the twins weigh nothing there) and the
    teachers are split at the LM head's re-fit alone.
    """
    import featcal_llm.engine.calibrate as calibrate_module
    import featcal_llm.pipeline as pipeline
    import featcal_llm.stages.outputs as outputs

    weights_stage = pipeline._weights

    def with_split(context, resolved, data, opened):
        result = weights_stage(context, resolved, data, opened)
        if result[2]:  # the merge already teaches a trailing expert's records: the split refines `keep`, not that
            raise SystemExit("per-token teachers split the teachers of trailing_experts: keep; set it in the recipe "
                             f"(the merge teaches {', '.join(result[2])} here)")
        whole_roots, whole_plan = context.token_roots, context.plan
        for task, share in split_teachers(context, resolved, hand_over).items():
            print(f"per-token teachers: the merge teaches {share:.1%} of {task}'s token weight", file=sys.stderr, flush=True)
        if head_only:
            split_roots, split_plan = context.token_roots, context.plan
            context.token_roots = {task: whole_roots[task] if task in whole_roots else [r * 0 for r in roots]
                                   for task, roots in split_roots.items()}
            context.plan = resolved.plan = replace(split_plan, task_weights={task: whole_plan.task_weight(task) if task in whole_roots
                                                                             else 0.0 for task in split_roots})
            head_stage = calibrate_module.calibrate_head

            def head_with_split(ctx, hyper):
                layers_roots, layers_plan = ctx.token_roots, ctx.plan
                ctx.token_roots, ctx.plan = split_roots, split_plan
                try:
                    return head_stage(ctx, hyper)
                finally:
                    ctx.token_roots, ctx.plan = layers_roots, layers_plan

            calibrate_module.calibrate_head = head_with_split
        return result

    pipeline._weights = with_split
    outputs.write_report = lambda *args, **kwargs: None
    outputs.drift_report = lambda *args, **kwargs: {}


def main(argv: list[str]) -> None:
    head_only = argv[0] == "--head-only"
    argv = argv[1:] if head_only else argv
    install(head_only=head_only)
    if argv[0] == "--demo":
        import featcal_llm.demo.run as demo_run
        from featcal_llm.demo.config import FULL

        key = demo_run.calibration_key
        demo_run.calibration_key = lambda experts, recipe: key(experts, recipe) + ("-head" if head_only else "") + "-per-token"
        demo_run.run_demo(argv[1], config=FULL.replace(seed=int(argv[2]), baselines=False))
    else:
        from featcal_llm.pipeline import run_recipe

        run_recipe(argv[0], output=argv[1], progress=False)


if __name__ == "__main__":
    from studies.common import answer_help

    answer_help(__doc__)
    main(sys.argv[1:])
