"""What a run's weights follow from, as settings: the fingerprint's part (resolved_settings) and what the output keeps
of it (made_from), so that `run --eval-only` scores an output only under the recipe it was made from."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

FEATCAL_PREFIX = "featcal."


def resolved_settings(featcal: Any) -> dict[str, Any]:
    """The block as the run uses it: every default filled in (a default changed between a crash and its resume must not
    resume under the other setting), minus what does not change the weights.

    Of `refine:` only whether it runs counts (it holds records out of the closed form): its keys change the refinement
    alone, which checks them against its own saved progress and teachers (engine/refine.py). So a run interrupted in
    its refinement (out of memory, say) and rerun with `gradient_checkpointing: true` or `params: adapter` keeps
    its calibrated layers, 15-18 minutes at 8B, and refines again from them.
    """
    settings = featcal.model_dump(mode="json", exclude={"output", "eval", "device", "host_memory_gb", "merged", "license", "refine",
                                                         "teachers"})
    settings.update(expert_weights=featcal.balancing, token_weights=featcal.token_weighting, trailing_experts=featcal.trailing,
                    tune=featcal.tune_settings().model_dump(mode="json"),
                    holds_out=featcal.holds_out, refine=featcal.refine is not None)
    if featcal.teaching != "own":  # a key added later: absent where it has its old behaviour, so earlier outputs still match
        settings["teachers"] = featcal.teaching
    return settings


def made_from(featcal: Any, mergekit_part: dict) -> dict[str, str]:
    """Per setting, as a recipe names it (`featcal.lambda`, `merge_method`), a digest of its value: the block's
    (resolved_settings, `refine:`'s keys included) and the recipe's mergekit part as written. Digests, since the
    output is published and the values hold local paths. Where the output is, where the merge is kept, the device
    and the `eval:` block are not among them: they change no weight."""
    aliases = {name: field.alias for name, field in type(featcal).model_fields.items() if field.alias}  # lambda_ → lambda
    settings = {FEATCAL_PREFIX + aliases.get(key, key): value for key, value in resolved_settings(featcal).items()}
    settings[FEATCAL_PREFIX + "refine"] = None if featcal.refine is None else featcal.refine.model_dump(mode="json", by_alias=True)
    settings.update(mergekit_part)
    return {str(key): _digest(value) for key, value in settings.items()}


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def changed_settings(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """The settings whose values differ, sorted."""
    return sorted(key for key in set(recorded) | set(current) if recorded.get(key) != current.get(key))


def settings_digest(settings: dict[str, str]) -> str:
    """One digest for all of made_from's."""
    return _digest(settings)


# A saved recipe (featcal_recipe.yml) writes out what the run resolved (`auto` precisions, data fields, paths found
# beside the recipe, a search's choices), so its settings differ from the recipe it replays although the weights are
# the same. This line ties the two: a run of the saved recipe records the first recipe's settings as its own root, and
# `run --eval-only` compares roots. An edited saved recipe no longer has the settings the line names, so it roots itself.
REPLAY_LINE = "# featcal-llm: these settings ({own}) replay the settings {root}; run --eval-only takes either recipe\n"
_REPLAY_LINE = re.compile(r"^# featcal-llm: these settings \(([0-9a-f]{16})\) replay the settings ([0-9a-f]{16});.*\n?", re.M)


def settings_root(text: str, settings: dict[str, str]) -> str:
    """The digest of the settings a recipe's weights were first made from: those of the recipe its replay line names,
    where the recipe still has the settings the line was written for; else its own."""
    own = settings_digest(settings)
    return next((root for replayed, root in _REPLAY_LINE.findall(text) if replayed == own), own)


def with_replay_line(text: str, root: str, settings: dict[str, str]) -> str:
    """The saved recipe's text with its replay line (any earlier one dropped); none where it replays itself."""
    text = _REPLAY_LINE.sub("", text)
    own = settings_digest(settings)
    return text if own == root else text.rstrip("\n") + "\n" + REPLAY_LINE.format(own=own, root=root)


__all__ = ["changed_settings", "made_from", "resolved_settings", "settings_digest", "settings_root", "with_replay_line"]
