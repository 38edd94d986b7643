"""What measuring the start costs against the generation it steers, on a real model (CPU).

``python -m studies.start_cost --model DIR [--samples 256] [--max-new-tokens 512]`` times, with the model as the
expert and as both references (the cost does not depend on what the models learnt): the whole start measurement
(`choose_start`: probes from every candidate start, the two reference models loaded and scored), and one batch of
`--batch` samples of `--measure-tokens` new tokens from BOS; the generation of `--samples` samples of
`--max-new-tokens` tokens is extrapolated from that batch's tokens per second (decoding slows as the context
grows, so the extrapolation underestimates the generation and overstates the measurement's share).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies.start_cost")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--measure-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from featcal_llm.generation.backends import TransformersSampler
    from featcal_llm.generation.choose import choose_start
    from featcal_llm.generation.prompts import candidate_starts
    from featcal_llm.io.references import ModelSource

    device, dtype = torch.device("cpu"), torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    source = ModelSource(str(args.model), args.model)
    candidates = candidate_starts(tokenizer, AutoConfig.from_pretrained(args.model), args.model, "study")
    settings = {"stream": 0, "seed": 0, "temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch}
    started = time.perf_counter()
    sampler = TransformersSampler(source, tokenizer, device, dtype, False)
    load = time.perf_counter() - started
    references = {name: (lambda: TransformersSampler(source, tokenizer, device, dtype, False)) for name in ("base", "merged")}
    choice = choose_start(candidates, sampler, references, settings, device)
    started = time.perf_counter()
    out = sampler.sample([candidates["bos"].ids[0]] * args.batch, {**settings, "max_new_tokens": args.measure_tokens}, seed=1)
    batch_seconds = time.perf_counter() - started
    tokens = sum(len(c) for c in out)
    per_second = tokens / batch_seconds
    generation = args.samples * args.max_new_tokens / per_second
    result = {
        "model": str(args.model), "candidates": list(candidates), "expert_load_seconds": round(load, 2),
        "choice_seconds": round(choice.seconds, 2), "probe_tokens": choice.probe_tokens,
        "batch": args.batch, "batch_tokens": tokens, "batch_seconds": round(batch_seconds, 2), "tokens_per_second": round(per_second, 1),
        "samples": args.samples, "max_new_tokens": args.max_new_tokens, "generation_seconds_extrapolated": round(generation, 1),
        "choice_share_of_generation": round(choice.seconds / generation, 4), "threads": torch.get_num_threads(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
