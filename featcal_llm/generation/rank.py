"""Where generation runs in a (possibly multi-rank) run: rank 0 generates, every rank gets the same token ids."""

from __future__ import annotations

from typing import Any

import torch


def with_generated(
    comm: Any, recipe: Any, sequences: dict, sources: dict, configs: dict, device: torch.device, dtypes: dict, progress: bool
) -> dict[str, list[list[int]]]:
    """Every expert's sequences in recipe order, those of `generate:` experts written by the experts themselves.

    Rank 0 generates (or reuses the cached sets) and hands the token ids to the others; an error there stops every rank alike.
    """
    featcal = recipe.featcal
    if all(featcal.data[e.name].generate is None for e in recipe.experts):
        return sequences
    def generate() -> dict[str, list[list[int]]]:
        from featcal_llm.generation.run import generated_sequences

        return generated_sequences(recipe, sources, configs, device, dtypes, progress)

    generated = comm.run_on_main("generation", generate)  # the others wait as long as it takes, not a collective's timeout
    generated = comm.broadcast_object(generated)
    return {e.name: sequences[e.name] if e.name in sequences else [s[: featcal.max_length] for s in generated[e.name]] for e in recipe.experts}
