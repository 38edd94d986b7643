"""Sampling continuations from one expert: vLLM on a GPU when installed, else transformers `generate` with a KV cache.

Both take the prompt token ids and return the continuation token ids per
sample (up to and including the EOS that ended it). vLLM gets one seed per
request, so its samples do not depend on how it schedules them; transformers
samples by the Gumbel-max trick with one generator per batch, so a seed
reproduces its samples for a given `batch_size` on one machine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from featcal_llm import runlog
from featcal_llm.engine.devices import release_memory
from featcal_llm.errors import FeatCalError
from featcal_llm.hardware import vllm_refusal


def choose_backend(requested: str, device: torch.device, where: str) -> str:
    """auto → vLLM where it can run (installed, CUDA device), else transformers; an impossible request is an error."""
    if requested == "transformers":
        return requested
    refusal = vllm_refusal(device.type == "cuda")
    if requested == "vllm" and refusal is not None:
        raise FeatCalError(f"{where}.backend: {refusal}")
    return "vllm" if refusal is None else "transformers"


def batch_seed(seed: int, round_index: int, batch_index: int) -> int:
    """A distinct, reproducible seed per batch (and per request for vLLM)."""
    return (seed * 1_000_003 + round_index * 10_007 + batch_index) % 2**63


def _cut(continuation: list[int], eos_ids: set[int]) -> list[int]:
    """The continuation up to and including its first EOS (transformers pads finished rows with the pad id after it)."""
    for index, token in enumerate(continuation):
        if token in eos_ids:
            return continuation[: index + 1]
    return continuation


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, padded on the left so every row's next token is at the same position."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def eos_ids_of(model_config: Any, generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a sample: the generation config's EOS (often several for chat models), the model's, the tokenizer's."""
    found: list[int] = []
    for value in (getattr(generation_config, "eos_token_id", None), getattr(model_config, "eos_token_id", None), tokenizer.eos_token_id):
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and item not in found:
                found.append(item)
    return found


class GumbelSampling:
    """A logits processor that turns greedy search into sampling: argmax(scores + Gumbel noise) is an exact draw from
    softmax(scores) (the Gumbel-max trick, as vLLM samples). On a CPU `torch.multinomial` over a 49k vocabulary took
    36 ms of a 87 ms decode step at batch 32; the noise costs about 8. Its own generator makes a batch's samples
    depend only on its seed."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = torch.empty(scores.shape, dtype=torch.float32, device=scores.device).uniform_(generator=self.generator)
        exponential = uniform.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()  # E = −log U ~ Exp(1); uniform_ is 6× faster than exponential_
        return scores.float() - exponential.log_()  # −log E is Gumbel(0, 1); −inf (filtered) stays −inf


MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: it samples a temperature in (0, 0.01) at 0.01 (lower overflows the scores)


def sampling_processors(settings: dict, generator: torch.Generator):
    """Temperature (at least MIN_TEMPERATURE, as vLLM), then min-p, then top-p (vLLM's order), then the Gumbel draw
    (none for temperature 0: greedy)."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopPLogitsWarper

    if settings["temperature"] == 0:
        return LogitsProcessorList()
    processors = [TemperatureLogitsWarper(max(settings["temperature"], MIN_TEMPERATURE))]
    if settings["min_p"] > 0.0:
        processors.append(MinPLogitsWarper(settings["min_p"]))
    if settings["top_p"] < 1.0:
        processors.append(TopPLogitsWarper(settings["top_p"]))
    return LogitsProcessorList([*processors, GumbelSampling(generator)])


class TransformersSampler:
    """One expert loaded with transformers (a LoRA adapter merged in through peft), sampled in batches."""

    def __init__(self, source: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        bar = transformers_logging.is_progress_bar_enabled()
        if runlog.verbosity() == runlog.QUIET:  # `run -q`: no loading bar either
            transformers_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, trust_remote_code=trust_remote_code)
        finally:
            if bar:
                transformers_logging.enable_progress_bar()
        if source.adapter is not None:
            from peft import PeftModel

            from featcal_llm.io.lora import peft_quietly

            with peft_quietly():
                model = PeftModel.from_pretrained(model, source.adapter).merge_and_unload()
        self.eos_ids = eos_ids_of(model.config, model.generation_config, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_ids[0] if self.eos_ids else 0)
        # The checkpoint's generation_config.json would fill every setting we leave unset (a repetition
        # penalty, min_p, ...): only the documented settings and transformers' neutral defaults decide.
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id)
        self.model = model.to(device).eval()
        self.device = device

    def sample(self, prompts: Sequence[Sequence[int]], settings: dict, seed: int) -> list[list[int]]:
        from transformers import GenerationConfig

        config = GenerationConfig(  # ours, not the expert's generation_config.json: the documented settings decide
            do_sample=False,  # greedy search over Gumbel-perturbed scores: sampling (sampling_processors)
            max_new_tokens=settings["max_new_tokens"],
            eos_token_id=self.eos_ids or None,
            pad_token_id=self.pad_id,
            use_cache=True,  # in the config: transformers 5 warns about generation kwargs given beside a generation_config
        )
        ids, mask = left_padded(prompts, self.pad_id, self.device)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                      logits_processor=sampling_processors(settings, generator))
        width = ids.shape[1]
        return [_cut(row[width:].tolist(), set(self.eos_ids)) for row in out]

    def close(self) -> None:
        del self.model
        release_memory()


class VllmSampler:
    """One vLLM engine for one expert, freed (with its GPU memory) before calibration starts."""

    def __init__(self, source: Any, tokenizer_dir: Any, dtype: torch.dtype, trust_remote_code: bool, seed: int):
        from vllm import LLM

        lora = {}
        if source.adapter is not None:
            from featcal_llm.io.lora import load_lora_config

            config = load_lora_config(source.adapter, "LoRA adapter")
            ranks = [config.r, *getattr(config, "rank_pattern", {}).values()]
            lora = {"enable_lora": True, "max_lora_rank": max(ranks)}
        self.source = source
        self.llm = LLM(
            model=str(source.directory), tokenizer=str(tokenizer_dir), dtype=str(dtype).removeprefix("torch."),
            seed=seed, trust_remote_code=trust_remote_code, **lora,
        )

    def sample(self, prompts: Sequence[Sequence[int]], settings: dict, seed: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        lora_request = None
        if self.source.adapter is not None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest("expert", 1, str(self.source.adapter))
        params = [
            SamplingParams(
                temperature=settings["temperature"], top_p=settings["top_p"], min_p=settings["min_p"], top_k=-1,
                max_tokens=settings["max_new_tokens"], seed=batch_seed(seed, 0, index),
            )
            for index in range(len(prompts))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, lora_request=lora_request, use_tqdm=True)
        return [list(output.outputs[0].token_ids) for output in outputs]

    def close(self) -> None:
        del self.llm
        try:  # older engines keep the model-parallel groups alive until told
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001 - best effort: newer engines free themselves
            pass
        release_memory()


def open_sampler(backend: str, source: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype, trust_remote_code: bool, seed: int):
    started = time.perf_counter()
    if backend == "vllm":
        sampler = VllmSampler(source, source.tokenizer_directory, dtype, trust_remote_code, seed)
    else:
        sampler = TransformersSampler(source, tokenizer, device, dtype, trust_remote_code)
    runlog.stage(f"generation: {backend} loaded {source.reference} in {time.perf_counter() - started:.1f} s")
    return sampler
