"""The refine stage's memory model (engine/refine_memory.py) against a measured CPU run at small shapes.

A random Llama of the given shape is saved as the merged model and as two experts (seeded noise), and the refine
stage runs on random records (every token judged) with nothing else in the process; a thread samples the process's
anonymous resident memory every millisecond. Printed: the model's parts and peak, the measured peak above the resident memory
before the stage, and their ratio (the model is meant as an upper estimate: ratio ≥ 1).

    python -m featcal_llm.benchmark.refine_memory [--hidden 512 --layers 4 --vocab 8192 --params full]
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


def measure(hidden: int = 512, layers: int = 4, vocab: int = 8192, intermediate: int | None = None, params: str = "full",
            rank: int = 16, records: int = 8, length: int = 128, steps: int = 2, top_k: int = 64, batch_tokens: int = 512,
            workdir: Path | None = None) -> dict:
    """Predicted and measured bytes of one refine stage on the CPU, float32."""
    import peft  # noqa: F401  (imported before the baseline: its import is not the stage's memory)
    from transformers import LlamaConfig

    from featcal_llm.engine.refine import RefineJob, refine
    from featcal_llm.engine.refine_memory import Shape, refine_memory
    from featcal_llm.engine.resume import StagingArea
    from featcal_llm.io.block import RefineSpec
    from featcal_llm.io.checkpoint import CheckpointReader
    from featcal_llm.tiny import new_tiny_llama, perturbed_copy

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=length * 2,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["LlamaForCausalLM"]
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        root = Path(folder)
        model = new_tiny_llama(config, seed=0)
        model.save_pretrained(root / "merged")
        experts = {}
        for index in range(2):
            name = f"expert{index}"
            perturbed_copy(model, seed=10 + index, scale=0.2).save_pretrained(root / name)
            experts[name] = CheckpointReader(root / name, f"expert {name}")
        del model
        generator = torch.Generator().manual_seed(0)
        sequences = {name: [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(records)] for name in experts}
        train = {name: rows[: records * 3 // 4] for name, rows in sequences.items()}
        held = {name: rows[records * 3 // 4:] for name, rows in sequences.items()}
        spec = RefineSpec(steps=steps, eval_every=1, patience=steps + 1, params=params, rank=rank, top_k=top_k, batch_records=4, lr=1e-4)
        job = RefineJob(spec, "float32", 0, batch_tokens, config, CheckpointReader(root / "merged", "merged model"), experts, {}, {},
                        train, held, frozenset(f"{part}.{p}" for part, ps in (("self_attn", "q_proj k_proj v_proj o_proj"), ("mlp", "gate_proj up_proj down_proj")) for p in ps.split()),
                        torch.device("cpu"), torch.float32, StagingArea(root / "staging", "memory"))
        judged = sum(len(row) - 1 for rows in sequences.values() for row in rows)
        predicted = refine_memory(Shape.of(config, tied=False), params, rank, min(batch_tokens, 8192), length, top_k, judged, 4, cpu=True)
        with PeakResident() as resident:
            started = time.perf_counter()
            refine(job)
            seconds = time.perf_counter() - started
    measured = resident.peak - resident.start
    return {"predicted": predicted, "measured": measured, "ratio": predicted["peak"] / max(measured, 1), "seconds": seconds,
            "parameters": Shape.of(config, tied=False).parameters()}


@click.command()
@click.option("--hidden", default=512, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--vocab", default=8192, show_default=True)
@click.option("--params", type=click.Choice(["full", "adapter"]), default="full", show_default=True)
@click.option("--records", default=8, show_default=True, help="records per expert (two experts)")
@click.option("--length", default=128, show_default=True, help="tokens per record")
@click.option("--batch-tokens", default=512, show_default=True)
def main(hidden: int, layers: int, vocab: int, params: str, records: int, length: int, batch_tokens: int) -> None:
    result = measure(hidden=hidden, layers=layers, vocab=vocab, params=params, records=records, length=length, batch_tokens=batch_tokens)
    mib = 2**20
    print(f"{result['parameters'] / 1e6:.1f} M parameters, params {params}, {result['seconds']:.1f} s")
    for part, value in result["predicted"].items():
        print(f"  predicted {part:<40} {value / mib:9.1f} MiB")
    print(f"  measured peak above the stage's start         {result['measured'] / mib:9.1f} MiB  (prediction / measured: {result['ratio']:.2f})")


if __name__ == "__main__":
    main()
