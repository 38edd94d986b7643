"""What a study's row really ran with, read from its own output and log, never from today's defaults.

A calibrated checkpoint records what its run resolved: ``featcal_weights.json`` (hyper-parameters and settings, the
card's numbers at full precision), ``featcal_recipe.yml`` (the recipe as it replays) and, after ``refine:``,
``featcal_refine.json``. The experts' signed leads over the merge on their own calibration records (which decide
``trailing_experts: merge``) are printed by the run's log line ``... (net of where it trails: +0.123)``. A results
file built from these stays true when the product's defaults change later.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

WEIGHTS_FILE = "featcal_weights.json"
RECIPE_FILE = "featcal_recipe.yml"
REFINE_FILE = "featcal_refine.json"
# the token-weight pass's log line: "<name> ahead on 71% of its tokens, by 0.412 nats a token on average (net of where
# it trails: +0.301 ± 0.052)", without the margin before it was logged; names have no ';'
_LEAD = re.compile(r"(?:^|[:;] )([^;:]+?) ahead on \d+% of its tokens, by [-+0-9.e]+ nats a token on average "
                   r"\(net of where it trails(?:, on its responses)?: ([-+0-9.e]+)(?: ± ([0-9.e]+))?\)")

_MERGED = re.compile(r"merged in (\d+) s")


def record_leads(log_text: str) -> dict[str, float] | None:
    """Each expert's signed mean lead over the merge on its calibration records, from the run's last such log line."""
    lines = [line for line in log_text.splitlines() if "net of where it trails" in line]
    if not lines:
        return None
    return {name.strip(): float(value) for name, value, _ in _LEAD.findall(lines[-1])}


def record_lead_margins(log_text: str) -> dict[str, float] | None:
    """Two standard errors of each expert's lead (trailing_experts' margin), where the run's log gives them."""
    lines = [line for line in log_text.splitlines() if "net of where it trails" in line]
    margins = {name.strip(): float(margin) for name, _, margin in _LEAD.findall(lines[-1]) if margin} if lines else {}
    return margins or None


def effective(weights: dict, refine: dict | None = None) -> dict:
    """The settings a run resolved, from its ``featcal_weights.json`` (and ``featcal_refine.json``), in the keys the
    results files have always used."""
    hyper, settings = weights.get("hyperparameters", {}), weights.get("settings", {})
    out = {"expert_weights": settings.get("expert_weights"), "token_weights": settings.get("token_weights"),
           "lambda": hyper.get("lambda"), "alpha": hyper.get("alpha"), "rho": hyper.get("rho"),
           "samples": settings.get("samples"), "head": _head(settings.get("head")),
           "trailing_experts": settings.get("trailing_experts"), "unchanged": bool(weights.get("unchanged", False))}
    if "expert_weights" in weights:
        out["data_weights"] = weights["expert_weights"]
    if refine is not None:
        out["refine"] = {key: refine.get(key) for key in ("params", "lr", "max_steps", "steps_run", "chosen_step", "rank",
                                                          "top_k", "autocast") if key in refine}
    return out


def _head(head) -> str | dict | None:
    """The card's head setting: absent (not re-fitted) reads "false"."""
    return "false" if head in (None, False) else head


def run_record(output: Path, logfile: Path | None = None) -> dict:
    """A row's provenance: the recipe's featcal: block as replayed, what the run resolved, and the logged leads."""
    weights = json.loads((output / WEIGHTS_FILE).read_text())
    refine = json.loads((output / REFINE_FILE).read_text()) if (output / REFINE_FILE).exists() else None
    replay = yaml.safe_load((output / RECIPE_FILE).read_text())
    out = {"featcal": replay.get("featcal"), "featcal_effective": effective(weights, refine), "card": weights}
    if refine is not None:
        out["refine"] = refine
    text = logfile.read_text() if logfile is not None and logfile.exists() else ""
    leads = record_leads(text)
    if leads:
        out["record_leads"] = leads
    margins = record_lead_margins(text)
    if margins:
        out["record_lead_margins"] = margins
    merged = _MERGED.search(text)
    if merged:  # this run merged first: the merge's own seconds, part of its wall time
        out["merge_seconds"] = float(merged.group(1))
    return out
