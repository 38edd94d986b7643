"""Calibration records → token sequences, one list per expert.

Records come from `datasets.load_dataset` (a local file, a local dataset
directory or a hub id), are turned into text by the configured format and
tokenised with the merged model's tokenizer. No padding here: batching and
masks belong to the streams. Prompt/response records (`alpaca`, `chat`,
`completion`: TRL's string `prompt` and `completion` fields) also say which
of their tokens are the response's (a conversation's: every assistant
turn's): whether an expert leads the merge is judged there (io.records.Record).

The records themselves are read by io/data_files.py (its JSON-lines shortcut
included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featcal_llm.errors import FeatCalError, warn
from featcal_llm.io.records import Record
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data_fields import default_fields
from featcal_llm.io.data_files import (check_file_options, data_path, load_records, no_records, not_utf8,
                                       plain_jsonl_records)
from featcal_llm.io.model_files import carries_chat_template, chat_template_syntax_error
from featcal_llm.startup import heavy_import

# MergeBench formats its *_val sets with this template (the response included).
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{response}"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n{response}"
)
# Llama-3.x chat templates print today's date unless given one; a fixed date keeps the tokens (and the
# resume fingerprint) the same across midnight. This is the default the Llama-3.1 template itself uses.
CHAT_DATE = "26 Jul 2024"
def _field(record: dict, spec: DataSpec, key: str, where: str, index: int) -> Any:
    if key not in record:
        raise missing_field(spec, key, list(record), where, index)
    return record[key]


# Where common datasets keep what an entry's key reads (Stanford Alpaca's `output`, TRL's `completion`, ...).
FIELD_ALIASES = {"text": ("content", "document", "body"), "instruction": ("prompt", "query", "question"),
                 "response": ("output", "completion", "answer"), "prompt": ("question", "query", "instruction")}


def missing_field(spec: DataSpec, key: str, fields: list[str], where: str, index: int) -> FeatCalError:
    """A record without the field the entry reads, with the entry's key to set where the record has a likely one."""
    hint = ""
    if "messages" in fields and not spec.messages and spec.format in ("text", "chat"):  # chat records
        hint = f"; write `{'' if spec.format == 'chat' else 'format: chat, '}messages: messages` in this entry"
    else:
        role = next((name for name in FIELD_ALIASES if getattr(spec, name) == key), None)
        alias = next((name for name in FIELD_ALIASES.get(role, ()) if name in fields), None)
        hint = f"; write `{role}: {alias}` in this entry" if alias else ""
    return FeatCalError(f"{where}: record {index} has no field {key!r} (fields: {', '.join(fields)}){hint}")


def text_field(record: dict, spec: DataSpec, key: str, where: str, index: int) -> str:
    """A field the record's format reads as text: a string, or refused (a list, a number or null would otherwise be
    calibrated on as its Python repr). `validate` applies the same check to the records it reads."""
    value = _field(record, spec, key, where, index)
    if isinstance(value, str) and not value.strip() and spec.format == "text":  # nothing to calibrate on (with some
        # tokenizers not even a token; with others, blanks the features of no expert's text would be fitted to)
        said = "empty" if value == "" else "only whitespace"
        raise FeatCalError(f"{where}.path: {spec.path}: record {index}: field {key!r} is {said}; drop the record or fill it")
    if isinstance(value, str):
        return value
    kind = "null (or missing: datasets fills a field some records lack with null)" if value is None else {"int": "a number (int)", "float": "a number (float)", "bool": "true or false"}.get(type(value).__name__, f"a {type(value).__name__}")
    hint = f"format: {spec.format} reads it as text" + ("; for a list of messages, use format: chat with messages" if isinstance(value, list) else "")
    if spec.format == "completion":
        messages = isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)
        kind = "a list of messages (TRL's conversational form)" if messages else kind
        hint = "format: completion reads string prompt and completion fields (for messages, use format: chat with messages)"
    if index == 0 and isinstance(value, list) and value and all(isinstance(item, str) for item in value):  # columns?
        hint += ("; a JSON file holding one object of lists (columns) is one record to datasets: write one record per "
                 "line (JSON lines) or an array of records")
    raise FeatCalError(f"{where}.path: {spec.path}: record {index}: field {key!r} is {kind}, not a string; {hint}")


def text_fields(spec: DataSpec) -> list[str]:
    """The fields the entry's format reads as text (a chat's `messages` is a list; alpaca's `input` may be absent)."""
    if spec.format == "text":
        return [spec.text]
    if spec.format == "alpaca":
        return [spec.instruction, spec.response]
    return [] if spec.messages else [spec.prompt, spec.response]


