"""Each `generate:` expert writes its calibration set (or a cached one is reused); the pipeline's entry point."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from featcal_llm.engine.drift import short_names
from featcal_llm.engine.resume import checkpoint_identity, fingerprint
from featcal_llm.io.identity import sampling_identity
from featcal_llm.errors import FeatCalError, warn
from featcal_llm.generation.backends import batch_seed, choose_backend, open_sampler
from featcal_llm.generation.prompts import Start, read_prompts, resolve_start
from featcal_llm.generation.quality import REASONS, degeneracy
from featcal_llm.generation.store import FORMAT, cached_samples, set_paths, store_samples
from featcal_llm.io.recipe import Recipe, beside_recipe

MAX_ROUNDS = 3  # a round replaces the samples the quality rule dropped in the one before


@dataclass
class Tally:
    """What one expert's generation produced, for its record and the log."""

    kept: list[dict]
    dropped: Counter
    tokens: int = 0
    seconds: float = 0.0


def settings_of(recipe: Recipe, name: str) -> dict[str, Any]:
    """The resolved settings a seed reproduces (and the cache key covers).

    The expert's position in the recipe is part of its random stream, so experts given one seed do not draw the
    same random numbers (similar models would otherwise begin their samples alike).
    """
    featcal, spec = recipe.featcal, recipe.featcal.data[name]
    generate = spec.generate
    position = [e.name for e in recipe.experts].index(name)
    return {
        "stream": position,
        "samples": generate.samples or spec.samples or featcal.samples,
        "max_new_tokens": generate.max_new_tokens,
        "temperature": generate.temperature,
        "top_p": generate.top_p,
        "seed": featcal.seed if generate.seed is None else generate.seed,
        "batch_size": generate.batch_size,
    }


def key_ingredients(source: Any, settings: dict, start: Start, device: torch.device, dtype: torch.dtype, backend: str) -> dict[str, Any]:
    """Everything that changes an expert's samples, by name: a stored set is reused only when all of them are equal.

    The model by content (weights, adapter, generation config and tokenizer files: the sampler's EOS ids come from
    them), the resolved settings, the start (chat template and prompt token ids) and where and how it runs (compute
    dtype, device, backend). Not where the files are: a moved or touched model keeps its samples.
    """
    return {
        "format": FORMAT,
        "weights": checkpoint_identity(source.directory),
        "adapter": source.identity().get("adapter"),
        "sampling": sampling_identity(source.directory, source.tokenizer_directory),
        "settings": settings,
        "chat_template": start.chat,
        "prompt_ids": [list(ids) for ids in start.ids],
        "dtype": str(dtype),
        "device": device.type if device.type != "cuda" else f"cuda ({torch.cuda.get_device_name(device)})",
        "backend": backend,
    }


def _sample(sampler: Any, backend: str, start: Start, settings: dict, tokenizer: Any, label: str, progress: bool) -> Tally:
    """Rounds of samples until `samples` pass the quality rule (or MAX_ROUNDS); sample i continues prompt i mod len(prompts)."""
    wanted, special = settings["samples"], set(tokenizer.all_special_ids)
    tally, attempted, began = Tally([], Counter()), 0, time.perf_counter()
    bar = tqdm(total=wanted, desc=f"generate {label}", unit="sample", file=sys.stderr, disable=not progress)
    for round_index in range(MAX_ROUNDS):
        need = wanted - len(tally.kept)
        if need == 0:
            break
        indices = [(attempted + j) % len(start.ids) for j in range(need)]
        size = need if backend == "vllm" else settings["batch_size"]  # vLLM schedules its own batches
        for batch_index, first in enumerate(range(0, need, size)):
            chosen = indices[first : first + size]
            prompts = [start.ids[i] for i in chosen]
            seed = batch_seed(settings["seed"], settings["stream"] * MAX_ROUNDS + round_index, batch_index)
            continuations = sampler.sample(prompts, settings, seed)
            for prompt_index, prompt, continuation in zip(chosen, prompts, continuations):
                tally.tokens += len(continuation)
                reason = degeneracy(continuation, special)
                if reason is not None:
                    tally.dropped[reason] += 1
                    continue
                ids = [*prompt, *continuation]
                tally.kept.append({"prompt": start.texts[prompt_index], "text": tokenizer.decode(ids), "token_ids": ids})
                bar.update(1)
            tally.seconds = time.perf_counter() - began
            bar.set_postfix_str(f"{tally.tokens / max(tally.seconds, 1e-9):.0f} tok/s, dropped {sum(tally.dropped.values())}")
        attempted += need
    bar.close()
    tally.seconds = time.perf_counter() - began
    return tally


