"""Token weights: each calibration token counts by how much better the expert predicts the text there than the merge.

FeatCal fits the merged model's features to each expert's on every token of
the expert's records, all tokens alike. Where the merge already predicts the
next token as well as the expert, or better (text the other experts also
know, or text the expert itself predicts worse than the merge), that pull
spends the layers' capacity on copying the expert, sometimes on its
weaknesses. Weighing token t of expert i's records by

    a_t = max(0, log p_i(x_{t+1} | x_≤t) − log p_merged(x_{t+1} | x_≤t))

spends it where the expert knows something the merge lost. Label-free: the
next token is the calibration text's own. A token with no successor (the last
of its record) has no advantage. But a token's features are also the keys and
values later tokens attend to, so no token may weigh nothing: a token weighs
half 1 and half its advantage scaled to mean 1 over the expert's tokens,

    w_t = ½ + ½ · a_t / mean(a),

which keeps the statistics' scale (sums over n tokens divided by n stay
weighted means). With all of the weight on the advantage, a synthetic task
whose answers attend to unpredictable prompts lost most of its gain.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def leads(expert_log_probs: torch.Tensor, merged_log_probs: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """expert's − merge's log-probability of the next token where `scored`, else 0 (same shape); negative where it trails."""
    return (expert_log_probs - merged_log_probs) * scored


def advantages(expert_log_probs: torch.Tensor, merged_log_probs: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """a_t = max(0, expert's − merge's log-probability of the next token) where `scored`, else 0 (same shape)."""
    return leads(expert_log_probs, merged_log_probs, scored).clamp(min=0.0)


def judged_tokens(length: int, spans: Iterable[tuple[int, int]]) -> int:
    """How many of a record's tokens the lead is judged on: those whose successor is a response token, inside one of
    the disjoint [start, end) `spans` (every token but the last of plain text, one span [0, length)); the first token
    is no one's successor. engine/scoring.response_positions marks the same positions."""
    return sum(max(0, min(end, length) - max(start, 1)) for start, end in spans)


LEAD_STANDARD_ERRORS = 2.0  # how far below 0 an expert's lead must be before the merge teaches its records


def lead_moments(record_leads: torch.Tensor, record_judged: torch.Tensor) -> list[float]:
    """[records, Σ L, Σ n, Σ L², Σ L·n, Σ n²] over the records with a judged token (L: a record's lead summed over its
    judged tokens, n: how many there are; both (batch,)): sums, so that ranks and batches add them."""
    judged = record_judged > 0
    lead, count = record_leads[judged].double(), record_judged[judged].double()
    return [float(judged.sum()), float(lead.sum()), float(count.sum()), float((lead * lead).sum()), float((lead * count).sum()),
            float((count * count).sum())]


def lead_margin(moments: list[float], standard_errors: float | None = None) -> float:
    """`standard_errors` (LEAD_STANDARD_ERRORS where None) standard errors of the mean lead Σ L / Σ n, with the record as the unit (the ratio estimator's
    delta-method variance: Σ (L − m n)² / ((R − 1) R n̄²)); 0 with fewer than two records, where no spread is measured.

    Tokens of one record are not independent samples (a record is one document in one style), so the uncertainty of an
    expert's lead is counted over its records.
    """
    records, lead, count, lead_sq, lead_count, count_sq = moments
    standard_errors = LEAD_STANDARD_ERRORS if standard_errors is None else standard_errors
    if records < 2 or count <= 0:
        return 0.0
    mean = lead / count
    residual = max(lead_sq - 2 * mean * lead_count + mean * mean * count_sq, 0.0)
    return standard_errors * math.sqrt(residual / ((records - 1) * records)) / (count / records)


def trails(lead: float, margin: float = 0.0) -> bool:
    """Whether an expert is behind the merge on its own records beyond doubt: its mean lead over their judged tokens is
    not above 0 even `margin` (lead_margin: two standard errors) higher.

    Such an expert knows nothing of its text that the merge lacks, on average;
    pulling the merge toward it can only pull the merge back
    (`trailing_experts: merge` lets the merge teach its records instead). One
    whose lead is too close to 0 for its records to tell the sign keeps its
    records (an expert 0.02 behind on 64 calibration records led by 0.09 on
    unseen text of its kind in the broad study); those it trails on weigh 0
    (`trailing_records: drop`).
    """
    return lead + margin <= 0.0


ADVANTAGE_SHARE = 0.5  # of each token's weight; the rest is 1 for every token
TRAILING_RECORD = -1.0  # an advantage below 0 marks the tokens of a record its expert trails the merge on: they weigh 0


def mark_trailing_records(advantage: torch.Tensor, record_leads: torch.Tensor) -> torch.Tensor:
    """`advantage` (batch, seq) with every token of a record whose lead summed over its judged tokens (`record_leads`,
    (batch,): `leads(...).sum(dim=1)`) is below 0 set to TRAILING_RECORD.

    An expert that leads the merge on its records as a whole may still trail it on some of them: a broad expert on
    the kind of text a narrow expert beside it knows better. Pulled toward the expert there, the merge could only be
    pulled back on that kind; weighing those records 0 leaves them to the others (a record with no judged token stays).
    """
    return torch.where((record_leads < 0)[:, None], torch.full_like(advantage, TRAILING_RECORD), advantage)


def marked_trailing(advantage: torch.Tensor) -> torch.Tensor:
    """Whether each row's record (the last dimension its tokens) was marked by `mark_trailing_records`: (batch,) for a
    batch, a 0-d tensor for one record's tokens."""
    return advantage[..., 0] < 0


def mean_one_scale(weight_sum: float, tokens: int) -> float:
    """The factor that gives weights summing to `weight_sum` over `tokens` tokens a mean of 1 (0 when they are all 0)."""
    return tokens / weight_sum if weight_sum > 0 else 0.0


def token_weights(advantage: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """w = (1 − share) + share · a · scale on the kept tokens (`scale`: mean_one_scale over the expert's tokens), 0 on padding.

    Mean 1 over the expert's tokens; 1 on every token of an expert that is nowhere ahead (scale 0); 0 on the tokens of a
    record marked by `mark_trailing_records`.
    """
    counted = keep.to(advantage.dtype) * (advantage >= 0)  # a trailing record's tokens (TRAILING_RECORD) weigh 0
    if scale == 0:
        return counted
    return counted * ((1 - ADVANTAGE_SHARE) + ADVANTAGE_SHARE * scale * advantage)


def weighted_rows(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows times a per-row `scale` (√w, or w), upcast to `dtype` first; unchanged where `scale` is None.

    `dtype` is the statistics' precision: scaled in the compute dtype (bf16 on
    a GPU), each row would be rounded once more before its products. Grams take
    √w on both sides; crosses, moments and sums take w on one side and leave
    the other side's rows as they are, so products are Σ w x yᵀ.
    """
    if scale is None:
        return rows
    wide = torch.promote_types(rows.dtype, dtype)
    return rows.to(wide) * scale.to(device=rows.device, dtype=wide).unsqueeze(1)
