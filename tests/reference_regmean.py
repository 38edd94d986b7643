"""An independent, brute-force RegMean / RegMean++ written from MergeBench's definitions, not from the product.

Whole HF models in float64, one sequence at a time (no padding), forward hooks
keeping every token's projection inputs, one Gram per projection:
G_i = (1/n) Σ x xᵀ, G̃_i = r G_i + (1 − r) diag(G_i), W* = (Σ W_i G̃_i)(Σ G̃_i + eps I)⁻¹.
RegMean reads expert i's whole model on its own sequences; RegMean++ reads a
hybrid whole model: the model being built (merged embedding, layers < l already
solved here) with expert i's layer l in place, as MergeBench's RegMean++ runs
fine-tuned layer l on the merged model's propagated inputs.
"""

from __future__ import annotations

import copy

import torch
from reference import FAMILIES


def _inputs(model, layer_index: int, names, sequences) -> dict[str, torch.Tensor]:
    """Every token's input to each named module of decoder layer `layer_index`, over the sequences one at a time."""
    layer = model.model.layers[layer_index]
    store: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name in names:
        def hook(_module, args, _output, name=name):
            store.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).double())
        handles.append(layer.get_submodule(name).register_forward_hook(hook))
    for sequence in sequences:
        model(input_ids=torch.tensor([sequence]))
    for handle in handles:
        handle.remove()
    return {name: torch.cat(rows) for name, rows in store.items()}


@torch.no_grad()
def brute_force_regmean(merged, experts: dict, sequences: dict[str, list[list[int]]], reduction: float, eps: float, propagated: bool):
    """The merged model with every decoder projection replaced by RegMean's (propagated=False) or RegMean++'s solution."""
    projections = FAMILIES[merged.config.model_type][0]
    built = copy.deepcopy(merged).double().eval()
    experts = {name: copy.deepcopy(model).double().eval() for name, model in experts.items()}
    for layer_index in range(len(built.model.layers)):
        lhs, rhs = {}, {}
        for task, expert in experts.items():
            if propagated:
                reader = copy.deepcopy(built)
                reader.model.layers[layer_index].load_state_dict(expert.model.layers[layer_index].state_dict())
            else:
                reader = expert
            inputs = _inputs(reader, layer_index, projections, sequences[task])
            for name in projections:
                x = inputs[name]
                gram = x.T @ x / x.shape[0]
                reduced = reduction * gram + (1 - reduction) * torch.diag(torch.diagonal(gram))
                weight = expert.model.layers[layer_index].get_submodule(name).weight.double()
                lhs[name] = lhs.get(name, 0) + reduced
                rhs[name] = rhs.get(name, 0) + weight @ reduced
        layer = built.model.layers[layer_index]
        for name in projections:
            system = lhs[name] + eps * torch.eye(lhs[name].shape[0], dtype=torch.float64)
            layer.get_submodule(name).weight.copy_(torch.linalg.solve(system.T, rhs[name].T).T)
    return built
