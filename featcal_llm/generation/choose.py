"""Where an expert begins its samples when nothing in the recipe forces it (`chat_template: auto`, no prompts, no start).

Calibration wants inputs on which each expert behaves as itself. Whether that is text written from the BOS token or
answers to chat prompts depends on how the expert was made (fine-tuned on raw text or on chat pairs), which no config
says; so it is measured. Each candidate start gets PROBE_SAMPLES short samples (at most PROBE_TOKENS new tokens), and
on the positions the expert wrote we take the mean KL(expert ‖ base) and the mean KL(expert ‖ merged) between the
next-token distributions. A start's score is the smaller of the two: behaviour that is the expert's own is new
against the base (what its fine-tuning added) and missing from the merged model (what the merge lost). A start in which
all experts drift alike from the base (a skill they all forgot) scores low against the merge; one where the merge
follows another expert scores low against the base. The start with the highest score wins (ties: the earlier in
MODES order), and every sample begins from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from featcal_llm.generation.backends import batch_seed
from featcal_llm.generation.prompts import Start

PROBE_SAMPLES = 8
PROBE_TOKENS = 64
PROBE_STREAM = 1_000_000  # probe seeds never coincide with the seeds of the samples that are kept
MODES = ("bos", "chat", "empty", "config")  # the candidate starts, in tie-break order


@dataclass
class Choice:
    """The chosen start and what decided it, for the log, the record and the card."""

    mode: str
    scores: dict[str, dict[str, float]]  # mode → {"base": mean KL, "merged": mean KL, "score": the smaller}
    sources: dict[str, str]  # mode → the start's description ("BOS token", "shipped seed prompts", ...)
    seconds: float = 0.0
    probe_tokens: int = 0
    references: list[str] = field(default_factory=list)
    merge_seconds: float = 0.0  # merging for the reference, done here instead of later: not the measurement's cost

    def as_record(self) -> dict[str, Any]:
        return {"mode": self.mode, "scores": self.scores, "sources": self.sources, "seconds": round(self.seconds, 3),
                "probe_tokens": self.probe_tokens, "references": self.references,
                "merge_seconds": round(self.merge_seconds, 3)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Choice":
        return cls(record["mode"], record["scores"], record["sources"], record["seconds"], record["probe_tokens"], record["references"],
                   record.get("merge_seconds", 0.0))

    def _scored(self, mode: str) -> str:
        return f"{self.sources[mode]} {self.scores[mode]['score']:.3g}"

    def describe(self) -> str:
        """`chose BOS token (KL vs base 0.52, vs merged 0.41; shipped seed prompts 0.05)`: the winner's KLs, the others' scores."""
        won = self.scores[self.mode]
        parts = ", vs ".join(f"{name} {won[name]:.3g}" for name in self.references)
        others = "; ".join(self._scored(m) for m in self.scores if m != self.mode)
        return f"chose {self.sources[self.mode]} (KL vs {parts}" + (f"; {others}" if others else "") + ")"


def kl_rows(expert_log_probs: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """KL(expert ‖ reference) at each position (rows): Σ_v p(v) (log p(v) − log q(v)).

    Over the vocabulary both share (the first min(V, V') ids, renormalised) when one model has added tokens.
    """
    width = min(expert_log_probs.shape[-1], reference_logits.shape[-1])
    p = expert_log_probs[:, :width].double()
    if width < expert_log_probs.shape[-1]:
        p = torch.log_softmax(p, dim=-1)
    q = torch.log_softmax(reference_logits[:, :width].double(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1).clamp_(min=0.0)


def written_logits(model: Any, rows: list[tuple[tuple[int, ...], list[int]]], device: torch.device, chunk: int = PROBE_SAMPLES) -> list[torch.Tensor]:
    """Per (prompt, continuation) row: the model's logits at the positions that predict each continuation token.

    One forward pass per `chunk` rows, right-padded (padding after a row's tokens changes none of its logits)."""
    found = []
    for first in range(0, len(rows), chunk):
        part = rows[first : first + chunk]
        sequences = [[*prompt, *continuation] for prompt, continuation in part]
        width = max(len(sequence) for sequence in sequences)
        ids = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for index, sequence in enumerate(sequences):
            ids[index, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
            mask[index, : len(sequence)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        found += [logits[index, len(prompt) - 1 : len(prompt) - 1 + len(continuation)].float().cpu() for index, (prompt, continuation) in enumerate(part)]
    return found


def probe_prompts(start: Start, count: int = PROBE_SAMPLES) -> list[tuple[int, ...]]:
    """`count` prompts spread evenly over the start's prompts (all the same for a single start token)."""
    total = len(start.ids)
    return [start.ids[(index * total) // count] for index in range(count)]


def choose_start(
    candidates: dict[str, Start], sampler: Any, references: dict[str, Callable[[], Any]], settings: dict, device: torch.device
) -> Choice:
    """Probe every candidate with the expert's `sampler` (a TransformersSampler), score against each reference, pick.

    `references` maps a name ("base", "merged") to a loader returning an object with `.model` and `.close()`; they
    are loaded one at a time, so at most two models are in memory at once.
    """
    began = time.perf_counter()
    probe_settings = {**settings, "max_new_tokens": min(PROBE_TOKENS, settings["max_new_tokens"])}
    modes = [mode for mode in MODES if mode in candidates]
    prompts = [prompt for mode in modes for prompt in probe_prompts(candidates[mode])]
    # one batch for every start's probes: half the decoding steps of one batch per start
    written = sampler.sample(prompts, probe_settings, batch_seed(settings["seed"], PROBE_STREAM + settings["stream"], 0))
    rows = list(zip(prompts, written))
    owner = [mode for mode in modes for _ in range(PROBE_SAMPLES)]
    expert_log_probs = [torch.log_softmax(logits, dim=-1) for logits in written_logits(sampler.model, rows, device)]
    tokens = sum(len(continuation) for continuation in written)
    scores: dict[str, dict[str, float]] = {mode: {} for mode in modes}
    for name, load in references.items():
        reference = load()
        try:
            kl = [kl_rows(lp, logits) for lp, logits in zip(expert_log_probs, written_logits(reference.model, rows, device))]
        finally:
            reference.close()
        for mode in modes:
            scores[mode][name] = float(torch.cat([k for k, m in zip(kl, owner) if m == mode]).mean())
    for values in scores.values():
        values["score"] = min(values[name] for name in references)
    mode = max(modes, key=lambda m: (scores[m]["score"], -MODES.index(m)))
    return Choice(mode, scores, {m: candidates[m].source for m in modes}, time.perf_counter() - began, tokens, list(references))
