"""Distributed benchmark: the layer loop on 2 ranks × 1 thread against 1 × 1 and 1 × 2, and the bytes per layer.

`python -m featcal_llm.benchmark.distributed [--layers N]` builds (cached) a
SmolLM2-135M-shaped random Llama (hidden 576, 3 experts × 64 × 128 tokens),
launches each world as torchrun does (env:// variables, gloo on 127.0.0.1),
times `calibrate` (the layer loop, start-up excluded) on every rank, records
the payload bytes each rank reduced or broadcast per layer, checks the 2-rank
weights against the 1-rank ones, and prints the on-paper communication share
for Llama-3.1-8B (`paper_share`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from featcal_llm.benchmark.costs import Group, LayerShape

FLOAT64 = 8


def launch_world(command: list[str], world: int, logs: Path, threads: int = 1, timeout: float = 600.0, env: dict | None = None) -> list[tuple[int, str, str]]:
    """Run `command` as `world` ranks on this machine (MASTER_ADDR 127.0.0.1, a free port); (returncode, stdout, stderr) per rank.

    Every rank is killed after `timeout` seconds, so a test can never hang.
    """
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    logs.mkdir(parents=True, exist_ok=True)
    running = []
    for rank in range(world):
        rank_env = {
            **os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(threads),
        }
        out, err = open(logs / f"rank{rank}.out", "w"), open(logs / f"rank{rank}.err", "w")
        running.append((subprocess.Popen(command, env=rank_env, stdout=out, stderr=err), out, err))
    deadline = time.monotonic() + timeout
    results = []
    for rank, (process, out, err) in enumerate(running):
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _, _ in running:
                other.kill()
            process.wait()
        out.close(), err.close()
        results.append((process.returncode, (logs / f"rank{rank}.out").read_text(), (logs / f"rank{rank}.err").read_text()))
    return results


def reduced_bytes_per_task(shape: LayerShape, tokens: int) -> int:
    """Payload of one task's statistics of one layer as the engine reduces them (float64, `distributed.statistics_tensors`)."""
    from featcal_llm.benchmark.costs import _uses_moment

    total = 0
    for g in shape.groups:
        d = g.input_dim
        total += d * d + (d * d if _uses_moment(g, tokens) else sum(m * d for m in g.outputs.values())) + d  # + the norm's sum
    return total * FLOAT64 + len(shape.groups) * 8  # token counts


def solution_bytes(shape: LayerShape, element_size: int) -> int:
    """The calibrated weights of one layer, broadcast from their owners."""
    return sum(m * g.input_dim for g in shape.groups for m in g.outputs.values()) * element_size


def llama31_8b() -> LayerShape:
    attention, kv, hidden, ff = 4096, 1024, 4096, 14336
    return LayerShape(
        (
            Group("attn_input", hidden, {"q": attention, "k": kv, "v": kv}),
            Group("attn_output", attention, {"o": hidden}),
            Group("mlp_input", hidden, {"gate": ff, "up": ff}),
            Group("mlp_hidden", ff, {"down": hidden}),
        ),
        linear_params=218_103_808,
        attention_dim=attention,
    )


def paper_share(experts: int, tokens_per_task: int, sequence: int, gpus: int, link_gb_s: float, fp64_tflops: float, bf16_tflops: float) -> dict:
    """Communication share of one Llama-3.1-8B layer: reduce-to-owner bytes over the slowest link against the compute split over `gpus`.

    A ring reduce moves (N − 1)/N of the payload through each link; the compute
    (3 forward passes in bf16, float64 statistics, the fold) divides by the
    ranks, the Cholesky and solves by min(ranks, groups) at best.
    """
    from featcal_llm.benchmark.costs import fold_flops, forward_flops, ridge_flops, statistics_flops

    shape = llama31_8b()
    lengths = [sequence] * (tokens_per_task // sequence)
    statistics = experts * reduced_bytes_per_task(shape, tokens_per_task)
    moved = statistics * (gpus - 1) / gpus + solution_bytes(shape, 2)
    communication = moved / (link_gb_s * 1e9)
    forward = experts * 3 * forward_flops(shape, lengths) / (bf16_tflops * 1e12) / gpus
    stats = experts * statistics_flops(shape, tokens_per_task, symmetric=False) / (fp64_tflops * 1e12) / gpus
    solve = (experts * fold_flops(shape, tokens_per_task) + ridge_flops(shape)) / (fp64_tflops * 1e12) / min(gpus, len(shape.groups))
    layer = forward + stats + solve + communication
    return {"gpus": gpus, "link_GB_s": link_gb_s, "statistics_GB": statistics / 1e9, "moved_GB": moved / 1e9,
            "communication_s": communication, "layer_s": layer, "share": communication / layer}


def _worker(recipe: str, result: str) -> None:
    """One rank: run the recipe with `calibrate` timed; write seconds and per-layer traffic."""
    import featcal_llm.pipeline as pipeline

    real = pipeline.calibrate
    measured = {}

    def timed(ctx, num_layers, progress=True):
        start, cpu = time.perf_counter(), time.process_time()
        replacements = real(ctx, num_layers, progress)
        measured.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu, traffic=ctx.comm.traffic, rank=ctx.comm.rank)
        return replacements

    pipeline.calibrate = timed
    pipeline.run_recipe(recipe, force=True, progress=False)
    Path(f"{result}.rank{measured['rank']}.json").write_text(json.dumps(measured))


