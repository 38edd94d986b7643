"""An independent, brute-force FeatCal written straight from featcal_method.md.

Whole HF models in memory, one sequence at a time (so no padding at all),
forward hooks that keep every token's features, float64 statistics and one
Gram per projection, R_i computed literally as (1/n) Σ (W_i x_tgt) x_calᵀ.
Slow and memory-hungry on purpose: it shares no code with the product. Each
sequence goes through the family's full HF model forward (its own embedding
scale, sliding-window masks, soft-capping), so anything the product rebuilds
wrongly shows up as a difference.
"""

from __future__ import annotations

import copy

import torch

_SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# model_type → (projections, the norms FeatCal may update, the norm's scale offset: Gemma scales by (1 + w))
FAMILIES = {
    "llama": (_SEPARATE, ("input_layernorm", "post_attention_layernorm"), 0.0),
    "mistral": (_SEPARATE, ("input_layernorm", "post_attention_layernorm"), 0.0),
    "qwen2": (_SEPARATE, ("input_layernorm", "post_attention_layernorm"), 0.0),
    "qwen3": (_SEPARATE, ("input_layernorm", "post_attention_layernorm"), 0.0),
    "gemma2": (_SEPARATE, ("input_layernorm", "pre_feedforward_layernorm"), 1.0),
    "phi3": (("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"), ("input_layernorm", "post_attention_layernorm"), 0.0),
}


def _capture(layer: torch.nn.Module, names: tuple[str, ...], store: dict[str, list[torch.Tensor]], outputs: bool = False):
    handles = []
    for name in names:
        def hook(_module, args, output, name=name):
            tensor = output if outputs else args[0]
            store.setdefault(name, []).append(tensor.detach().reshape(-1, tensor.shape[-1]).double())
        handles.append(layer.get_submodule(name).register_forward_hook(hook))
    return handles


@torch.no_grad()
def brute_force_featcal(merged, base, experts: dict, sequences: dict[str, list[list[int]]], lam: float, alpha: float, rho: float, eps: float, norms: bool = False,
                        shares: dict[str, float] | None = None, token_weights: dict[str, list[torch.Tensor]] | None = None):
    """Returns the calibrated model (float64); `shares`: expert → its weight (multiplies ω_i and q_i; default 1).

    `token_weights`: expert → one weight per token of each of its sequences; every per-token term of the
    statistics (Grams, R_i, the bias means, the norms' q_i) is multiplied by its token's weight (default 1).
    """
    projections, norm_names, offset = FAMILIES[merged.config.model_type]
    cal = copy.deepcopy(merged).double().eval()
    base = copy.deepcopy(base).double().eval()
    experts = {name: copy.deepcopy(model).double().eval() for name, model in experts.items()}
    for layer_index, cal_layer in enumerate(cal.model.layers):
        base_layer = base.model.layers[layer_index]
        grams, rights, weights, norm_q, bias_terms = {}, {}, {}, {}, {}
        for task, expert in experts.items():
            expert_layer = expert.model.layers[layer_index]
            x_cal, x_exp, norm_in = {}, {}, {}
            handles = _capture(cal_layer, projections, x_cal) + _capture(expert_layer, projections, x_exp)
            if norms:
                handles += _capture(cal_layer, tuple(norm_names), norm_in)
            for sequence in sequences[task]:
                ids = torch.tensor([sequence])
                cal(input_ids=ids)
                expert(input_ids=ids)
            for handle in handles:
                handle.remove()
            for name in projections:
                xc, xe = torch.cat(x_cal[name]), torch.cat(x_exp[name])
                n = xc.shape[0]
                w = torch.ones(n, 1, dtype=torch.float64) if token_weights is None else torch.cat(token_weights[task]).double().reshape(n, 1)
                w_i = expert_layer.get_submodule(name).weight.double()
                x_tgt = alpha * xe + (1 - alpha) * xc
                gram = (w * xc).T @ xc / n
                omega = (shares or {}).get(task, 1.0) / max(float(torch.linalg.matrix_norm(gram)), eps)
                grams.setdefault(name, []).append(omega * gram)
                rights.setdefault(name, []).append(omega * ((w * (x_tgt @ w_i.T)).T @ xc) / n)
                b_i = expert_layer.get_submodule(name).bias
                if b_i is not None:  # Eq. 55 needs ω_i, b_i + W_i μ_tgt,i and μ_cal,i (weighted means: Σ w x / n)
                    bias_terms.setdefault(name, []).append((omega, b_i.double() + w_i @ (w * x_tgt).sum(0) / n, (w * xc).sum(0) / n))
            if norms:
                for norm in norm_names:
                    x = torch.cat(norm_in[norm])
                    module = cal_layer.get_submodule(norm)
                    eps_norm = getattr(module, "variance_epsilon", getattr(module, "eps", None))
                    z = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps_norm)
                    w = 1.0 if token_weights is None else torch.cat(token_weights[task]).double().reshape(-1, 1)
                    gamma = offset + expert_layer.get_submodule(norm).weight.double()  # the effective scale
                    norm_q.setdefault(norm, []).append(((shares or {}).get(task, 1.0) * (w * z * z).mean(0), gamma))
        for name in projections:
            module = cal_layer.get_submodule(name)
            w_anchor = rho * module.weight + (1 - rho) * base_layer.get_submodule(name).weight
            lhs = sum(grams[name]) + (lam + eps) * torch.eye(module.weight.shape[1], dtype=torch.float64)
            rhs = sum(rights[name]) + lam * w_anchor
            weights[name] = torch.linalg.solve(lhs.T, rhs.T).T
        new_biases = {}
        for name, terms in bias_terms.items():
            module = cal_layer.get_submodule(name)
            b_anchor = rho * module.bias + (1 - rho) * base_layer.get_submodule(name).bias
            numerator = sum(omega * (target - weights[name] @ mean_cal) for omega, target, mean_cal in terms) + lam * b_anchor
            new_biases[name] = numerator / (sum(omega for omega, _, _ in terms) + lam)
        new_norms = {}
        for norm in norm_names if norms else ():
            gamma_anchor = offset + rho * cal_layer.get_submodule(norm).weight + (1 - rho) * base_layer.get_submodule(norm).weight
            numerator = sum(q * g for q, g in norm_q[norm]) + lam * gamma_anchor
            new_norms[norm] = numerator / (sum(q for q, _ in norm_q[norm]) + lam) - offset
        for name, weight in weights.items():
            cal_layer.get_submodule(name).weight.copy_(weight)
        for name, bias in new_biases.items():
            cal_layer.get_submodule(name).bias.copy_(bias)
        for norm, gamma in new_norms.items():
            cal_layer.get_submodule(norm).weight.copy_(gamma)
    return cal


