"""The recipe's method and hyper-parameters as the objective the layer loop solves with."""

from __future__ import annotations

from typing import Any

from featcal_llm.engine.tuning import build_search
from featcal_llm.errors import FeatCalError
from featcal_llm.engine.objectives import FeatCal
from featcal_llm.maths.objective import Hyperparameters
from featcal_llm.engine.objectives import RegMean
from featcal_llm.maths.regmean import RegMeanSetting

STREAMS = {"regmean": "expert", "regmean++": "cal"}  # which hidden states feed expert i's layer for its Grams


def _per_layer(value: Any, key: str, num_layers: int, where: str) -> list[float]:
    """A key's value at every layer: a number repeated, or its per_layer list (which must cover every layer)."""
    values = getattr(value, "per_layer", None)
    if values is None:
        return [value] * num_layers
    if len(values) != num_layers:
        raise FeatCalError(f"{where}: featcal.{key}.per_layer: {len(values)} values for a model of {num_layers} decoder layers")
    return list(values)


def objective_for(featcal: Any, num_layers: int, where: str) -> FeatCal | RegMean:
    """The block's method with its hyper-parameters: fixed, chosen per layer by a search, or a tuned run's winners replayed.

    A FeatCal replay (per_layer values) folds its targets as the search did (α kept apart),
    so re-running a tuned run's written recipe reproduces its weights bit for bit.
    """
    if featcal.regmean:
        return _regmean(featcal, num_layers, where)
    if featcal.tuned:
        search = build_search(featcal, where)
        start = search.start()
        return FeatCal(Hyperparameters(start["lambda"], start["alpha"], start["rho"], featcal.eps), search=search)
    if featcal.per_layer:
        columns = [_per_layer(getattr(featcal, attribute), key, num_layers, where)
                   for attribute, key in (("lambda_", "lambda"), ("alpha", "alpha"), ("rho", "rho"))]
        return FeatCal([Hyperparameters(lam, alpha, rho, featcal.eps) for lam, alpha, rho in zip(*columns)], split_targets=True)
    return FeatCal(Hyperparameters(featcal.lambda_, featcal.alpha, featcal.rho, featcal.eps))


def _regmean(featcal: Any, num_layers: int, where: str) -> RegMean:
    """RegMean or RegMean++ with a fixed, searched or replayed reduction."""
    stream = STREAMS[featcal.method]
    reduction = featcal.hyper_values()["reduction"]
    if featcal.tuned:
        search = build_search(featcal, where)
        return RegMean(stream, RegMeanSetting(search.start()["reduction"], featcal.eps), search=search)
    if featcal.per_layer:
        return RegMean(stream, [RegMeanSetting(r, featcal.eps) for r in _per_layer(reduction, "reduction", num_layers, where)])
    return RegMean(stream, RegMeanSetting(reduction, featcal.eps))


def head_setting(featcal: Any, own_heads: list[str] | None = None) -> Hyperparameters | None:
    """The LM head's re-fit (`head:`), FeatCal only: RegMean leaves everything outside the layers merged.

    `own_heads`: the experts whose head differs from the base's; `head: auto` re-fits only when there is one.
    """
    spec = featcal.head
    if spec is None or featcal.regmean or (featcal.head_when_changed and not own_heads):
        return None
    return Hyperparameters(spec.lambda_, spec.alpha, spec.rho, featcal.eps)
