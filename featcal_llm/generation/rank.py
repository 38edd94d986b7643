"""Where generation runs in a (possibly multi-rank) run: rank 0 generates, every rank gets the same token ids."""

from __future__ import annotations

from typing import Any

import torch

from featcal_llm.errors import FeatCalError


def with_generated(
    comm: Any, recipe: Any, sequences: dict, sources: dict, configs: dict, device: torch.device, dtypes: dict, progress: bool
) -> dict[str, list[list[int]]]:
    """Every expert's sequences in recipe order, those of `generate:` experts written by the experts themselves.

    Rank 0 generates (or reuses the cached sets) and hands the token ids to the others; an error there stops every rank alike.
    """
    featcal = recipe.featcal
    if all(featcal.data[e.name].generate is None for e in recipe.experts):
        return sequences
    generated, error = None, None
    if comm.is_main:
        from featcal_llm.generation.run import generated_sequences

        try:
            generated = generated_sequences(recipe, sources, configs, device, dtypes, progress)
        except FeatCalError as failure:
            error = str(failure)
    comm.agree(None, error)
    generated = comm.broadcast_object(generated)
    return {e.name: sequences[e.name] if e.name in sequences else [s[: featcal.max_length] for s in generated[e.name]] for e in recipe.experts}