def _summary(name: str, record: dict, path: Path, reused: bool) -> str:
    dropped = record["dropped"]
    dropped_text = ", ".join(f"{dropped[r]} {r}" for r in REASONS if dropped.get(r)) or "none"
    if reused:
        how = "reused: same weights, generation config, tokenizer files, settings, prompts, dtype, device and backend"
    else:
        how = f"{record['backend']}, {record['generated_tokens']} tokens in {record['seconds']:.1f} s, {record['tokens_per_second']:.0f} tok/s"
    return f"featcal-llm: generation: expert {name}: {record['kept']} samples from the {record['start']} ({how}; dropped {dropped_text}) → {path}"


def _expert_tokenizer(source: Any, name: str, where: str, trust_remote_code: bool) -> Any:
    """The expert's own tokenizer (its EOS ids stop its samples); a missing or unreadable one is a one-line error."""
    from transformers import AutoTokenizer

    directory = source.tokenizer_directory
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        raise FeatCalError(
            f"{where}: expert {name}: {directory} has no tokenizer files (tokenizer.json or tokenizer_config.json); "
            "an expert that writes its own data needs its tokenizer: copy it into that directory, or give this expert a data file"
        )
    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise FeatCalError(f"{where}: expert {name}: {directory}: cannot load its tokenizer ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None


def generated_sequences(
    recipe: Recipe, sources: dict[str, Any], configs: dict[str, Any], device: torch.device, dtypes: dict[str, torch.dtype], progress: bool
) -> dict[str, list[list[int]]]:
    """Expert name → token ids of its own samples, for every expert whose data is `generate:`."""
    featcal = recipe.featcal
    names = [e.name for e in recipe.experts if featcal.data[e.name].generate is not None]
    labels = short_names([e.name for e in recipe.experts])
    result = {}
    for name in names:
        spec, source = featcal.data[name].generate, sources[name]
        where = f"{recipe.path}: featcal.data.{name}.generate"
        settings = settings_of(recipe, name)
        tokenizer = _expert_tokenizer(source, name, where, featcal.trust_remote_code)
        prompts, prompts_source = None, ""
        if spec.prompts is not None:
            prompts_path = beside_recipe(spec.prompts, recipe.path.parent)
            prompts, prompts_source = read_prompts(prompts_path, f"{where}.prompts"), f"prompts file {prompts_path}"
        start = resolve_start(prompts, prompts_source, spec.chat_template, tokenizer, configs[name], where, spec.start)
        backend = choose_backend(spec.backend, device, where)
        key = fingerprint([key_ingredients(source, settings, start, device, dtypes[name], backend)])
        samples_path, record_path = set_paths(Path(featcal.output), labels[name])
        cached = cached_samples(samples_path, record_path, key)
        if cached is not None:
            samples, record = cached
        else:
            sampler = open_sampler(backend, source, tokenizer, device, dtypes[name], featcal.trust_remote_code, settings["seed"])
            try:
                tally = _sample(sampler, backend, start, settings, tokenizer, labels[name], progress)
            finally:
                sampler.close()
            if not tally.kept:
                raise FeatCalError(f"{where}: expert {name} wrote no usable sample in {MAX_ROUNDS} rounds (dropped: {dict(tally.dropped)}); change temperature, top_p or the prompts")
            if len(tally.kept) < settings["samples"]:
                warn(f"{where}: kept {len(tally.kept)} of {settings['samples']} samples after {MAX_ROUNDS} rounds ({dict(tally.dropped)} dropped)")
            samples = tally.kept
            record = store_samples(samples_path, record_path, samples, {
                "format": FORMAT, "key": key, "expert": name, "backend": backend, "settings": settings,
                "start": start.source, "chat_template": start.chat, "kept": len(samples), "dropped": dict(tally.dropped),
                "generated_tokens": tally.tokens, "seconds": round(tally.seconds, 3),
                "tokens_per_second": round(tally.tokens / max(tally.seconds, 1e-9), 1),
            })
        print(_summary(name, record, samples_path, cached is not None), file=sys.stderr)
        result[name] = [sample["token_ids"] for sample in samples]
    return result
