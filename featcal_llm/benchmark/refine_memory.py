"""The refine stage's memory model (engine/refine_memory.py) against a measured run: on the CPU at small shapes, or on a GPU
at a real model's shapes (Llama-3.1-8B's by default there).

A random Llama of the given shape is saved as the merged model and as a teacher (seeded noise on every weight; on a
GPU it is built there in the compute dtype, as a CPU could not hold an 8B model in float32 quickly), and the refine
stage runs on random records (every token judged) with nothing else in the process. On the CPU a thread samples the
process's anonymous resident memory every millisecond (glibc set to return freed memory at once: `live_heap`); on a
GPU PyTorch's allocator counts its peak, for the teachers' pass and for the training apart, and the same thread the
host's (`host_measured`; the runs of 2026-11-28, before glibc was set there too, measured 20.3 GB against the model's
4.6 GB). Printed: the model's
parts and peak, the measured peaks and their ratio (the model is meant as an upper estimate: ratio >= 1), and the
time of each part, with the time of the default run (3 experts x 256 records x 2048 tokens, 40 steps, a quarter of
the records held out) extrapolated from them.

    python -m featcal_llm.benchmark.refine_memory [--hidden 512 --layers 4 --vocab 8192 --params full]
    python -m featcal_llm.benchmark.refine_memory --device cuda --llama-8b --records 16 --length 2048 --steps 4 --json out.json
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import click
import torch


class PeakResident:
    """The process's peak anonymous resident memory while the block runs (RssAnon in /proc/self/status: what it allocated,
    not the pages of the checkpoints it memory-maps, which the page cache can drop)."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def now(self) -> int:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakResident":
        self.start = self.now()
        self.peak = self.start
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


LLAMA_8B = {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "vocab": 128256}
DEFAULT_RUN = {"experts": 3, "records": 256, "length": 2048, "steps": 40, "eval_every": 5, "holdout": 0.25}


def _random_checkpoints(config, root: Path, teachers: int, device: torch.device, dtype: torch.dtype) -> None:
    """The merged model and `teachers` perturbed copies, saved as safetensors checkpoints (built on `device`)."""
    from featcal_llm.tiny import new_tiny_llama, perturbed_copy

    if dtype == torch.float32:
        model = new_tiny_llama(config, seed=0)
        model.save_pretrained(root / "merged")
        for index in range(teachers):
            perturbed_copy(model, seed=10 + index, scale=0.2).save_pretrained(root / f"expert{index}")
        return
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(root / "merged", max_shard_size="5GB")
    generator = torch.Generator(device).manual_seed(10)
    with torch.no_grad():
        for index in range(teachers):
            for parameter in model.parameters():  # the same relative noise as tiny.perturbed_copy, in place
                scale = 0.2 * max(float(parameter.float().abs().mean()), 0.02)
                parameter.add_(torch.randn(parameter.shape, generator=generator, device=device, dtype=dtype) * scale)
            model.save_pretrained(root / f"expert{index}", max_shard_size="5GB")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def live_heap() -> None:
    """Have glibc map each allocation of 64 KiB or more on its own and return freed memory at once, so that the resident
    memory tracks what is allocated (as the GPU allocator's count does) and not what an earlier phase left in the heap:
    without it, the same run measured 280-480 MiB from one process to the next."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: measured as it comes
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


class _Clock:
    """Seconds and calls of the stage's parts (a GPU synchronised at both ends), and the GPU's peak in each."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.calls, self.peaks = device, {}, {}, {}

    def wrap(self, module, name: str):
        original = getattr(module, name)

        def timed(*args, **kwargs):
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
                self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())
                if name == "_teachers":  # the training's peak is counted apart from the teachers' pass
                    torch.cuda.reset_peak_memory_stats()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
            self.calls[name] = self.calls.get(name, 0) + 1
            return result

        setattr(module, name, timed)
        return original


