"""How far float32 statistics move the update ΔW = W* − W_mer, against float64, per λ (evidence for `resolve_stats_dtype`).

On the whole-run preset's models (random SmolLM2-135M shapes, 3 experts × 64 × 128
tokens), the features of chosen layers are captured once with transformers'
full models (merged model on every task's text, expert i on its own), then
accumulated batch by batch with the product's own accumulators
(`stats.accumulate_*`) in three ways, folded with `objective.fold` and solved
with `solve.RidgeSolver`:

* float64 sums (the reference),
* float32 running totals, and W_i G_i, W_i · moment formed from them in
  float32 (what `stats_dtype: float32` did before),
* float32 products of each batch added into float64 totals, everything
  formed from them in float64 (what `stats_dtype: float32` does now; a
  compensated summation can do no better than exact totals).

    python -m featcal_llm.benchmark.precision [--layers 5,20] [--lambdas 1e-5,1e-3,1e-2,1e-1,3]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

GROUPS = {  # input group → (the projection that reads it, the projections solved)
    "qkv": ("self_attn.q_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "o": ("self_attn.o_proj", ("self_attn.o_proj",)),
    "gate/up": ("mlp.gate_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "down": ("mlp.down_proj", ("mlp.down_proj",)),
}
MODES = {  # name → (dtype of the running totals and of everything formed from them, dtype of each batch's products)
    "float64": (torch.float64, torch.float64),
    "float32 totals": (torch.float32, torch.float32),  # an earlier stats_dtype float32, kept for comparison
    "float32 products": (torch.float64, torch.float32),  # stats_dtype float32 now
}


def _capture(model: torch.nn.Module, layer: int, ids: torch.Tensor) -> tuple[dict, dict]:
    """Inputs and outputs of every Linear of one decoder layer, tokens × features (no padding: equal-length texts)."""
    inputs: dict[str, list] = {}
    outputs: dict[str, list] = {}

    def hook(_module, args, output, name):
        inputs.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]))
        outputs.setdefault(name, []).append(output.reshape(-1, output.shape[-1]))

    handles = [
        module.register_forward_hook(lambda m, a, y, n=name: hook(m, a, y, n))
        for name, module in model.model.layers[layer].named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    for chunk in ids.split(16):
        model.model(chunk)
    for handle in handles:
        handle.remove()
    return {k: torch.cat(v) for k, v in inputs.items()}, {k: torch.cat(v) for k, v in outputs.items()}


def _statistics(x_cal, x_exp, y_exp, projections, mode: str, batch_tokens: int):
    """One task's statistics of one group, accumulated as the product does (`record_task`), in one of MODES."""
    from featcal_llm.maths.stats import GroupStatistics, accumulate_cross, accumulate_gram, accumulate_moment

    total, precision = MODES[mode]
    outputs = {p: y.shape[1] for p, y in y_exp.items()}
    stats = GroupStatistics.empty(x_cal.shape[1], outputs, with_means=False, with_norm=False, device=torch.device("cpu"), dtype=total)
    stats.via_moment = stats.moment is not None
    for start in range(0, len(x_cal), batch_tokens):
        rows = slice(start, start + batch_tokens)
        accumulate_gram(stats.gram, x_cal[rows], precision)
        if stats.via_moment:
            accumulate_moment(stats.moment, x_exp[rows], x_cal[rows], precision)
        else:
            for p in projections:
                accumulate_cross(stats.cross[p], y_exp[p][rows], x_cal[rows], precision)
        stats.tokens += len(x_cal[rows])
    return stats