@torch.no_grad()
def brute_force_head(cal, merged, base, experts: dict, sequences: dict[str, list[list[int]]], lam: float, alpha: float, rho: float, eps: float,
                     shares: dict[str, float] | None = None, token_weights: dict[str, list[torch.Tensor]] | None = None) -> torch.Tensor:
    """The LM head re-fitted on the final features of each model's own full forward (`model.model(...)`, after its final norm).

    `cal` is the brute force's calibrated model: its body gives x_cal, each expert's gives x_exp; R_i is formed
    literally from W_i x_tgt, one sequence at a time, in float64.
    """
    dim = merged.config.hidden_size
    lhs = torch.zeros(dim, dim, dtype=torch.float64)
    rhs = torch.zeros_like(merged.get_output_embeddings().weight, dtype=torch.float64)
    for task, expert in experts.items():
        expert = expert.double().eval()
        x_cal = torch.cat([cal.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in sequences[task]]).double()
        x_exp = torch.cat([expert.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in sequences[task]]).double()
        n = x_cal.shape[0]
        w = torch.ones(n, 1, dtype=torch.float64) if token_weights is None else torch.cat(token_weights[task]).double().reshape(n, 1)
        gram = (w * x_cal).T @ x_cal / n
        omega = (shares or {}).get(task, 1.0) / max(float(torch.linalg.matrix_norm(gram)), eps)
        w_i = expert.get_output_embeddings().weight.double()
        x_tgt = alpha * x_exp + (1 - alpha) * x_cal
        lhs += omega * gram
        rhs += omega * ((w * (x_tgt @ w_i.T)).T @ x_cal) / n
    w_anchor = rho * merged.get_output_embeddings().weight.double() + (1 - rho) * base.get_output_embeddings().weight.double()
    lhs += (lam + eps) * torch.eye(dim, dtype=torch.float64)
    return torch.linalg.solve(lhs.T, (rhs + lam * w_anchor).T).T