def measure(hidden: int = 512, layers: int = 4, vocab: int = 8192, intermediate: int | None = None, params: str = "full",
            rank: int = 16, records: int = 8, length: int = 128, steps: int = 2, top_k: int = 64, batch_tokens: int = 512,
            workdir: Path | None = None, device: str = "cpu", heads: int = 8, kv_heads: int = 4, experts: int = 2,
            eval_every: int = 1, teacher_checkpoints: int | None = None, gradient_checkpointing: str | bool = "auto") -> dict:
    """Predicted and measured bytes and seconds of one refine stage (float32 on a CPU, bf16 compute on a GPU)."""
    import peft  # noqa: F401  (imported before the baseline: its import is not the stage's memory)
    from transformers import LlamaConfig

    import featcal_llm.engine.refine as stage
    from featcal_llm.engine.refine import RefineJob, refine
    from featcal_llm.engine.refine_memory import Shape, refine_memory
    from featcal_llm.engine.resume import StagingArea
    from featcal_llm.io.block_sections import RefineSpec
    from featcal_llm.io.checkpoint import CheckpointReader

    where = torch.device(device)
    cpu = where.type == "cpu"
    live_heap()  # on a GPU too: the host's resident memory then counts what the stage holds, not what glibc kept
    dtype = torch.float32 if cpu else torch.bfloat16
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max(length * 2, 4096), tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    config.architectures = ["LlamaForCausalLM"]
    if teacher_checkpoints is None:  # on a GPU one teacher checkpoint serves every expert: an 8B model is 16 GB of disk
        teacher_checkpoints = experts if cpu else 1
    clock = _Clock(where)
    originals = {name: clock.wrap(stage, name) for name in ("_teachers", "teach", "train_step", "heldout_kl")}
    originals["save_pass"] = clock.wrap(StagingArea, "save_pass")
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as folder:
            root = Path(folder)
            built = time.perf_counter()
            _random_checkpoints(config, root, teacher_checkpoints, where, dtype)
            built = time.perf_counter() - built
            names = [f"expert{index}" for index in range(experts)]
            # no teacher checkpoint: the merged model teaches itself (a zero KL, the same work and memory)
            readers = {name: CheckpointReader(root / (f"expert{index % teacher_checkpoints}" if teacher_checkpoints else "merged"),
                                              f"expert {name}") for index, name in enumerate(names)}
            generator = torch.Generator().manual_seed(0)
            sequences = {name: [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(records)] for name in names}
            train = {name: rows[: records * 3 // 4] for name, rows in sequences.items()}
            held = {name: rows[records * 3 // 4:] for name, rows in sequences.items()}
            spec = RefineSpec(steps=steps, eval_every=eval_every, patience=steps + 1, params=params, top_k=top_k,
                              batch_records=4 if cpu else 8, lr=1e-4, gradient_checkpointing=gradient_checkpointing,
                              **({"rank": rank} if params == "adapter" else {}))
            projections = frozenset(f"{part}.{p}" for part, ps in (("self_attn", "q_proj k_proj v_proj o_proj"),
                                                                   ("mlp", "gate_proj up_proj down_proj")) for p in ps.split())
            job = RefineJob(spec, 0, batch_tokens, config,
                            CheckpointReader(root / "merged", "merged model"), readers, {}, {}, train, held, projections,
                            where, dtype, StagingArea(root / "staging", "memory"))
            judged = sum(len(row) - 1 for rows in sequences.values() for row in rows)
            shape = Shape.of(config, tied=False)
            resolved = stage.resolve_params(params, shape.parameters(), stage.device_memory(where))
            autocast = stage.refine_dtypes(spec.precision, dtype, where)[1] is not None
            checkpointing = stage.checkpointing_for(job, resolved, autocast, sequences)
            predicted = refine_memory(shape, resolved, rank, min(batch_tokens, 8192), length, top_k, judged, 4 if cpu else 2, cpu=cpu,
                                      autocast=autocast, checkpointing=checkpointing, step_records=spec.batch_records)
            if not cpu:
                torch.cuda.reset_peak_memory_stats()
            with PeakResident() as resident:
                started = time.perf_counter()
                _, report = refine(job)
                seconds = time.perf_counter() - started
    finally:
        for name, original in originals.items():
            setattr(StagingArea if name == "save_pass" else stage, name, original)
    result = {"predicted": predicted, "seconds": seconds, "build_seconds": built, "parameters": shape.parameters(),
              "params": resolved, "gradient_checkpointing": checkpointing, "device": torch.cuda.get_device_name(where) if not cpu else "cpu",
              "parts": {name: {"seconds": round(clock.seconds.get(name, 0.0), 2), "calls": clock.calls.get(name, 0)} for name in originals},
              "sizes": {"experts": experts, "records": records, "length": length, "steps": steps, "eval_every": eval_every,
                        "batch_records": spec.batch_records, "held_out_records": sum(len(v) for v in held.values()),
                        "teacher_checkpoints": teacher_checkpoints},
              "held_out_kl": report["held_out_kl"]}
    if cpu:
        result["measured"] = resident.peak - resident.start
    else:
        result["peak_by_part"] = {"teachers' pass": clock.peaks.get("_teachers", 0), "training": torch.cuda.max_memory_allocated()}
        result["measured"] = max(result["peak_by_part"].values())
        result["reserved"] = torch.cuda.max_memory_reserved()
        result["host_measured"] = resident.peak - resident.start
    result["ratio"] = predicted["peak"] / max(result["measured"], 1)
    result["extrapolated"] = extrapolate(result)
    return result


def extrapolate(result: dict, run: dict = DEFAULT_RUN) -> dict:
    """Seconds of the default run from the measured parts: the teachers' pass scales with every record's tokens, a
    step with the step's records (as measured), a held-out check with the held-out tokens, the saves with the checks."""
    sizes, parts = result["sizes"], result["parts"]
    measured_tokens = sizes["experts"] * sizes["records"] * sizes["length"]
    run_tokens = run["experts"] * run["records"] * run["length"]
    run_held = run_tokens * run["holdout"]
    checks = run["steps"] // run["eval_every"] + 1
    per = lambda name: parts[name]["seconds"] / max(parts[name]["calls"], 1)  # noqa: E731
    held_tokens = sizes["held_out_records"] * sizes["length"]
    forward = parts["teach"]["seconds"]  # the teachers' forwards; the rest of their pass is loading them, once per expert
    teachers = parts["_teachers"]["seconds"] - forward + forward * run_tokens / measured_tokens
    steps = per("train_step") * run["steps"] * sizes["length"] / run["length"]
    checks_s = per("heldout_kl") * checks * run_held / max(held_tokens, 1)
    saves = parts["save_pass"]["seconds"] / max(parts["save_pass"]["calls"], 1) * (checks + 1)
    return {"teachers": round(teachers, 1), "steps": round(steps, 1), "checks": round(checks_s, 1), "saves": round(saves, 1),
            "total": round(teachers + steps + checks_s + saves, 1), "run": run}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", default="cpu", show_default=True, help="cpu, or cuda (bf16 compute, float32 masters)")
@click.option("--llama-8b", is_flag=True, help="Llama-3.1-8B's shapes (overrides --hidden, --layers, --vocab)")
@click.option("--hidden", default=512, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--vocab", default=8192, show_default=True)
@click.option("--params", type=click.Choice(["auto", "full", "adapter"]), default="full", show_default=True)
@click.option("--gradient-checkpointing", type=click.Choice(["auto", "true", "false"]), default="auto", show_default=True,
              help="refine.gradient_checkpointing")
@click.option("--intermediate", type=int, default=None, help="MLP width (default: hidden x 11/4)")
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=4, show_default=True)
@click.option("--experts", default=2, show_default=True)
@click.option("--records", default=8, show_default=True, help="records per expert (a quarter held out)")
@click.option("--length", default=128, show_default=True, help="tokens per record")
@click.option("--steps", default=2, show_default=True)
@click.option("--eval-every", default=1, show_default=True)
@click.option("--batch-tokens", default=512, show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="where the random checkpoints go (a temporary folder)")
@click.option("--teacher-checkpoints", type=int, default=None, help="teacher checkpoints written (default: one per expert on a CPU, one on a GPU; 0: the merged model teaches)")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="write the result here too")
def main(device: str, llama_8b: bool, hidden: int, layers: int, vocab: int, params: str, gradient_checkpointing: str,
         intermediate: int | None, heads: int, kv_heads: int, experts: int, records: int, length: int,
         steps: int, eval_every: int, batch_tokens: int, workdir: Path | None, teacher_checkpoints: int | None, json_path: Path | None) -> None:
    import json

    shape = {"hidden": hidden, "layers": layers, "vocab": vocab, "intermediate": intermediate, "heads": heads, "kv_heads": kv_heads}
    if llama_8b:
        shape = dict(LLAMA_8B)
    result = measure(**shape, params=params, records=records, length=length, batch_tokens=batch_tokens, device=device, experts=experts,
                     steps=steps, eval_every=eval_every, workdir=workdir, teacher_checkpoints=teacher_checkpoints,
                     gradient_checkpointing=gradient_checkpointing if gradient_checkpointing == "auto" else gradient_checkpointing == "true")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    mib = 2**20
    print(f"{result['parameters'] / 1e6:.1f} M parameters on {result['device']}, params {result['params']}, gradient checkpointing "
          f"{'on' if result['gradient_checkpointing'] else 'off'}, {result['seconds']:.1f} s "
          f"(checkpoints built in {result['build_seconds']:.1f} s)")
    for part, value in result["predicted"].items():
        print(f"  predicted {part:<40} {value / mib:9.1f} MiB")
    what = "measured peak above the stage's start" if device == "cpu" else "measured GPU peak (allocated)"
    print(f"  {what:<50} {result['measured'] / mib:9.1f} MiB  (prediction / measured: {result['ratio']:.2f})")
    if "reserved" in result:
        print(f"  {'GPU peak reserved by the allocator':<50} {result['reserved'] / mib:9.1f} MiB; by part: "
              + ", ".join(f"{k} {v / mib:.0f}" for k, v in result["peak_by_part"].items()))
    print("  seconds: " + ", ".join(f"{k} {v['seconds']} ({v['calls']} calls)" for k, v in result["parts"].items()))
    e = result["extrapolated"]
    print(f"  the default run ({e['run']}) extrapolated: teachers {e['teachers']} s, steps {e['steps']} s, checks {e['checks']} s, "
          f"saves {e['saves']} s, total {e['total']} s")


if __name__ == "__main__":
    main()
