"""Plain-torch training loops: brief generic pre-training, then full fine-tuning per task."""

from __future__ import annotations

import math
import random
from typing import Callable

import torch
import torch.nn.functional as F

Progress = Callable[[int, int, float], None]


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(model, next_batch, steps: int, lr: float, progress: Progress | None, every: int,
           vocab_lr_scale: float = 1.0) -> float:
    model.train()
    vocab = [p for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n]
    ids = {id(p) for p in vocab}
    groups = [{"params": [p for p in model.parameters() if id(p) not in ids], "scale": 1.0},
              {"params": vocab, "scale": vocab_lr_scale}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    smoothed = float("nan")
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup) * group["scale"]
        input_ids, labels = next_batch()
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
        if progress is not None and ((step + 1) % every == 0 or step + 1 == steps):
            progress(step + 1, steps, smoothed)
    model.eval()
    return smoothed


def pretrain(model, token_ids: list[int], *, steps: int, batch_size: int, seq_len: int, lr: float,
             seed: int, progress: Progress | None = None, every: int = 50) -> float:
    """Next-token prediction on random windows of a long token stream."""
    data = torch.tensor(token_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)

    def next_batch():
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        windows = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        return windows, windows

    return _train(model, next_batch, steps, lr, progress, every)


def encode_examples(tokenizer, records: list[dict]) -> list[tuple[list[int], int]]:
    """(prompt + answer + eos token ids, prompt length) per record."""
    encoded = []
    for record in records:
        prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(record["answer"], add_special_tokens=False)["input_ids"]
        encoded.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return encoded


def finetune(model, tokenizer, records: list[dict], *, steps: int, batch_size: int, lr: float,
             seed: int, progress: Progress | None = None, every: int = 50, vocab_lr_scale: float = 1.0) -> float:
    """Full fine-tuning (every weight) with the loss on the answer and its end-of-sequence token.

    ``vocab_lr_scale`` scales the learning rate of the embedding and LM head, which in
    a real LLM barely move during fine-tuning (a large vocabulary, most rows unused).
    """
    examples = encode_examples(tokenizer, records)
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id

    def next_batch():
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for row, (ids, prompt_len) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        # right padding under a causal mask never reaches a real token, so no attention mask is needed
        return input_ids, labels

    return _train(model, next_batch, steps, lr, progress, every, vocab_lr_scale)
