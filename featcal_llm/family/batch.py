"""A batch of calibration token sequences as a decoder layer sees it: right-padded ids, the mask of real tokens and of response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    input_ids: torch.Tensor  # (batch, seq) int64, right-padded
    keep: torch.Tensor  # (batch, seq) bool, True for real tokens
    response: torch.Tensor | None = None  # (batch, seq) bool, the real tokens a record is scored on; None: every real token

    @property
    def tokens(self) -> int:
        return int(self.keep.sum())
