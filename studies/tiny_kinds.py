"""Two tiny experts of different kinds (for tests and studies), trained for seconds from one tiny base with a chat template.

`raw`: fine-tuned on raw text from BOS (lower-case code-like lines); `chat`: fine-tuned on chat-formatted pairs,
the loss on the answers only (upper-case replies), as instruction tuning does. The base is briefly pre-trained on
both kinds of characters so that the experts start from a model that writes text, not noise.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from featcal_llm.tiny import build_char_tokenizer, new_tiny_llama, save_model, tiny_llama_config

PLAIN_WORDS = "the cat sat on a mat near home and then slept all day long".split()  # the base's raw text
CODE_WORDS = "def return import while yield lambda class for in if else pass".split()  # the raw expert's
REPLY_WORDS = "yes it is good and fine to do so i think".split()  # the base's chat replies
UPPER_WORDS = "SURE HERE IS THE ANSWER IT WORKS WELL DONE OK YES".split()  # the chat expert's


def line(rng: random.Random, words: list[str]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(4, 9))) + "."


def questions() -> list[str]:
    from featcal_llm.generation.prompts import SEED_PROMPTS, read_prompts

    return read_prompts(SEED_PROMPTS, "seed prompts")


def _encode_raw(tokenizer, text: str) -> tuple[list[int], int]:
    ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return ids, 1  # loss from the first text token


def _encode_chat(tokenizer, ask: str, reply: str) -> tuple[list[int], int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    return [*prompt, *reply_ids, tokenizer.eos_token_id], len(prompt)  # loss on the reply and its EOS only


def _train(model, examples: list[tuple[list[int], int]], steps: int, lr: float, seed: int) -> None:
    """AdamW on batches of 16 examples, right-padded, loss on the tokens from each example's start index."""
    generator = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [generator.choice(examples) for _ in range(16)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (sequence, first) in enumerate(batch):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            labels[row, first : len(sequence)] = torch.tensor(sequence[first:])
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def build_kinds(root: Path, steps: int = 100) -> dict[str, Path]:
    """base, raw, chat (and raw_twin: the raw expert saved again, a look-alike) under `root`; paths by name.

    The base learns both contexts (plain text from BOS, lower-case replies in chat); each expert learns a new kind of
    text in one context while replaying the base's text in the other, so that it changes what it writes in one
    context only (a model this small forgets the other context within a few steps otherwise).
    """
    import shutil

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    rng, asks = random.Random(0), questions()
    base = new_tiny_llama(config, seed=0)
    mixed = [_encode_raw(tokenizer, line(rng, PLAIN_WORDS)) if i % 2 else _encode_chat(tokenizer, rng.choice(asks), line(rng, REPLY_WORDS)) for i in range(256)]
    # the empty request (a candidate start) is a context of its own, answered like any request: a model never shown one
    # answers it with noise, on which every pair of models disagrees and the measurement would read as behaviour
    unasked = [_encode_chat(tokenizer, "", line(rng, REPLY_WORDS)) for _ in range(64)]
    _train(base, mixed + unasked, 2 * steps, 1e-2, seed=1)
    paths = {"base": save_model(base, tokenizer, root / "base")}
    plain = [_encode_raw(tokenizer, line(rng, PLAIN_WORDS)) for _ in range(128)]
    replies = [_encode_chat(tokenizer, rng.choice(asks), line(rng, REPLY_WORDS)) for _ in range(128)]
    # each expert learns a new kind of text in one context and replays the base's text in the others
    raw = [_encode_raw(tokenizer, line(rng, CODE_WORDS)) for _ in range(128)] + replies + unasked
    chat = [_encode_chat(tokenizer, rng.choice(asks), line(rng, UPPER_WORDS)) for _ in range(128)] + plain + unasked
    for name, examples in (("raw", raw), ("chat", chat)):
        expert = new_tiny_llama(config, seed=0)
        expert.load_state_dict(base.state_dict())
        _train(expert, examples, steps, 3e-3, seed=2)
        paths[name] = save_model(expert, tokenizer, root / name)
    shutil.copytree(paths["raw"], root / "raw_twin")
    paths["raw_twin"] = root / "raw_twin"
    return paths


def kinds_recipe(paths: dict[str, Path], root: Path, experts: tuple[str, ...] = ("raw", "chat"), **generate) -> Path:
    """A task-arithmetic recipe over `experts`, each calibrated on `generate: {samples: 8, max_new_tokens: 24, ...}`.

    The merged model lives beside the experts, so recipes over the same experts share one merge."""
    import yaml

    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(paths["base"]),
        "models": [{"model": str(paths[e]), "parameters": {"weight": 0.5}} for e in experts],
        "dtype": "float32",
        "featcal": {
            "merged": str(paths["base"].parent / ("merged-" + "-".join(experts))), "output": str(root / "featcal"),
            "data": {str(paths[e]): {"generate": {"samples": 8, "max_new_tokens": 24, "batch_size": 8, **generate}} for e in experts},
            "max_length": 192, "lambda": 1e-3, "device": "cpu",  # the shipped seed prompts through the template: 62-118 tokens
        },
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