def _chat_messages(record: dict, spec: DataSpec, where: str, index: int) -> list[dict]:
    if spec.messages:
        return chat_messages(record, spec, where, index)
    return [
        {"role": "user", "content": text_field(record, spec, spec.prompt, where, index)},
        {"role": "assistant", "content": text_field(record, spec, spec.response, where, index)},
    ]


def chat_messages(record: dict, spec: DataSpec, where: str, index: int) -> list[dict]:
    """A record's `messages`: a non-empty list of {role, content} turns with text in both, or refused in one line (the
    chat template would fail with a traceback). `validate` applies the same check to the records it reads."""
    value = _field(record, spec, spec.messages, where, index)
    if not isinstance(value, list) or not value or not all(
            isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str) for turn in value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise FeatCalError(f"{where}.path: {spec.path}: record {index}: field {spec.messages!r} is {shown}; format: chat reads a "
                           "non-empty list of {role, content} messages with text in both")
    return value


def alpaca_input(record: dict, spec: DataSpec, where: str, index: int) -> str | None:
    """An alpaca record's optional input: absent, null or text (anything else is refused in text_field's words)."""
    extra = record.get(spec.input) if spec.input else None
    if extra is not None and not isinstance(extra, str):
        text_field(record, spec, spec.input, where, index)
    return extra


def _alpaca(record: dict, spec: DataSpec, where: str, index: int, with_response: bool) -> str:
    """The record in the Alpaca template (its response left empty for the prompt alone), its fields read in validate's
    order (instruction, response, input), so that a record bad in several is refused for the same one by both."""
    instruction = text_field(record, spec, spec.instruction, where, index)
    response = text_field(record, spec, spec.response, where, index) if with_response else ""
    extra = alpaca_input(record, spec, where, index)
    template = ALPACA_WITH_INPUT if extra else ALPACA_NO_INPUT
    return template.format(instruction=instruction, input=extra, response=response)


def completion_text(record: dict, spec: DataSpec, where: str, index: int) -> str:
    """TRL's prompt then completion, as is; both empty is no text at all, refused naming them (as `validate` does)."""
    text = text_field(record, spec, spec.prompt, where, index) + text_field(record, spec, spec.response, where, index)
    if not text:
        raise FeatCalError(f"{where}.path: {spec.path}: record {index}: fields {spec.prompt!r} and {spec.response!r} are both "
                           "empty; drop the record or fill it")
    return text


def record_to_text(record: dict, spec: DataSpec, tokenizer: Any, where: str, index: int) -> str:
    if spec.format == "text":
        return text_field(record, spec, spec.text, where, index)
    if spec.format == "alpaca":
        return _alpaca(record, spec, where, index, with_response=True)
    if spec.format == "completion":
        return completion_text(record, spec, where, index)
    if not carries_chat_template(tokenizer):
        raise FeatCalError(f"{where}.format: chat needs a tokenizer with a chat template")
    return render_chat(tokenizer, _chat_messages(record, spec, where, index), f"{where}: record {index}: the tokenizer's chat template refused it")


def record_prompt(record: dict, spec: DataSpec, tokenizer: Any, where: str, index: int) -> str | list[tuple[str, str]] | None:
    """The text a record's response follows (what a user asks, not what the expert answers); for a conversation, per
    assistant turn, the conversation before it with the generation prompt (where the turn starts) and the conversation
    through it (where it ends): every assistant turn is judged, as TRL's `assistant_only_loss` trains on every one. A
    turn that opens the conversation has nothing before it (transformers renders no empty conversation): it is judged
    from the record's start. None: no response to tell apart (plain text, or a chat with no assistant turn), so every
    token counts."""
    if spec.format == "alpaca":
        return _alpaca(record, spec, where, index, with_response=False)
    if spec.format == "completion":
        return text_field(record, spec, spec.prompt, where, index)
    if spec.format == "chat":
        messages = _chat_messages(record, spec, where, index)
        refused = f"{where}: record {index}: the tokenizer's chat template refused it"
        turns = [(render_chat(tokenizer, messages[:turn], refused, add_generation_prompt=True) if turn else "",
                  render_chat(tokenizer, messages[:turn + 1], refused))
                 for turn, message in enumerate(messages) if isinstance(message, dict) and message.get("role") == "assistant"]
        return turns or None
    return None


