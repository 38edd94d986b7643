"""From raw measurements to the per-phase roofline table, the lower bound and the extrapolation."""

from __future__ import annotations

import math


def _steady(layers: list[dict]) -> list[dict]:
    """Layers used for per-layer means: all but layer 0 (warm-up) when there are at least two."""
    return layers[1:] if len(layers) >= 2 else layers


KNOWN = ("read", "read (background)", "load", "forward", "statistics", "solve", "write")
NOTES = {
    "read": "main thread waiting for the layer's tensors (reading overlaps compute when the engine prefetches)",
    "read (background)": "reading the tensors themselves, in whichever thread reads",
    "load": "building the decoder layers on the device (dtype conversion, copies)",
    "other": "outside every timed phase (masks, rotary embeddings, host copies, checks)",
}


def summarize(raw: dict) -> dict:
    """Adds `phases`, `per_layer`, `extrapolated` to the raw result (returned)."""
    steady = _steady(raw["layers"])
    count = len(steady)
    mean = lambda values: sum(values) / count  # noqa: E731
    names = list(dict.fromkeys(name for r in steady for name in r["seconds"]))
    seconds = {p: mean([r["seconds"].get(p, 0.0) for r in steady]) for p in names}
    for p in ("read", "forward", "statistics", "solve", "write"):
        seconds.setdefault(p, 0.0)
    wall = mean([r["wall"] for r in steady])
    read_bytes = mean([r["bytes_read"] for r in steady])
    read_background = mean([r.get("read_seconds_background", 0.0) for r in steady])
    write_bytes = mean([r["bytes_written"] for r in steady])
    other = mean([r["other"] for r in steady])
    flops = raw["flops_per_layer"]
    run, rates, disk = raw["run"], raw["machine"]["matmul_flops"], raw["machine"]["disk"]
    read_peak = disk["read_cold"] if run["cold_reads"] else disk["read_cached"]

    def compute(name: str, secs: float, dtype: str) -> dict:
        achieved = flops[name] / secs if secs > 0 else math.inf
        peak = rates[dtype]
        return {
            "seconds": secs, "gflop": flops[name] / 1e9, "gb": 0.0, "dtype": dtype, "unit": "GFLOP/s",
            "achieved": achieved / 1e9, "peak": peak / 1e9, "ratio": achieved / peak, "bound_seconds": flops[name] / peak,
        }

    def transfer(secs: float, amount: float, peak: float, what: str) -> dict:
        achieved = amount / secs if secs > 0 else math.inf
        return {
            "seconds": secs, "gflop": 0.0, "gb": amount / 1e9, "dtype": what, "unit": "GB/s",
            "achieved": achieved / 1e9, "peak": peak / 1e9, "ratio": achieved / peak, "bound_seconds": amount / peak,
        }

    read_kind = "disk read" if run["cold_reads"] else "page cache"
    phases = {
        "read": transfer(seconds["read"], read_bytes, read_peak, read_kind),
        "read (background)": transfer(read_background, read_bytes, read_peak, read_kind),
        "forward": compute("forward", seconds["forward"], run["dtype"]),  # exclusive time: net of statistics
        "statistics": compute("statistics", seconds["statistics"], run.get("stats_matmul_dtype", run["stats_dtype"])),
        "solve": compute("solve", seconds["solve"], run["solve_dtype"]),
        "write": transfer(seconds["write"], write_bytes, disk["write"], "disk write"),
    }
    for name in names:
        if name not in phases:
            phases[name] = {"seconds": seconds[name]}
    phases["other"] = {"seconds": other}
    for name, row in phases.items():
        if name in NOTES:
            row["note"] = NOTES[name]
    ordered = {name: phases[name] for name in KNOWN if name in phases}
    ordered.update({name: row for name, row in phases.items() if name not in ordered})
    phases = ordered
    compute_bound = sum(phases[p]["bound_seconds"] for p in ("forward", "statistics", "solve"))
    io_bound = phases["read"]["bound_seconds"] + phases["write"]["bound_seconds"]
    bound = compute_bound + io_bound
    per_layer = {
        "seconds": wall, "lower_bound_seconds": bound, "ratio": wall / bound if bound > 0 else math.inf,
        "overlapped_lower_bound_seconds": max(compute_bound, io_bound),
        "layers_averaged": [r["layer"] for r in steady],
    }

    target = raw["options"]["extrapolate_to"]
    finalize = raw.get("finalize")
    finalize_seconds = finalize_bound = 0.0
    if finalize:
        scale = target / finalize["stored_layers"]
        finalize_seconds = finalize["seconds"] * scale
        finalize_bound = (finalize["bytes_read"] / read_peak + finalize["bytes_written"] / disk["write"]) * scale
    total = raw["setup_seconds"] + target * wall + finalize_seconds
    total_bound = target * bound + finalize_bound
    extrapolated = {
        "layers": target, "seconds": total, "lower_bound_seconds": total_bound,
        "ratio": total / total_bound if total_bound > 0 else math.inf,
        "setup_seconds": raw["setup_seconds"], "finalize_seconds": finalize_seconds,
    }
    measured_total = raw["calibrate_seconds"] + (finalize["seconds"] if finalize else 0.0)
    raw.update(phases=phases, per_layer=per_layer, extrapolated=extrapolated, measured_total_seconds=measured_total)
    if raw.get("generation"):
        from featcal_llm.benchmark.generation_cost import compare_with_calibration

        raw["generation"] = compare_with_calibration(raw["generation"], total, target)
    return raw


def _gb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:.2f} GB" if value >= 1e7 else f"{value / 1e6:.3g} MB"