@torch.no_grad()
def _token_leads(merged, expert, sequence: list[int], start: int = 0) -> torch.Tensor:
    """log p_expert − log p_merged of each token's successor, from the whole models' forward (0 for the last token, and
    wherever the successor comes before `start`, a prompt/response record's first response token)."""
    ids = torch.tensor([list(sequence)])
    lead = torch.zeros(len(sequence), dtype=torch.float64)
    if len(sequence) > 1:
        def next_token(model):
            return torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0]
        lead[:-1] = next_token(expert) - next_token(merged)
    lead[: max(start - 1, 0)] = 0.0
    return lead


def _starts(sequences: dict[str, list[list[int]]], starts: dict[str, list[int]] | None, task: str) -> list[int]:
    return starts[task] if starts is not None else [0] * len(sequences[task])


def advantage_token_weights(merged, experts: dict, sequences: dict[str, list[list[int]]],
                            starts: dict[str, list[int]] | None = None, drop_trailing_records: bool = True,
                            judged_starts: dict[str, list[int]] | None = None, standard_errors: float = 2.0) -> dict[str, list[torch.Tensor]]:
    """Each token's weight, from the whole models' own forward: ½ + ½ a / mean(a) with a = max(0, log p_expert −
    log p_merged) of the next token (0 for a record's last token, and before `starts`), the mean over the expert's tokens;
    every token of a record whose leads sum below 0 weighs 0 (`trailing_records: drop`) where the expert is not behind the
    merge beyond doubt (behind_beyond_doubt)
    (both sums over the judged tokens: from `judged_starts` on where given, a response's, else as the weights count)."""
    merged = copy.deepcopy(merged).double().eval()
    weights = {}
    for task, expert in experts.items():
        expert = copy.deepcopy(expert).double().eval()
        signed = [_token_leads(merged, expert, sequence, start) for sequence, start in zip(sequences[task], _starts(sequences, starts, task))]
        rows = [lead.clamp(min=0) for lead in signed]
        total, count = float(torch.cat(rows).sum()), sum(len(s) for s in sequences[task])
        weights[task] = [0.5 + 0.5 * row * (count / total) if total > 0 else torch.ones_like(row) for row in rows]
        if judged_starts is not None:
            signed = [_token_leads(merged, expert, sequence, start) for sequence, start in zip(sequences[task], judged_starts[task])]
        judged = [len(s) - max(start, 1) for s, start in zip(sequences[task], (judged_starts or starts or {}).get(task, [0] * len(signed)))]
        if drop_trailing_records and not behind_beyond_doubt(signed, judged, standard_errors):
            weights[task] = [w * 0 if float(lead.sum()) < 0 else w for w, lead in zip(weights[task], signed)]
    return weights


def behind_beyond_doubt(signed: list[torch.Tensor], judged: list[int], standard_errors: float = 2.0) -> bool:
    """Whether an expert's mean lead, raised by two standard errors, is still not above 0: the records (each one's
    summed lead L over its n judged tokens) are the unit, m = Σ L / Σ n, SE² = Σ (L − m n)² / ((R − 1) R n̄²), computed
    here from the residuals themselves; with fewer than two judged records the mean's sign alone decides."""
    pairs = [(float(lead.sum()), n) for lead, n in zip(signed, judged) if n > 0]
    total = sum(n for _, n in pairs)
    mean = sum(lead for lead, _ in pairs) / max(total, 1)
    if len(pairs) < 2:
        return mean <= 0
    residuals = [lead - mean * n for lead, n in pairs]
    spread = sum(r * r for r in residuals) / ((len(pairs) - 1) * len(pairs))
    return mean + standard_errors * spread ** 0.5 / (total / len(pairs)) <= 0


def mean_leads(merged, experts: dict, sequences: dict[str, list[list[int]]], starts: dict[str, list[int]] | None = None) -> dict[str, float]:
    """Each expert's mean lead over the merge per scored token of its records (negative where it trails), from the
    whole models' forward; a record's last token has no successor and is not scored, nor is a prompt token's
    prediction (a successor before `starts`)."""
    merged = copy.deepcopy(merged).double().eval()
    leads = {}
    for task, expert in experts.items():
        expert = copy.deepcopy(expert).double().eval()
        pairs = list(zip(sequences[task], _starts(sequences, starts, task)))
        total = sum(float(_token_leads(merged, expert, sequence, start).sum()) for sequence, start in pairs)
        leads[task] = total / sum(len(s) - max(start, 1) for s, start in pairs)
    return leads
