"""The refine stage's records, the tokens each is judged on, and its teachers' next-token distributions (top-k, on the host).

A record is judged where its expert is judged (engine/token_weights.py): on
the tokens of its response for prompt/response records, on every token of
plain text and of generated records (a conversation: every assistant turn's).
Position p predicts token p + 1, so a record of n tokens whose response starts
at r is judged at p = max(r − 1, 0) … n − 2, and a response span [s, e) at
p = max(s − 1, 0) … e − 2.

Teachers run one at a time, each a whole model on the compute device; what
is kept of them is, per judged position, the k most likely next tokens'
log-probabilities (float16), their ids (int32) and the log-mass of every other
token (float32): k · 6 + 4 bytes a token, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from featcal_llm.engine.refine_memory import logit_chunk
from featcal_llm.engine.refine_models import decoder, logits_of
from featcal_llm.io.records import judged_positions as judged_in, response_spans
from featcal_llm.maths.topk_kl import topk_teacher

Key = tuple[str, int]  # (expert, index of the record in that expert's list)


def judged_positions(sequence: list[int]) -> list[int]:
    """The positions whose next token the record is judged on, in order."""
    return judged_in(len(sequence), response_spans(sequence))


@dataclass(frozen=True)
class Padded:
    """Records right-padded into one batch, and the judged positions' mask (rows, then positions, in record order)."""

    keys: list[Key]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    judged: torch.Tensor  # (batch, seq) bool


def pad(keys: list[Key], sequences: dict[str, list[list[int]]]) -> Padded:
    rows = [sequences[task][index] for task, index in keys]
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    judged = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, sequence in enumerate(rows):
        ids[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        attention[row, : len(sequence)] = 1
        judged[row, judged_positions(sequence)] = True
    return Padded(keys, ids, attention, judged)


def micro_batches(keys: list[Key], sequences: dict[str, list[list[int]]], batch_tokens: int) -> Iterator[Padded]:
    """`keys` in order, grouped while the padded batch stays within `batch_tokens` (a longer record alone)."""
    group: list[Key] = []
    longest = 0
    for key in keys:
        length = len(sequences[key[0]][key[1]])
        if group and (len(group) + 1) * max(longest, length) > batch_tokens:
            yield pad(group, sequences)
            group, longest = [], 0
        group.append(key)
        longest = max(longest, length)
    if group:
        yield pad(group, sequences)


def final_hidden(model: torch.nn.Module, batch: Padded, device: torch.device) -> torch.Tensor:
    """The final norm's output at the batch's judged positions: (judged tokens, hidden)."""
    output = decoder(model)(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False)
    return output.last_hidden_state[batch.judged.to(device)]


@dataclass
class TeacherStore:
    """Per record: the teacher's top-k log-probs (float16), token ids (int32) and rest log-mass (float32) at its judged positions."""

    top_k: int
    logp: dict[Key, torch.Tensor]
    ids: dict[Key, torch.Tensor]
    rest: dict[Key, torch.Tensor]

    def batch(self, keys: list[Key]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys' rows concatenated in record order (as `final_hidden` returns them)."""
        return (torch.cat([self.logp[k] for k in keys]), torch.cat([self.ids[k] for k in keys]), torch.cat([self.rest[k] for k in keys]))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in (self.logp, self.ids, self.rest) for t in part.values())

    def as_dict(self) -> dict[str, Any]:
        """For the staging area (torch.save with weights_only-loadable contents)."""
        encode = lambda part: {f"{task}\0{index}": tensor for (task, index), tensor in part.items()}  # noqa: E731
        return {"top_k": self.top_k, "logp": encode(self.logp), "ids": encode(self.ids), "rest": encode(self.rest)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "TeacherStore":
        decode = lambda part: {(key.split("\0")[0], int(key.split("\0")[1])): tensor for key, tensor in part.items()}  # noqa: E731
        return cls(saved["top_k"], decode(saved["logp"]), decode(saved["ids"]), decode(saved["rest"]))


@torch.no_grad()
def teach(store: TeacherStore, model: torch.nn.Module, keys: list[Key], sequences: dict[str, list[list[int]]],
          batch_tokens: int, device: torch.device, autocast: torch.dtype | None) -> None:
    """Add one teacher's top-k distributions at every judged position of `keys` (its own records) to the store."""
    model.eval()
    chunk = logit_chunk(model.config.vocab_size)
    for batch in micro_batches(keys, sequences, batch_tokens):
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            hidden = final_hidden(model, batch, device)
            parts = [topk_teacher(logits_of(model, rows), store.top_k) for rows in hidden.split(chunk)]
        logp = torch.cat([p[0] for p in parts]).cpu() if parts else torch.zeros((0, store.top_k))
        ids = torch.cat([p[1] for p in parts]).cpu() if parts else torch.zeros((0, store.top_k), dtype=torch.long)
        rest = torch.cat([p[2] for p in parts]).cpu() if parts else torch.zeros((0,))
        start = 0
        for key in batch.keys:
            count = len(judged_positions(sequences[key[0]][key[1]]))
            store.logp[key] = logp[start:start + count].to(torch.float16)
            store.ids[key] = ids[start:start + count].to(torch.int32)
            store.rest[key] = rest[start:start + count].float()
            start += count


__all__ = ["Key", "Padded", "TeacherStore", "final_hidden", "judged_positions", "logit_chunk", "micro_batches", "pad", "teach"]