def smollm_statistics() -> list[tuple[str, tuple[int, ...]]]:
    """One task's float64 statistics of a SmolLM2-135M layer as reduced (hidden 576, MLP 1536; moments for q/k/v and gate/up)."""
    h, ff, q = 576, 1536, 576  # k/v (192 wide) share attn_input with q
    return [("attn_input", (h, h)), ("attn_input", (h, h)), ("attn_output", (q, q)), ("attn_output", (h, q)),
            ("mlp_input", (h, h)), ("mlp_input", (h, h)), ("mlp_hidden", (ff, ff)), ("mlp_hidden", (h, ff))]


def _collectives(result: str, repeats: int = 20) -> None:
    """One rank: time reducing one task's statistics onto their owners against all-reducing them (gloo, float64)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    owners = {"mlp_hidden": 0, "attn_input": 1 % world, "attn_output": 1 % world, "mlp_input": 1 % world}  # as group_owners
    tensors = [(name, torch.rand(shape, dtype=torch.float64)) for name, shape in smollm_statistics()]
    timings = {}
    for mode in ("owner", "all", "owner", "all"):  # interleaved, best of two rounds
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            for name, tensor in tensors:
                if mode == "all":
                    dist.all_reduce(tensor)
                else:
                    dist.reduce(tensor, dst=owners[name])
        dist.barrier()
        elapsed = (time.perf_counter() - start) / repeats
        timings[mode] = min(timings.get(mode, elapsed), elapsed)
    payload = sum(t.numel() * t.element_size() for _, t in tensors)
    if rank == 0:
        Path(result).write_text(json.dumps({"payload_bytes": payload, "seconds": timings}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the SmolLM2-135M-shaped model (30 in the real one)")
    parser.add_argument("--workdir", type=Path, default=Path("bench-work"))
    parser.add_argument("--collectives", action="store_true", help="only time reduce-to-owner against all-reduce (2 gloo ranks)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return (_collectives(args.worker[1]) if args.worker[0] == "collectives" else _worker(*args.worker))
    if args.collectives:
        target = args.workdir.resolve() / "collectives.json"
        command = [sys.executable, "-m", "featcal_llm.benchmark.distributed", "--worker", "collectives", str(target)]
        ranks = launch_world(command, 2, args.workdir.resolve() / "logs-collectives", timeout=600)
        if any(code != 0 for code, _, _ in ranks):
            raise SystemExit(ranks[0][2][-2000:])
        print(target.read_text())
        return None
    from featcal_llm.benchmark.wholerun import PRESETS, WholeRunSpec, build
    import yaml

    preset = {k: v for k, v in PRESETS["smollm2-135m"].items() if k != "lam"}
    spec = WholeRunSpec(**{**preset, "layers": args.layers})
    recipe = build(spec, args.workdir.resolve(), 1e-3, lambda m: print(m, file=sys.stderr))
    results = {}
    for world, threads in ((1, 1), (1, 2), (2, 1)):
        name = f"{world}x{threads}"
        config = yaml.safe_load(recipe.read_text())
        config["featcal"]["output"] = str(recipe.parent / f"out-{name}")
        path = recipe.parent / f"recipe-{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        stem = recipe.parent / f"timing-{name}"
        command = [sys.executable, "-m", "featcal_llm.benchmark.distributed", "--worker", str(path), str(stem)]
        ranks = launch_world(command, world, recipe.parent / f"logs-{name}", threads=threads, timeout=3000)
        if any(code != 0 for code, _, _ in ranks):
            raise SystemExit(f"{name} failed: {ranks[0][2][-2000:]}")
        timings = [json.loads(Path(f"{stem}.rank{r}.json").read_text()) for r in range(world)]
        results[name] = {"seconds": max(t["seconds"] for t in timings), "cpu_seconds": [t["cpu_seconds"] for t in timings],
                         "traffic_per_layer": [t["traffic"][:1] for t in timings]}
    from featcal_llm.benchmark.wholerun import _delta_difference

    results["2x1_vs_1x1_delta"] = _delta_difference(recipe.parent / "out-2x1", recipe.parent / "out-1x1", recipe.parent / "merged")
    base = results["1x1"]["seconds"]
    results["speedup"] = {name: base / results[name]["seconds"] for name in ("1x1", "1x2", "2x1")}
    # on a shared machine: the CPU seconds of the busiest rank, i.e. the wall time each rank would take on a core of its own
    cpu_base = results["1x1"]["cpu_seconds"][0]
    results["cpu_speedup"] = {"1x1": 1.0, "2x1": cpu_base / max(results["2x1"]["cpu_seconds"])}
    results["load_average"] = os.getloadavg()
    results["paper"] = [
        paper_share(3, 1024 * 2048, 2048, 8, 360.0, 60.0, 700.0),  # one node: NVLink (NCCL bus bandwidth ≈ 360 GB/s)
        paper_share(3, 1024 * 2048, 2048, 32, 50.0, 60.0, 700.0),  # 4 nodes: 400 Gb/s per node
        paper_share(3, 64 * 2048, 2048, 32, 50.0, 60.0, 700.0),  # 4 nodes, a light run: 64 sequences per expert
    ]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