def render(summary: dict) -> str:
    run, machine_info, disk = summary["run"], summary["machine"], summary["machine"]["disk"]
    lines = []
    shapes = summary["shapes"]
    lines.append(
        f"FeatCal benchmark: hidden {shapes['hidden']}, intermediate {shapes['intermediate']}, heads {shapes['heads']}/{shapes['kv_heads']}, "
        f"{run['layers']} layers ({run['stored_layers']} stored), {run['experts']} experts × {next(iter(run['tokens_per_expert'].values()))} tokens"
    )
    lines.append(
        f"device {run['device']} ({run['threads']} threads), compute {run['dtype']}, statistics {run['stats_dtype']}"
        f" (matmuls in {run.get('stats_matmul_dtype', run['stats_dtype'])}), solve {run['solve_dtype']}"
    )
    rates = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in machine_info["matmul_flops"].items())
    lines.append(f"measured matmul ({machine_info['matmul_size']}²): {rates}")
    lines.append(
        f"measured disk: write {disk['write'] / 1e9:.2f} GB/s (fsync'ed), read {disk['read_cold'] / 1e9:.2f} GB/s "
        f"({'after dropping the page cache' if disk['cache_dropped'] else 'page cache could not be dropped'}), "
        f"page cache {disk['read_cached'] / 1e9:.2f} GB/s; checkpoint reads are {'cold' if run['cold_reads'] else 'warm'}"
    )
    for note in summary.get("notes", []):
        lines.append(f"note: {note}")
    lines.append("")
    lines.append("per layer:")
    for record in summary["layers"]:
        parts = ", ".join(f"{p} {s:.2f}" for p, s in record["seconds"].items())
        lines.append(
            f"  layer {record['layer']}: {record['wall']:.2f} s ({parts}, other {record['other']:.2f};"
            f" background read {record.get('read_seconds_background', 0.0):.2f})"
        )
    averaged = summary["per_layer"]["layers_averaged"]
    lines.append("")
    lines.append(f"mean over layer{'s' if len(averaged) > 1 else ''} {', '.join(map(str, averaged))} (exclusive seconds: forward is net of statistics):")
    header = f"{'phase':<19}{'s/layer':>9}{'GFLOP':>10}{'GB':>10}{'achieved':>12}{'peak':>12}  {'unit':<8}{'ratio':>7}  bound s"
    lines.append(header)
    lines.append("-" * len(header))
    for name, p in summary["phases"].items():
        if "ratio" not in p:
            lines.append(f"{name:<19}{p['seconds']:>9.3g}{'':>10}{'':>10}{'':>12}{'':>12}  {'':<8}{'':>7}  ({p.get('note', 'timed by the engine')})")
            continue
        gflop = f"{p['gflop']:.4g}" if p["gflop"] else "-"
        gb = f"{p['gb']:.4g}" if p["gb"] else "-"
        lines.append(
            f"{name:<19}{p['seconds']:>9.3g}{gflop:>10}{gb:>10}{p['achieved']:>12.4g}{p['peak']:>12.4g}  "
            f"{p['unit']:<8}{p['ratio']:>7.3f}  {p['bound_seconds']:.3g} [{p['dtype']}]"
        )
    per = summary["per_layer"]
    lines.append("-" * len(header))
    lines.append(
        f"{'layer':<19}{per['seconds']:>9.3g}   lower bound {per['lower_bound_seconds']:.3g} s  →  {per['ratio']:.2f}× the bound"
        f" (with reads and writes fully overlapped with compute: {per['overlapped_lower_bound_seconds']:.3g} s)"
    )
    ext = summary["extrapolated"]
    lines.append("")
    lines.append(
        f"measured: setup {summary['setup_seconds']:.2f} s, calibrate {summary['calibrate_seconds']:.2f} s"
        + (f", final checkpoint write {summary['finalize']['seconds']:.2f} s" if summary.get("finalize") else "")
        + f", total {summary['measured_total_seconds']:.2f} s"
    )
    lines.append(
        f"extrapolated to {ext['layers']} layers: {ext['seconds']:.1f} s ({ext['seconds'] / 60:.1f} min) "
        f"vs lower bound {ext['lower_bound_seconds']:.1f} s  →  {ext['ratio']:.2f}× the bound"
    )
    if summary.get("generation"):
        from featcal_llm.benchmark.generation_cost import render_generation

        lines.extend(render_generation(summary["generation"]))
    memory = summary["memory"]
    lines.append("")
    lines.append(f"peak host RSS: {_gb(memory['peak_rss'])} ({memory['peak_rss_scope']}); process lifetime {_gb(memory['peak_rss_lifetime'])}")
    if memory.get("host_store"):
        hs = memory["host_store"]
        lines.append(f"host stream store: budget {_gb(hs['budget'])}, peak in RAM {_gb(hs['peak_in_ram'])}, spilled to disk {_gb(hs['spilled'])}")
    if memory["peak_gpu"]:
        lines.append(f"peak GPU memory: {_gb(memory['peak_gpu']['allocated'])} allocated, {_gb(memory['peak_gpu']['reserved'])} reserved")
    est = memory["estimates"]
    lines.append(
        "sizes for comparison: one layer's weights "
        f"{_gb(est['layer_weights'])}, one task's statistics {_gb(est['task_statistics'])}, group systems {_gb(est['group_systems'])}, "
        f"one batch's activations ≈{_gb(est['batch_activations'])}, host streams (h_cal + h_exp) {_gb(est['host_streams'])}"
    )
    return "\n".join(lines)
