"""The real-model study's models: a float32 base from a GGUF file, experts fine-tuned on text, held-out NLL.

Every sequence is the tokenizer's BOS followed by a record's text, as a document is seen in pre-training:
experts learn what their text looks like from its first token on, and NLL is measured on the text tokens.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from featcal_llm.demo.models import save_atomically
from featcal_llm.errors import FeatCalError
from studies.common import mean_nll as token_mean


def build_base_from_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint with transformers' GGUF loader and save it as float32 safetensors.

    ``save_pretrained`` refuses a model loaded from GGUF (it carries a quantization config), so the weights are
    copied into a fresh model built from the same config without it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise FeatCalError(f"{gguf}: expected a GGUF file")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    save_atomically(model, tokenizer, out)


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """BOS + the text's tokens (the tokenizer adds no BOS of its own for these models)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer.encode(text, add_special_tokens=False) for text in texts]


Row = tuple[list[int], int]  # token ids, and the index of the first token the loss scores (1: all after BOS)


def _batch(rows: list[Row], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and labels with -100 on padding and before each row's first scored token."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (seq, first) in enumerate(rows):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
        labels[row, first:len(seq)] = torch.tensor(seq[first:])
    return ids, mask, labels


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def finetune(base: Path, tokenizer, texts: list[str], out: Path, *, steps: int, batch_size: int, lr: float,
             seed: int, log=print, device: str = "cpu", bf16: bool = False, train_embeddings: bool = False) -> dict:
    """Full fine-tune on raw texts after BOS (every token scored): `train_rows` on them."""
    return train_rows(base, tokenizer, [(ids, 1) for ids in encode(tokenizer, texts)], out, steps=steps,
                      batch_size=batch_size, lr=lr, seed=seed, log=log, device=device, bf16=bf16,
                      train_embeddings=train_embeddings)


def train_rows(base: Path, tokenizer, rows: list[Row], out: Path, *, steps: int, batch_size: int, lr: float,
               seed: int, log=print, device: str = "cpu", bf16: bool = False, train_embeddings: bool = False) -> dict:
    """Full fine-tune of the decoder layers and final norm (tied embeddings frozen unless ``train_embeddings``), AdamW, warmup + cosine.

    Weights and optimizer state stay float32; ``bf16`` runs the forward and backward under bfloat16 autocast.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    model.get_input_embeddings().weight.requires_grad_(train_embeddings)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    order: list[int] = []
    rng = random.Random(seed)
    losses = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(rows)))
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:batch_size], order[batch_size:]
        ids, mask, labels = (t.to(device) for t in _batch([rows[i] for i in picked], tokenizer.pad_token_id))
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, steps, lr, max(1, steps // 10))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        log(f"  step {step + 1}/{steps} loss {losses[-1]:.4f}")
    model.eval()
    save_atomically(model.cpu(), tokenizer, out)
    del model, optimizer, params
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # a product run in another process may share the GPU
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "bf16": bf16, "first_loss": losses[0], "last_loss": losses[-1],
            **({"train_embeddings": True} if train_embeddings else {})}


@torch.no_grad()
def mean_nll(model_dir: Path, tokenizer, texts: list[str], batch_size: int = 16, model=None, device: str = "cpu") -> float:
    """Token-weighted mean negative log-likelihood (nats) of the texts' tokens, each given BOS and its prefix."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return rows_nll(model, [(ids, 1) for ids in encode(tokenizer, texts)], tokenizer.pad_token_id, batch_size, device)


def rows_nll(model, rows: list[Row], pad: int, batch_size: int = 16, device: str = "cpu") -> float:
    """Token-weighted mean negative log-likelihood (nats) of each row's scored tokens."""
    return token_mean(record_nlls(model, rows, pad, batch_size, device))


@torch.no_grad()
def record_nlls(model, rows: list[Row], pad: int, batch_size: int = 16, device: str = "cpu") -> list[tuple[float, int]]:
    """Per row: the summed negative log-likelihood (nats) of its scored tokens and their count, so that any mean over
    rows (a bootstrap resample's) is a token-weighted one: Σ sums / Σ counts."""
    out = []
    for start in range(0, len(rows), batch_size):
        ids, mask, labels = (t.to(device) for t in _batch(rows[start:start + batch_size], pad))
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        target = labels[:, 1:]
        # over the flattened positions: over (batch, vocab, time) the softmax's float32 sum drifts (1.5e-4 nats a
        # token too low on SmolLM2's 49k vocabulary)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100,
                              reduction="none").view_as(target)
        for row in range(ids.shape[0]):
            out.append((float(nll[row].sum()), int((target[row] != -100).sum())))
    return out


def token_kl(reference_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Sum over masked positions of KL(reference ‖ model) = Σ_v p_ref (log p_ref − log p), and the position count."""
    kl = (reference_logp.exp() * (reference_logp - logp)).sum(-1)
    return float((kl * mask).sum()), int(mask.sum())


@torch.no_grad()
def log_probs(model, tokenizer, texts: list[str], batch_size: int = 16,
              device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch: next-token log-probabilities at the text's positions (BOS and prefix given) and their mask."""
    out = []
    sequences = encode(tokenizer, texts)
    for start in range(0, len(sequences), batch_size):
        ids, mask, _ = (t.to(device) for t in _batch([(s, 1) for s in sequences[start:start + batch_size]], tokenizer.pad_token_id))
        logits = model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1]
        out.append((torch.log_softmax(logits, -1), mask[:, 1:].float()))
    return out


def mean_kl(reference: list[tuple[torch.Tensor, torch.Tensor]], model, tokenizer, texts: list[str],
            device: str = "cpu") -> float:
    """Token-mean KL(reference model ‖ model) on the texts: how far the model's predictions are from the expert's."""
    total, count = 0.0, 0
    for (ref, mask), (logp, _) in zip(reference, log_probs(model, tokenizer, texts, device=device)):
        kl, n = token_kl(ref, logp, mask)
        total, count = total + kl, count + n
    return total / count
