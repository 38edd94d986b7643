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

from featcal_llm import runlog
from featcal_llm.io.names import short_names
from featcal_llm.engine.resume import checkpoint_identity, fingerprint
from featcal_llm.io.identity import sampling_identity
from featcal_llm.io.mergekit_config import merge_config_dict
from featcal_llm.errors import FeatCalError, warn
from featcal_llm.generation.alike import look_alike
from featcal_llm.generation.backends import MIN_TEMPERATURE, TransformersSampler, batch_seed, choose_backend, open_sampler
from featcal_llm.generation.choose import PROBE_SAMPLES, PROBE_STREAM, PROBE_TOKENS, Choice, choose_start
from featcal_llm.generation.prompts import Start, candidate_starts, check_start, read_prompts, resolve_start
from featcal_llm.generation.quality import REASONS, degeneracy
from featcal_llm.generation.store import FORMAT, cached_choice, cached_samples, choice_path, generated_set_paths, store_choice, store_samples
from featcal_llm.io.block import beside_recipe
from featcal_llm.io.recipe import Recipe

MAX_ROUNDS = 3  # a round replaces the samples the quality rule dropped in the one before
DEFAULT_NEW_TOKENS = 512  # capped at featcal.max_length: calibration never sees tokens past it
ONLY_START = "default, the only start left to measure"  # auto, and no other candidate (no chat template, or it fills max_length)
FORCED_MODES = {"on": "chat", "off": "bos", "empty": "empty"}  # chat_template → the mode it forces (the measured ones' names)


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
        "samples": spec.records(featcal.samples),
        "max_new_tokens": generate.max_new_tokens or min(DEFAULT_NEW_TOKENS, featcal.max_length),
        "temperature": generate.temperature and max(generate.temperature, MIN_TEMPERATURE),  # as it samples: sets made otherwise are not reused
        "top_p": generate.top_p,
        "min_p": generate.min_p,
        "seed": featcal.seed if generate.seed is None else generate.seed,
        "batch_size": generate.batch_size,
    }


def device_label(device: torch.device) -> str:
    """`cpu`, or the GPU's model: samples and start choices are reused only on the same kind of device."""
    return device.type if device.type != "cuda" else f"cuda ({torch.cuda.get_device_name(device)})"


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
        "device": device_label(device),
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
                tally.kept.append({"prompt": start.texts[prompt_index], "text": tokenizer.decode(ids), "token_ids": ids,
                                   "prompt_length": len(prompt)})
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
    return f"generation: expert {name}: {record['kept']} samples from the {record['start']} ({how}; dropped {dropped_text}) → {path}"


PROBE_BACKEND = "transformers"  # the start probe always samples with transformers, whatever backend writes the samples


def _choice_key(recipe: Recipe, name: str, sources: dict[str, Any], base: Any, settings: dict, candidates: dict[str, Start],
                device: torch.device, dtype: torch.dtype) -> str:
    """What a start choice depends on: every model of the merge, the merge itself, the probe's sampling, the candidates,
    and where and how the probe runs (dtype, device, backend, remote code), as a sample set's key has them: a choice
    measured in float32 on a CPU is not reused in bf16 on a GPU."""
    models = {"base": [base.identity(), checkpoint_identity(base.directory)]}
    models |= {n: [s.identity(), checkpoint_identity(s.directory)] for n, s in sources.items()}
    probe = {k: settings[k] for k in ("stream", "seed", "temperature", "top_p", "min_p", "max_new_tokens")}
    runs = {"dtype": str(dtype), "device": device_label(device), "backend": PROBE_BACKEND, "trust_remote_code": recipe.featcal.trust_remote_code}
    return fingerprint([FORMAT, "start choice", name, models, merge_config_dict(recipe.merge_config), probe,
                        [PROBE_SAMPLES, PROBE_TOKENS, PROBE_STREAM], {m: [list(i) for i in c.ids] for m, c in candidates.items()}, runs])


def _references(recipe: Recipe, sources: dict[str, Any], base: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype,
                timing: dict[str, float]) -> dict:
    """Loaders of the models the probe compares the expert with: the base, and the merged model (merged now if absent,
    its time in `timing["merge"]`) unless the merge builds its own vocabulary (its token ids are not the expert's)."""
    from featcal_llm.io.forms import changes_tokenizer
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.references import ModelSource

    trust = recipe.featcal.trust_remote_code
    loaders = {"base": lambda: TransformersSampler(base, tokenizer, device, dtype, trust)}
    if not changes_tokenizer(recipe.merge_config):
        def merged():
            began = time.perf_counter()
            directory = ensure_merged(recipe, Path(recipe.featcal.merged), str(device), {str(recipe.base): base, **sources}, trust)
            timing["merge"] = time.perf_counter() - began
            return TransformersSampler(ModelSource(str(directory), directory), tokenizer, device, dtype, trust)
        loaders["merged"] = merged
    return loaders


