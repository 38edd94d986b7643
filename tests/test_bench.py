"""`featcal-llm bench` at tiny shapes: the JSON has every phase, counts and ratios (never timings)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from featcal_llm.benchmark.cli import bench
from featcal_llm.benchmark import costs
from featcal_llm.benchmark.synthetic import SyntheticSpec

PHASES = ("read", "forward", "statistics", "solve", "write")
TINY = ["--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--peak-size", "128", "--probe-mb", "4", "--seq-len", "64"]


def _run(tmp_path, *extra):
    result = CliRunner().invoke(bench, [*TINY, "--workdir", str(tmp_path), "--json", *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bench_json_reports_every_phase(tmp_path):
    data = _run(tmp_path, "--layers", "2", "--tokens", "256")

    assert [r["layer"] for r in data["layers"]] == [0, 1]
    for phase in PHASES:
        row = data["phases"][phase]
        assert row["seconds"] >= 0
        assert 0 < row["ratio"] < math.inf, (phase, row)
        assert 0 < row["peak"] < math.inf
    assert data["phases"]["read (background)"]["gb"] == data["phases"]["read"]["gb"] > 0
    assert data["phases"]["other"]["seconds"] >= 0
    for phase in ("forward", "statistics", "solve"):
        assert data["flops_per_layer"][phase] > 0
        assert data["phases"][phase]["gflop"] > 0
    for phase in ("read", "write"):
        assert data["phases"][phase]["gb"] > 0
    assert data["run"]["tokens_per_expert"] == {f"expert{i}": 256 for i in range(3)}
    assert data["layers"][0]["bytes_read"] == 5 * SyntheticSpec(hidden=64, intermediate=128, heads=4, kv_heads=2).layer_bytes()
    assert data["memory"]["peak_rss_lifetime"] > 0
    assert data["memory"]["peak_rss"] is None or data["memory"]["peak_rss"] > 0
    assert data["memory"]["peak_gpu"] is None  # CPU run
    assert data["per_layer"]["lower_bound_seconds"] > 0
    assert data["extrapolated"]["layers"] == 32 and data["extrapolated"]["seconds"] > 0
    assert data["finalize"]["bytes_written"] > 0
    assert all(v > 0 for v in data["machine"]["matmul_flops"].values())
    assert data["machine"]["disk"]["read_cold"] > 0 and data["machine"]["disk"]["write"] > 0
    generation = data["generation"]  # each expert writes the 4 × 64 tokens it is calibrated on, at the 2 measured layers
    assert generation["tokens_per_expert"] == 256 and generation["batch"] == 4 and generation["layers"] == 2
    at = {int(d): s for d, s in generation["seconds_at_depth"].items()}
    assert set(at) == {1, 2} and generation["per_layer_seconds"] == pytest.approx(at[2] - at[1])
    assert generation["fixed_seconds"] == pytest.approx(at[1] - generation["per_layer_seconds"])
    one = max(generation["fixed_seconds"], 0) + max(generation["per_layer_seconds"], 0) * 32
    assert generation["seconds_all_experts_extrapolated"] == pytest.approx(3 * one)
    assert generation["calibration_seconds_extrapolated"] == data["extrapolated"]["seconds"]
    assert generation["ratio_to_calibration"] == pytest.approx(generation["seconds_all_experts_extrapolated"] / data["extrapolated"]["seconds"])

    # the checkpoints are cached: a second run reuses them, and stored layers can be reused for more layers
    again = _run(tmp_path, "--layers", "3", "--distinct-layers", "2", "--tokens", "64", "--experts", "2", "--no-finalize")
    assert again["run"]["stored_layers"] == 2 and [r["layer"] for r in again["layers"]] == [0, 1, 2]
    assert again["finalize"] is None and again["run"]["experts"] == 2
    assert _run(tmp_path, "--layers", "1", "--tokens", "64", "--no-finalize", "--no-generation")["generation"] is None


def test_flop_counts_match_hand_computation():
    from transformers import LlamaConfig

    from featcal_llm.family.architectures import ARCHITECTURES
    from featcal_llm.engine.plan import CalibrationPlan
    from featcal_llm.engine.objectives import FeatCal
    from featcal_llm.maths.objective import Hyperparameters

    architecture = ARCHITECTURES["LlamaForCausalLM"]
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    plan = CalibrationPlan(architecture, frozenset(architecture.projections()), False, True, FeatCal(Hyperparameters(1.0, 0.15, 0.5, 1e-8)))
    shape = costs.layer_shape(architecture, config, plan)
    d, i, kv = 64, 128, 32
    params = d * d + 2 * kv * d + d * d + 3 * i * d
    assert shape.linear_params == params
    assert costs.forward_flops(shape, [10, 20]) == 2 * params * 30 + 2 * (100 + 400) * d
    grams = 3 * d * d + i * i
    crosses = params  # Σ m·d over every projection
    fold = 2 * ((d + 2 * kv) * d * d + d * d * d + 2 * i * d * d + d * i * i)  # W_i G_i of every projection
    # 7 tokens < every input dim: crosses per projection, no moment
    assert costs.statistics_flops(shape, 7) == 2 * 7 * (grams + crosses)
    assert costs.fold_flops(shape, 7) == fold
    # 100 tokens: gate/up (m = 256 > d) keep a d × d moment (256·100 > 64·100 + 256·64), q/k/v (m = 128) not yet
    gate_up, qkv = 2 * i * d, (d + 2 * kv) * d  # Σ m·d of each group
    assert costs.statistics_flops(shape, 100) == 2 * 100 * (grams + crosses - gate_up + d * d)
    assert costs.fold_flops(shape, 100) == fold + 2 * gate_up * d
    # 1000 tokens: q/k/v keep a moment too, and each moment group pays W_i · moment once more in the fold
    assert costs.statistics_flops(shape, 1000) == 2 * 1000 * (grams + crosses - gate_up - qkv + 2 * d * d)
    assert costs.fold_flops(shape, 1000) == fold + 2 * (gate_up + qkv) * d
    assert costs.ridge_flops(shape) == pytest.approx((3 * d**3 + i**3) / 3 + fold)


def test_whole_run_times_the_product_and_the_baseline_on_the_same_model(tmp_path):
    """`--whole-run` at tiny shapes: both runs happen, start-up is seen, and the two agree on ΔW (counts, never timings)."""
    options = ["--whole-run", "--preset", "smollm2-135m", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
               "--vocab", "128", "--layers", "2", "--sequences", "6", "--seq-len", "32", "--lam", "1e-2", "--workdir", str(tmp_path), "--json"]
    result = CliRunner().invoke(bench, options, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["mode"] == "whole-run" and data["lambda"] == 1e-2
    spec = data["spec"]
    assert (spec["hidden"], spec["layers"], spec["sequences"], spec["seq_len"]) == (64, 2, 6, 32)  # explicit options win
    assert spec["experts"] == 3 and spec["tied"] is True  # from the preset
    product, baseline = data["product"], data["baseline"]
    assert 0 < product["startup_seconds"] <= product["first_layer_seconds"] <= product["seconds"]
    assert product["cpu_seconds"] > 0 and baseline["seconds"] > 0 and data["speedup"] > 0
    difference = data["delta_difference"]
    assert difference["projections"] == 2 * 7
    assert difference["worst"] <= 1e-3, difference  # the float32 baseline implements the same maths


@pytest.mark.parametrize("options, refused", [
    (["--whole-run", "--device", "cpu", "--threads", "2"], "--device, --threads: not read by a whole run (--whole-run)"),
    (["--no-baseline", "--method", "regmean"], "--baseline, --method: not read by the layer loop (without --whole-run)"),
    (["--whole-run", "--gram-triangle"], "--gram-triangle: not read by a whole run (--whole-run)"),
])
def test_an_option_the_chosen_mode_would_ignore_is_a_usage_error(options, refused):
    result = CliRunner().invoke(bench, options)
    assert result.exit_code == 2 and f"Error: {refused}" in result.output, result.output