def measure(root: Path, layers: list[int], lambdas: list[float], alpha: float, rho: float, batch_tokens: int, log) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from featcal_llm.maths.objective import ExpertGroup, GroupSystem, MixedTargets, fold
    from featcal_llm.maths.solve import RidgeSolver, anchor

    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    recipe = json.loads((root / "complete.json").read_text())
    merged, base = load(root / "merged"), load(root / "base")
    tokenizer_ids = _token_ids(root, recipe["experts"])
    rows = []
    for layer in layers:
        log(f"precision: capturing layer {layer}")
        tasks = []
        for index, ids in enumerate(tokenizer_ids):
            expert = load(root / f"expert{index}")
            x_cal, _ = _capture(merged, layer, ids)
            x_exp, y_exp = _capture(expert, layer, ids)
            weights = {n: m.weight.detach().clone() for n, m in expert.model.layers[layer].named_modules() if isinstance(m, torch.nn.Linear)}
            tasks.append((x_cal, x_exp, y_exp, weights))
            del expert
        merged_weights = {n: m.weight.detach() for n, m in merged.model.layers[layer].named_modules() if isinstance(m, torch.nn.Linear)}
        base_weights = {n: m.weight.detach() for n, m in base.model.layers[layer].named_modules() if isinstance(m, torch.nn.Linear)}
        for group, (reader, projections) in GROUPS.items():
            seconds = {}
            folded = {}
            for mode in MODES:
                started = time.perf_counter()
                all_stats = [
                    _statistics(x_cal[reader], x_exp[reader], {p: y_exp[p] for p in projections}, projections, mode, batch_tokens)
                    for x_cal, x_exp, y_exp, _ in tasks
                ]
                seconds[mode] = time.perf_counter() - started
                folded[mode] = (all_stats, [{p: w[p] for p in projections} for *_, w in tasks])
            for lam in lambdas:
                deltas = {}
                for mode, (all_stats, weights) in folded.items():
                    system = GroupSystem(lhs=None, targets=MixedTargets(alpha), biases=MixedTargets(alpha))
                    for stats, task_weights in zip(all_stats, weights):
                        fold(system, _copy(stats), ExpertGroup(task_weights), 1e-8)
                    anchors = {p: anchor(merged_weights[p], base_weights[p], rho) for p in projections}
                    solved = RidgeSolver().solve(group, system.lhs, system.targets.at(alpha), anchors, lam, 1e-8, f"layer {layer} {group}")
                    deltas[mode] = {p: solved[p] - merged_weights[p].double() for p in projections}
                reference = deltas["float64"]
                error = lambda mode: max(  # noqa: E731
                    float(torch.linalg.matrix_norm(deltas[mode][p] - reference[p]) / torch.linalg.matrix_norm(reference[p])) for p in projections
                )
                rows.append({
                    "layer": layer, "group": group, "lambda": lam,
                    "float32_totals": error("float32 totals"), "float32_products": error("float32 products"),
                    "seconds": seconds,
                })
                log(f"precision: layer {layer} {group:>8} λ {lam:<6g} ΔW error: float32 totals {rows[-1]['float32_totals']:.1e}, "
                    f"float32 products {rows[-1]['float32_products']:.1e}")
    return rows


def _copy(stats):
    """`fold` consumes its statistics: each λ folds a fresh copy."""
    from dataclasses import replace

    return replace(
        stats, gram=stats.gram.clone(), cross={k: v.clone() for k, v in stats.cross.items()},
        moment=None if stats.moment is None else stats.moment.clone(),
    )


def _token_ids(root: Path, experts: int) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "merged")
    result = []
    for index in range(experts):
        texts = [json.loads(line)["text"] for line in (root / f"data{index}.jsonl").read_text().splitlines() if line.strip()]
        result.append(torch.tensor([tokenizer(text)["input_ids"] for text in texts]))
    return result


def render(rows: list[dict]) -> str:
    lines = ["relative error on ΔW against float64 statistics",
             f"{'layer':>5} {'group':>8} {'lambda':>8} {'f32 totals':>11} {'f32 products':>13} {'s f64/f32 totals/f32 products':>31}"]
    for row in rows:
        times = "/".join(f"{row['seconds'][mode]:.2f}" for mode in MODES)
        lines.append(f"{row['layer']:>5} {row['group']:>8} {row['lambda']:>8g} {row['float32_totals']:>11.1e} {row['float32_products']:>13.1e} {times:>31}")
    for key in ("float32_totals", "float32_products"):
        worst: dict[float, float] = {}
        for row in rows:
            worst[row["lambda"]] = max(worst.get(row["lambda"], 0.0), row[key])
        lines.append(f"worst {key.replace('_', ' ')} per λ: " + ", ".join(f"λ {lam:g}: {value:.1e}" for lam, value in worst.items()))
    return "\n".join(lines)


@click.command(help=__doc__.splitlines()[0], context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layers", default="5,20", show_default=True, help="decoder layers whose features are captured")
@click.option("--lambdas", default="1e-5,1e-3,1e-2,1e-1,3", show_default=True)
@click.option("--alpha", default=0.15, show_default=True)
@click.option("--rho", default=0.5, show_default=True)
@click.option("--batch-tokens", default=4096, show_default=True, help="tokens per accumulated batch")
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="where the preset's models are built (cached)")
@click.option("--json", "as_json", is_flag=True)
def main(layers, lambdas, alpha, rho, batch_tokens, workdir, as_json) -> None:
    import tempfile

    from featcal_llm.benchmark.wholerun import PRESETS, WholeRunSpec, build

    torch.set_grad_enabled(False)
    log = lambda message: click.echo(message, err=True)  # noqa: E731
    preset = dict(PRESETS["smollm2-135m"])
    lam = preset.pop("lam")
    root = build(WholeRunSpec(**preset), workdir or Path(tempfile.gettempdir()) / "featcal-llm-bench", lam, log).parent
    rows = measure(root, [int(v) for v in layers.split(",")], [float(v) for v in lambdas.split(",")], alpha, rho, batch_tokens, log)
    click.echo(json.dumps(rows, indent=1) if as_json else render(rows))


if __name__ == "__main__":
    main()