def crowded_out(candidates: dict[str, Start], max_length: int, name: str) -> dict[str, Start]:
    """The candidate starts whose records would hold some of what the expert writes: a start most of whose prompts fill
    `max_length` (calibration reads a sample's first max_length tokens) is left out of the measurement, which scores
    what the expert writes after the prompt, and says so."""
    crowded = {mode: sum(len(ids) >= max_length for ids in start.ids) for mode, start in candidates.items()}
    left_out = [mode for mode, count in crowded.items() if mode != "bos" and 2 * count > len(candidates[mode].ids)]
    for mode in left_out:
        runlog.stage(f"generation: expert {name}: {candidates[mode].source} left out of the start's measurement: "
                     f"{crowded[mode]} of its {len(candidates[mode].ids)} prompts fill featcal.max_length {max_length}, so "
                     "their records would hold none of what the expert writes")
    return {mode: start for mode, start in candidates.items() if mode not in left_out}


def _start(recipe: Recipe, name: str, sources: dict, base: Any, tokenizer: Any, config: Any, settings: dict,
           samples_path: Path, device: torch.device, dtype: torch.dtype, where: str) -> tuple[Start, str, Choice | None, Any]:
    """The start this expert's samples begin with, its mode, the measured choice (None when the recipe forces the
    start), and the transformers sampler the probe opened (or None), for the samples to reuse."""
    spec = recipe.featcal.data[name].generate
    if spec.prompts is not None:
        prompts_path = beside_recipe(spec.prompts, recipe.path.parent)
        prompts = read_prompts(prompts_path, f"{where}.prompts")
        start = resolve_start(prompts, f"prompts file {prompts_path}", spec.chat_template, tokenizer, config, where)
        return start, "prompts", None, None
    if spec.start is not None or spec.chat_template != "auto":
        start = resolve_start(None, "", spec.chat_template, tokenizer, config, where, spec.start)
        return start, "start token" if spec.start is not None else FORCED_MODES[spec.chat_template], None, None
    candidates = crowded_out(candidate_starts(tokenizer, config, sources[name].directory, where), recipe.featcal.max_length, name)
    if len(candidates) == 1:
        return candidates["bos"], "bos", None, None
    key, path, sampler = _choice_key(recipe, name, sources, base, settings, candidates, device, dtype), choice_path(samples_path), None
    cached = cached_choice(path, key)
    if cached is not None:
        choice = Choice.from_record(cached["choice"])
    else:
        sampler = TransformersSampler(sources[name], tokenizer, device, dtype, recipe.featcal.trust_remote_code)
        timing: dict[str, float] = {}
        try:
            choice = choose_start(candidates, sampler, _references(recipe, sources, base, tokenizer, device, dtype, timing), settings, device)
        except BaseException:
            sampler.close()
            raise
        choice.merge_seconds = timing.get("merge", 0.0)
        choice.seconds -= choice.merge_seconds
        store_choice(path, key, choice.as_record())
    reused = " (measured before)" if cached is not None else f" in {choice.seconds:.1f} s" + (
        f" (and {choice.merge_seconds:.1f} s merging, which calibration needs anyway)" if choice.merge_seconds >= 0.05 else "")
    runlog.stage(f"generation: expert {name}: {choice.describe()}{reused}")
    return candidates[choice.mode], choice.mode, choice, sampler


def _expert_tokenizer(source: Any, name: str, where: str, trust_remote_code: bool) -> Any:
    """The expert's own tokenizer (its EOS ids stop its samples); a missing or unreadable one is a one-line error."""
    from featcal_llm.io.model_files import generating_expert_without_tokenizer
    from featcal_llm.io.tokenizers import load_tokenizer

    directory = source.tokenizer_directory
    return load_tokenizer(directory, where, trust_remote_code, generating_expert_without_tokenizer(directory, name))


