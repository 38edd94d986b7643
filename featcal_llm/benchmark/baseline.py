"""A straightforward FeatCal, the way the official FeatCal/CLIP demo works, as the whole-run peer of `featcal-llm run`.

Whole Hugging Face models in memory (merged, base and every expert, float32),
one sequence at a time (no batching, no padding), forward pre-hooks on every
`nn.Linear` of the layer being calibrated, one d × d Gram and one d × d cross
moment per projection (the demo's `sum_xsxs` and `sum_xsxt`), float32
statistics and `torch.linalg.solve` in float32, layer by layer with the hidden
states of every sequence kept between layers. No streaming from disk, no
shared Grams, no resume. Llama-family models, weights only (no biases, no norms).

    python -m featcal_llm.benchmark.baseline RECIPE OUTPUT

reads the recipe's `base_model`, `models`, and `featcal:` block (merged,
data, samples, max_length, lambda, alpha, rho, eps) with plain YAML (no
mergekit) and writes the calibrated model with `save_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer


DTYPE = torch.float32  # --dtype float64 turns the baseline into a check of the product's maths


def load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).eval()


def read_texts(path: Path, field: str, samples: int) -> list[str]:
    texts = []
    with path.open() as handle:
        for line in handle:
            if line.strip():
                texts.append(json.loads(line)[field])
            if len(texts) == samples:
                break
    return texts


def capture_inputs(layer: torch.nn.Module, store: dict[str, torch.Tensor]) -> list:
    """Forward pre-hooks on every Linear of the layer: store[name] = its input, flattened to tokens × d."""
    handles = []
    for name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(_module, args, name=name):
                store[name] = args[0].detach().reshape(-1, args[0].shape[-1])
            handles.append(module.register_forward_pre_hook(hook))
    return handles


def run_layer(model: torch.nn.Module, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One decoder layer on one unpadded sequence (causal attention without a mask)."""
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    output = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=model.model.rotary_emb(hidden, positions))
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def calibrate(recipe_path: Path, output: Path, log=print) -> None:
    recipe = yaml.safe_load(recipe_path.read_text())
    featcal = recipe["featcal"]
    lam, alpha, rho, eps = float(featcal.get("lambda", 1e-5)), float(featcal.get("alpha", 0.15)), float(featcal.get("rho", 0.5)), float(featcal.get("eps", 1e-8))
    experts = [entry["model"] for entry in recipe["models"]]
    cal, base = load(featcal["merged"]), load(recipe["base_model"])
    models = {name: load(name) for name in experts}
    tokenizer = AutoTokenizer.from_pretrained(featcal["merged"])
    sequences = {}
    for name in experts:
        spec = featcal["data"][name]
        texts = read_texts(Path(spec["path"]), spec.get("text", "text"), int(spec.get("samples") or featcal.get("samples", 256)))
        sequences[name] = [torch.tensor([tokenizer(t, truncation=True, max_length=int(featcal.get("max_length", 2048)))["input_ids"]]) for t in texts]
    h_cal = {name: [cal.model.embed_tokens(ids) for ids in sequences[name]] for name in experts}
    h_exp = {name: [models[name].model.embed_tokens(ids) for ids in sequences[name]] for name in experts}
    log(f"baseline: {len(cal.model.layers)} layers, {len(experts)} experts × {len(sequences[experts[0]])} sequences")
    for index, cal_layer in enumerate(cal.model.layers):
        started = time.perf_counter()
        linears = {name: m for name, m in cal_layer.named_modules() if isinstance(m, torch.nn.Linear)}
        lhs = {name: torch.zeros(m.in_features, m.in_features, dtype=DTYPE) for name, m in linears.items()}
        rhs = {name: torch.zeros(m.in_features, m.out_features, dtype=DTYPE) for name, m in linears.items()}
        for task in experts:
            expert_layer = models[task].model.layers[index]
            gram = {name: torch.zeros(m.in_features, m.in_features, dtype=DTYPE) for name, m in linears.items()}
            cross = {name: torch.zeros(m.in_features, m.in_features, dtype=DTYPE) for name, m in linears.items()}
            tokens = 0
            x_cal, x_exp = {}, {}
            handles = capture_inputs(cal_layer, x_cal) + capture_inputs(expert_layer, x_exp)
            for position, hidden in enumerate(h_cal[task]):
                run_layer(cal, cal_layer, hidden)
                h_exp[task][position] = run_layer(models[task], expert_layer, h_exp[task][position])
                for name in linears:
                    xs = x_cal[name]
                    xt = alpha * x_exp[name] + (1 - alpha) * xs
                    gram[name] += xs.T @ xs
                    cross[name] += xs.T @ xt
                tokens += hidden.shape[1]
            for handle in handles:
                handle.remove()
            for name in linears:
                g, c = gram[name] / tokens, cross[name] / tokens
                omega = 1.0 / max(float(torch.linalg.matrix_norm(g)), eps)
                lhs[name] += omega * g
                rhs[name] += omega * c @ expert_layer.get_submodule(name).weight.T
        base_layer = base.model.layers[index]
        for name, module in linears.items():
            anchor = rho * module.weight + (1 - rho) * base_layer.get_submodule(name).weight
            system = lhs[name] + (lam + eps) * torch.eye(module.in_features, dtype=DTYPE)
            module.weight.copy_(torch.linalg.solve(system, rhs[name] + lam * anchor.T).T)
        for task in experts:
            h_cal[task] = [run_layer(cal, cal_layer, hidden) for hidden in h_cal[task]]
        log(f"baseline: layer {index} {time.perf_counter() - started:.2f} s")
    stored = json.loads((Path(featcal["merged"]) / "config.json").read_text())
    cal.to(getattr(torch, stored.get("dtype") or stored.get("torch_dtype") or "float32")).save_pretrained(output)
    tokenizer.save_pretrained(output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="models, statistics and solves")
    args = parser.parse_args(argv)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    calibrate(args.recipe, args.output, log=lambda message: print(message, file=sys.stderr, flush=True))


if __name__ == "__main__":
    main()