def check_chat_template_parses(tokenizer: Any, where: str) -> None:
    """A chat template that does not parse fails every record alike: one line for the entry, as validate words it
    from the tokenizer's files (the template transformers applies: of named ones, the default)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    problem = chat_template_syntax_error(template) if isinstance(template, str) else None
    if problem is not None:
        raise FeatCalError(f"{where}.format: {chat_template_unparsable(problem)}")


def chat_template_unparsable(problem: str) -> str:
    return f"chat: the tokenizer's chat template does not parse ({problem})"


def render_chat(tokenizer: Any, messages: list[dict], refused: str, add_generation_prompt: bool = False) -> str:
    """The messages through the tokenizer's chat template; a template that refuses them (Gemma's refuses a system turn,
    Mistral's turns that do not alternate) or cannot render is one line: `refused`, then the template's own words."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, date_string=CHAT_DATE)
    except Exception as error:  # jinja2's TemplateError/UndefinedError, transformers' ValueError
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise FeatCalError(f"{refused} ({reason})") from None


def response_start(ids: list[int], prompt_ids: list[int]) -> int:
    """Index of the first token past the longest common prefix of a record's ids and its prompt's alone.

    A token spanning the boundary (a merge of the prompt's last characters
    with the response's first) counts as the response's, and a template that
    renders the prompt differently once a reply follows (a reasoning block)
    counts from where the two first differ.
    """
    start = 0
    for token, prompt_token in zip(ids, prompt_ids):
        if token != prompt_token:
            break
        start += 1
    return start


def turn_spans(ids: list[int], text: str, turns: list[tuple[str, str]], tokenizer: Any, templated: bool) -> list[tuple[int, int]]:
    """Per assistant turn of a conversation whose text `text` encodes to `ids`: [start, end), where `start` is
    response_start of the conversation before the turn with the generation prompt (what a single-turn record's
    prompt is) and `end` is where the ids and the conversation through the turn first differ (all of them where the
    turn ends the conversation). The turns between (user, system) are not judged; `max_length` cuts the spans with the
    ids. A template that renders a turn otherwise once the conversation goes on gives that turn only the tokens both
    renders share: under Qwen3's, which drops an earlier turn's reasoning and writes a think block only after the last
    user message, none, so the final exchange alone is judged, as Qwen3's training masks do (an earlier turn's bare
    answer is not what the expert writes there). tests/test_reasoning_turns.py pins both kinds."""
    spans = []
    for before, through in turns:
        start = response_start(ids, encode(before, tokenizer, templated=templated))
        spans.append((start, len(ids) if through == text else response_start(ids, encode(through, tokenizer, templated=templated))))
    return spans


def encode(text: str, tokenizer: Any, max_length: int | None = None, templated: bool = False) -> list[int]:
    """The text's token ids; past `max_length`, the end is cut (also for a tokenizer saved with `truncation_side: left`).

    `templated`: the text is a chat template's output, which is the whole truth: it is encoded with no special token
    added, as transformers' `apply_chat_template(tokenize=True)` and vLLM's chat path encode it (a tokenizer saved with
    `add_eos_token` would otherwise close it with a second EOS, and one that adds BOS would put a BOS before a template
    that writes none). Plain text gets the tokenizer's special tokens, except a BOS the text already starts with."""
    has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
    truncation = {"truncation": True, "max_length": max_length} if max_length is not None else {}
    side = getattr(tokenizer, "truncation_side", "right")
    tokenizer.truncation_side = "right"  # a record keeps its start (its BOS, its prompt) whatever side the tokenizer cuts on
    try:
        return list(tokenizer(text, add_special_tokens=not (templated or has_bos), **truncation)["input_ids"])
    finally:
        tokenizer.truncation_side = side


