"""Where an expert's generation starts: a user's prompts file, the shipped seed prompts, an empty request, or the BOS token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError
from featcal_llm.io.data import encode, render_chat
from featcal_llm.io.model_files import carries_chat_template
from featcal_llm.io.prompts import read_prompts  # noqa: F401  (re-exported for generation)

# Varied generic requests (instructions, questions, code, maths, prose) for chat experts given no prompts.
SEED_PROMPTS = Path(__file__).with_name("seed_prompts.jsonl")


@dataclass(frozen=True)
class Start:
    """The distinct prompts generation continues, as text and token ids; sample i continues prompt i mod len(ids)."""

    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    source: str  # for the log and the cache record: "BOS token", "prompts file …", "shipped seed prompts"
    chat: bool


def start_token(tokenizer: Any, config: Any, start: str | None = None, where: str = "generate") -> int:
    """The token a document begins with: `start` when given, else the tokenizer's BOS, else the config's, else EOS (the document separator of BOS-less vocabularies)."""
    if start is not None:
        token = tokenizer.convert_tokens_to_ids(start)
        if not isinstance(token, int) or token == tokenizer.unk_token_id and start != tokenizer.unk_token:
            raise FeatCalError(f"{where}.start: {start!r} is not a token of the expert's vocabulary")
        rows = getattr(config, "vocab_size", None)
        if isinstance(rows, int) and token >= rows:  # added on loading (tokenizer_config.json names it, tokenizer.json lacks it)
            raise FeatCalError(f"{where}.start: {start!r} is token {token}, past the expert's {rows} embedding rows (its "
                               "tokenizer adds it on loading); name a token the expert was trained with")
        return token
    for value in (getattr(tokenizer, "bos_token_id", None), getattr(config, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    raise FeatCalError(f"{where}: the expert's tokenizer and config have neither a BOS nor an EOS token to start generation "
                       "from; give prompts (generate.prompts) or a start token (generate.start)")


def check_start(spec: Any, tokenizer: Any, config: Any, where: str) -> None:
    """What `resolve_start` would refuse of an expert's start, asked of every expert before any samples: a `start` not in
    its vocabulary, a chat template asked for that it lacks, no token to begin at without prompts."""
    chat = uses_chat_template(spec.chat_template, tokenizer, where)
    if spec.start is not None or (spec.prompts is None and (not chat or spec.chat_template == "auto")):  # auto measures BOS too
        start_token(tokenizer, config, spec.start, where)


def uses_chat_template(setting: str, tokenizer: Any, where: str) -> bool:
    has_template = carries_chat_template(tokenizer)
    if setting in ("on", "empty") and not has_template:
        raise FeatCalError(f"{where}.chat_template: {setting}, but the expert's tokenizer has no chat template")
    return has_template if setting == "auto" else setting in ("on", "empty")


def resolve_start(
    prompts: list[str] | None, prompts_source: str, chat_setting: str, tokenizer: Any, config: Any, where: str, start: str | None = None
) -> Start:
    """Prompts (or none) → the token ids generation starts from, through the chat template when it applies.

    Without prompts: through the chat template, the expert answers the shipped seed prompts (`on`) or an empty
    request (`empty`); otherwise it starts from its BOS token (or `start`).
    """
    chat = uses_chat_template(chat_setting, tokenizer, where) and start is None
    if prompts is None and chat and chat_setting == "empty":
        return empty_request(tokenizer, where)
    if prompts is None and chat:
        prompts, prompts_source = read_prompts(SEED_PROMPTS, "shipped seed prompts"), "shipped seed prompts"
    if prompts is None:
        token = start_token(tokenizer, config, start, where)
        return Start(("",), ((token,),), f"start token {start}" if start is not None else "BOS token", chat=False)
    if chat:
        texts = tuple(chat_request(tokenizer, p, where) for p in prompts)
    else:
        texts = tuple(prompts)
    ids = tuple(prompt_ids(text, tokenizer, templated=chat) for text in texts)
    empty = [i for i, sequence in enumerate(ids) if not sequence]
    if empty:
        raise FeatCalError(f"{where}.prompts: prompt {empty[0] + 1} tokenises to nothing")
    return Start(texts, ids, prompts_source, chat)


def chat_request(tokenizer: Any, request: str, where: str = "generate") -> str:
    """`request` as the user's turn through the chat template, up to where the assistant's answer begins; a template
    that refuses it (or cannot render) is one line, not a traceback."""
    return render_chat(tokenizer, [{"role": "user", "content": request}], f"{where}: the expert's chat template refused a prompt",
                       add_generation_prompt=True)


def empty_request(tokenizer: Any, where: str = "generate") -> Start:
    """A user turn with nothing in it: the expert answers with what it writes unasked, the kind of text it was tuned on."""
    text = chat_request(tokenizer, "", where)
    return Start((text,), (prompt_ids(text, tokenizer, templated=True),), "empty request", chat=True)


def prompt_ids(text: str, tokenizer: Any, templated: bool = False) -> tuple[int, ...]:
    """The token ids a sample continues: the text encoded as calibration records are (a chat template's output as the
    template wrote it, `templated`, with no special token added, as `apply_chat_template(tokenize=True)` encodes it;
    raw text with the BOS the tokenizer adds), less an EOS the tokenizer appends (`add_eos_token`): the expert
    continues the prompt, not a closed document."""
    ids = encode(text, tokenizer, templated=templated)
    eos = tokenizer.eos_token_id
    if ids and eos is not None and ids[-1] == eos and not (tokenizer.eos_token and text.endswith(tokenizer.eos_token)):
        ids = ids[:-1]
    return tuple(ids)


def config_start_token(directory: Any, tokenizer: Any) -> int | None:
    """The expert's generation_config.json start token (decoder start, else BOS), when it ships one."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("decoder_start_token_id", "bos_token_id"):
        value = config.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and 0 <= value < len(tokenizer):
            return value
    return None


def candidate_starts(tokenizer: Any, config: Any, directory: Any, where: str) -> dict[str, Start]:
    """The starts `chat_template: auto` chooses among, by mode: "bos" (the BOS token), "chat" (the shipped seed
    prompts through the chat template) and "empty" (an empty request through it), when the tokenizer has one,
    "config" (the generation config's start token, when it is another token than the BOS)."""
    candidates = {"bos": resolve_start(None, "", "off", tokenizer, config, where)}
    if carries_chat_template(tokenizer):
        candidates["chat"] = resolve_start(None, "", "on", tokenizer, config, where)
        candidates["empty"] = empty_request(tokenizer, where)
    token = config_start_token(directory, tokenizer)
    if token is not None and (token,) != candidates["bos"].ids[0]:
        name = tokenizer.convert_ids_to_tokens(token)
        candidates["config"] = Start(("",), ((token,),), f"generation-config start token {name}", chat=False)
    return candidates
