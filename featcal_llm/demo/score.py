"""Greedy exact-match scoring, batched: prompts of one length form one batch, so no padding."""

from __future__ import annotations

from collections import defaultdict

import torch


@torch.no_grad()
def exact_match(model, tokenizer, records: list[dict], batch_size: int = 256) -> float:
    """Percentage of records whose greedy continuation, up to end-of-sequence, equals the answer."""
    by_length: dict[int, list[tuple[list[int], str]]] = defaultdict(list)
    for record in records:
        ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        by_length[len(ids)].append((ids, record["answer"]))
    max_new = max(len(record["answer"]) for record in records) + 1
    eos = tokenizer.eos_token_id
    correct = 0
    model.eval()
    for length in sorted(by_length):
        group = by_length[length]
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            input_ids = torch.tensor([ids for ids, _ in chunk], dtype=torch.long)
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=eos,
            )[:, length:]
            for row, (_, answer) in zip(output.tolist(), chunk):
                if eos not in row:
                    continue  # an answer must end: a run-on continuation is wrong
                correct += tokenizer.decode(row[: row.index(eos)]) == answer
    return 100.0 * correct / len(records)