def tokenize_texts(texts: list[str], tokenizer: Any, max_length: int, where: str,
                   prompts: list[str | list[tuple[str, str]] | None] | None = None, numbers: list[int] | None = None,
                   templated: bool = False) -> list[list[int]]:
    """Token ids per text, truncated to `max_length`. Where a text has a prompt (record_prompt's), a `Record` that
    knows its response tokens: from where the response starts, or each assistant turn's span (turn_spans); an expert
    none of whose records keeps a response token within `max_length` is refused (nothing of it would be scored), as
    is one whose conversations are all judged on nothing though none is cut (the template re-renders every turn).
    `numbers`: each text's record number in its file. `templated`: the texts and prompts are a chat template's output,
    encoded as the template wrote them (`encode`); the prompt alone is encoded by the same rule as its record, so the
    two agree up to where the response starts."""
    sequences: list[list[int]] = []
    for index, text in enumerate(texts):
        ids = encode(text, tokenizer, max_length, templated)
        if len(ids) == 0:
            raise FeatCalError(f"{where}: record {numbers[index] if numbers is not None else index} tokenises to nothing")
        prompt = prompts[index] if prompts is not None else None
        if prompt is None:
            sequences.append(list(ids))
        elif isinstance(prompt, list):  # a conversation's assistant turns
            sequences.append(Record(ids, spans=turn_spans(ids, text, prompt, tokenizer, templated)))
        else:
            prompt_ids = encode(prompt, tokenizer, templated=templated)
            start = response_start(ids, prompt_ids)
            if not templated and prompt_ids and start == len(ids) - 1 and ids[-1] == prompt_ids[-1] and ids[-1] in tokenizer.all_special_ids:
                start = len(ids)  # a truncated prompt and the special token the tokenizer appends (its EOS): no response
            sequences.append(Record(ids, start))
    if prompts is not None and any(p is not None for p in prompts) and all(isinstance(s, Record) and not s.spans for s in sequences):
        if all(prompt is None or _nothing_follows(text, prompt) for text, prompt in zip(texts, prompts)):
            raise FeatCalError(f"{where}: no record has a response to score: every response is empty")
        if all(isinstance(p, list) for p in prompts if p is not None) and all(len(s) < max_length for s in sequences):
            raise FeatCalError(f"{where}: no record has an assistant turn to judge: the chat template renders every one "
                               "otherwise once a user turn follows it (as Qwen3's drops its reasoning), so none is judged; "
                               "end each conversation on an assistant turn")  # no record was cut: max_length is not why
        raise FeatCalError(f"{where}: no record keeps a response token within featcal.max_length {max_length} "
                           "(the prompts fill it); raise max_length or shorten the prompts")
    return sequences


def _nothing_follows(text: str, prompt: str | list[tuple[str, str]]) -> bool:
    """Whether the record's text is its prompt's (every assistant turn's rendering, its prompt's): no response."""
    return text == prompt if isinstance(prompt, str) else all(before == through for before, through in prompt)


def calibration_sequences(
    data: dict[str, DataSpec],
    experts: list[str],
    tokenizer: Any,
    samples: int,
    max_length: int,
    shuffle: bool,
    seed: int,
    recipe_path: Path,
    resolved: dict[str, dict[str, str]] | None = None,
) -> dict[str, list[list[int]]]:
    """Expert name → token id lists. Fewer records than requested is a warning, not an error. `resolved`, where given,
    gets each expert's keys its defaults resolved from its data's fields (io/data_fields.py), where they did."""
    result = {}
    for expert in experts:
        spec = data[expert]
        where = f"{recipe_path}: featcal.data.{expert}"
        if data_path(spec, recipe_path.parent).is_file():
            check_file_options(spec, where)
        records = None if shuffle else plain_jsonl_records(data_path(spec, recipe_path.parent))
        if records is None:
            records = load_records(spec, where, recipe_path.parent)
        if len(records) == 0:
            raise no_records(spec, where)
        chosen = default_fields(spec, list(records[0]) if isinstance(records, list) else records.column_names, where)
        if chosen:  # as validate resolves them (check_fields)
            spec = spec.model_copy(update=chosen)
            if resolved is not None:
                resolved[expert] = chosen
        numbers = list(range(len(records)))  # each record's number in its file, which errors name
        if shuffle:
            records = records.shuffle(seed=seed)
            numbers = heavy_import("datasets").Dataset.from_dict({"number": numbers}).shuffle(seed=seed)["number"]  # datasets' same permutation
        wanted = spec.samples or samples
        if len(records) < wanted:
            warn(f"{where}: {len(records)} records, fewer than the {wanted} requested; using all of them")
        records = records[: min(wanted, len(records))] if isinstance(records, list) else records.select(range(min(wanted, len(records))))
        numbers = numbers[: len(records)]
        if spec.format == "chat":
            check_chat_template_parses(tokenizer, where)
        try:  # datasets decodes a text file's bytes while they are read
            texts = [record_to_text(record, spec, tokenizer, where, i) for i, record in zip(numbers, records)]
        except UnicodeDecodeError as error:
            raise FeatCalError(f"{where}.path: {spec.path}: {not_utf8(error)}") from None
        prompts = None if spec.format == "text" else [record_prompt(record, spec, tokenizer, where, i) for i, record in zip(numbers, records)]
        result[expert] = tokenize_texts(texts, tokenizer, max_length, where, prompts, numbers, templated=spec.format == "chat")
    return result