def generated_sequences(
    recipe: Recipe, sources: dict[str, Any], configs: dict[str, Any], device: torch.device, dtypes: dict[str, torch.dtype], progress: bool
) -> dict[str, list[list[int]]]:
    """Expert name → token ids of its own samples, for every expert whose data is `generate:`."""
    from featcal_llm.io.references import resolve_source

    featcal = recipe.featcal
    names = [e.name for e in recipe.experts if featcal.data[e.name].generate is not None]
    labels = short_names([e.name for e in recipe.experts])  # what the progress bar calls each expert
    set_paths = generated_set_paths(Path(featcal.output), [e.name for e in recipe.experts])
    base = resolve_source(recipe.base, f"{recipe.path}: base_model")
    places = {name: f"{recipe.path}: featcal.data.{name}.generate" for name in names}
    # every expert's tokenizer and start, before the first expert samples (minutes to hours): what validate cannot read
    # without a tokenizer.json (a SentencePiece model, a vocab.json) is refused before any work, not after the others
    tokenizers = {name: _expert_tokenizer(sources[name], name, places[name], featcal.trust_remote_code) for name in names}
    for name in names:
        check_start(featcal.data[name].generate, tokenizers[name], configs[name], places[name])
    result, written = {}, {}
    for name in names:
        spec, source, tokenizer, where = featcal.data[name].generate, sources[name], tokenizers[name], places[name]
        settings = settings_of(recipe, name)
        samples_path, record_path = set_paths[name]
        start, mode, choice, sampler = _start(recipe, name, sources, base, tokenizer, configs[name], settings, samples_path, device, dtypes[name], where)
        filled = [i for i, ids in enumerate(start.ids) if len(ids) >= featcal.max_length]
        if filled:  # calibration reads the first max_length tokens of a sample: all prompt, none of the expert's text
            warn(f"{where}: {len(filled)} of {len(start.ids)} prompts (prompt {filled[0] + 1}: {len(start.ids[filled[0]])} tokens) "
                 f"fill featcal.max_length {featcal.max_length}, so their records hold none of what the expert writes; "
                 "shorten them or raise max_length")
        backend = choose_backend(spec.backend, device, where)
        key = fingerprint([key_ingredients(source, settings, start, device, dtypes[name], backend) | {"mode": mode}])
        cached = cached_samples(samples_path, record_path, key)
        try:
            if cached is not None:
                samples, record = cached
            else:
                if sampler is None or backend != "transformers":
                    if sampler is not None:
                        sampler.close()
                        sampler = None  # closed: a failed open below must not close it again, hiding its own error
                    sampler = open_sampler(backend, source, tokenizer, device, dtypes[name], featcal.trust_remote_code, settings["seed"])
                tally = _sample(sampler, backend, start, settings, tokenizer, labels[name], progress)
                if not tally.kept:
                    raise FeatCalError(f"{where}: expert {name} wrote no usable sample in {MAX_ROUNDS} rounds (dropped: {dict(tally.dropped)}); change temperature, top_p or the prompts")
                if len(tally.kept) < settings["samples"]:
                    warn(f"{where}: kept {len(tally.kept)} of {settings['samples']} samples after {MAX_ROUNDS} rounds ({dict(tally.dropped)} dropped)")
                samples = tally.kept
                record = store_samples(samples_path, record_path, samples, {
                    "format": FORMAT, "key": key, "expert": name, "backend": backend, "settings": settings,
                    "start": start.source, "start_mode": mode, "start_choice": None if choice is None else choice.as_record(),
                    "chat_template": start.chat, "kept": len(samples), "dropped": dict(tally.dropped),
                    "generated_tokens": tally.tokens, "seconds": round(tally.seconds, 3),
                    "tokens_per_second": round(tally.tokens / max(tally.seconds, 1e-9), 1),
                })
        finally:
            if sampler is not None:
                sampler.close()
        runlog.stage(_summary(name, record, samples_path, cached is not None))
        copies = len(samples) - len({tuple(sample["token_ids"]) for sample in samples})
        if copies and settings["temperature"] == 0:  # greedy: one continuation per prompt, whatever the seed
            warn(f"{where}: {copies} of {len(samples)} samples are copies of others: temperature 0 (greedy) writes one text "
                 f"per prompt, and {len(start.ids)} {'prompt begins' if len(start.ids) == 1 else 'prompts begin'} them here ({start.source}); "
                 "raise temperature, or give as many prompts as samples")
        result[name] = [sample["token_ids"] for sample in samples]
        written[name] = [sample["token_ids"][sample.get("prompt_length", 0) : featcal.max_length] for sample in samples]
    _warn_look_alike(recipe, written)  # what the experts wrote: a prompt every expert shares says nothing about them
    return result


def _warn_look_alike(recipe: Recipe, sets: dict[str, list[list[int]]]) -> None:
    """Experts that differ in kind should calibrate on different text: say so when two generated sets look alike."""
    for first, second, between, within in look_alike(sets):
        warn(
            f"{recipe.path}: featcal.data: the generated sets of {first} and {second} are nearly the same text (token-bigram "
            f"overlap {between:.2f}, against {within:.2f} between halves of one set): FeatCal cannot tell these experts apart on "
            "them; give each expert prompts of its own kind (generate.prompts) or another start (chat_template, start)"
        )


def sampling_records(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """Expert name → the resolved sampling settings of each `generate:` expert (written out in the saved recipe)."""
    return {e.name: settings_of(recipe, e.name) for e in recipe.experts if recipe.featcal.data[e.name].generate is not None}


def start_records(recipe: Recipe) -> dict[str, dict]:
    """Expert name → how its generated set began ({"start", "mode", "chosen_by", "scores"}), from the sets' records."""
    import json

    set_paths = generated_set_paths(Path(recipe.featcal.output), [e.name for e in recipe.experts])
    found = {}
    for expert in recipe.experts:
        if recipe.featcal.data[expert.name].generate is None:
            continue
        try:
            record = json.loads(set_paths[expert.name][1].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        choice, spec = record.get("start_choice"), recipe.featcal.data[expert.name].generate
        forced = spec.prompts is not None or spec.start is not None or spec.chat_template != "auto"
        found[expert.name] = {"start": record.get("start"), "mode": record.get("start_mode"),
                              "chosen_by": "measurement" if choice else "recipe" if forced else ONLY_START,
                              **({"scores": {m: v["score"] for m, v in choice["scores"].items()}} if choice else {})}
    return found
