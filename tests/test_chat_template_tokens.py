"""A chat template's output is tokenised as the template wrote it, with no special token the tokenizer would add.

transformers' `apply_chat_template(tokenize=True)` and vLLM's chat path encode the rendered template with
`add_special_tokens=False`: the template is the whole truth (a BOS it omits is omitted on purpose; the EOS it writes
after a turn is the only one). A tokenizer saved with `add_eos_token: true` (Llama/Mistral sentencepiece-style: its
post-processor appends `</s>` and prepends `<s>`) must not wrap a template's output in a second BOS and EOS, in
calibration records (`format: chat`), in the prompt-alone encoding that says where their response starts, or in the
prompts generation continues. Plain text (no template) keeps the tokenizer's special tokens.

Reference: the same tokenizer's own `apply_chat_template(messages, tokenize=True)` ids, independently of the product.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors
from transformers import AutoTokenizer, LlamaConfig

from featcal_llm.generation.prompts import resolve_start
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import calibration_sequences
from featcal_llm.tiny import CHAT_TEMPLATE, build_char_tokenizer

# tiny.CHAT_TEMPLATE less its leading BOS: a template (ChatML-like) that deliberately starts without one.
NO_BOS_TEMPLATE = CHAT_TEMPLATE.removeprefix("{{ bos_token }}")
TEMPLATES = [pytest.param(CHAT_TEMPLATE, id="template-writes-bos"), pytest.param(NO_BOS_TEMPLATE, id="template-without-bos")]
MESSAGES = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2 ok"}]


def eos_adding_tokenizer(folder: Path, template: str):
    """A one-token-a-character tokenizer saved as a Llama-style one with `add_bos_token`/`add_eos_token`, read back
    by AutoTokenizer: plain text encodes as <s> text </s>."""
    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tokenizer.bos_token_id), ("</s>", tokenizer.eos_token_id)])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True, "add_eos_token": True}))
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded("hi")["input_ids"] == [1, *loaded.convert_tokens_to_ids(["h", "i"]), 2]  # it adds BOS and EOS
    return loaded


def template_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    """transformers' own encoding of the messages through the chat template."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              add_generation_prompt=add_generation_prompt)["input_ids"])


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_chat_record_s_ids_and_response_are_the_template_s_own_with_a_tokenizer_that_adds_eos(tmp_path, template):
    tokenizer = eos_adding_tokenizer(tmp_path / "tok", template)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    spec = DataSpec(path="chat.jsonl", format="chat", messages="messages")
    [record] = calibration_sequences({"e": spec}, ["e"], tokenizer, 1, 512, False, 0, tmp_path / "r.yaml")["e"]
    whole = template_ids(tokenizer, MESSAGES)
    assert list(record) == whole
    assert whole.count(tokenizer.eos_token_id) == len(MESSAGES) and whole[-2] != tokenizer.eos_token_id  # one </s> a turn
    # Each assistant turn starts where the conversation before it, encoded as transformers encodes it, ends (one token
    # a character, so that is its length), and ends with the conversation through it: its text and the EOS its
    # template writes.
    first, prompt = (template_ids(tokenizer, MESSAGES[:turn], add_generation_prompt=True) for turn in (1, 3))
    assert whole[:len(prompt)] == prompt and record.spans == ((len(first), len(template_ids(tokenizer, MESSAGES[:2]))), (len(prompt), len(whole)))
    assert [tokenizer.decode(whole[start:end]) for start, end in record.spans] == ["5</s>", "2 ok</s>"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_generation_continues_the_template_s_own_ids_with_a_tokenizer_that_adds_eos(tmp_path, template):
    tokenizer = eos_adding_tokenizer(tmp_path / "tok", template)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    prompted = resolve_start(["hi"], "prompts", "on", tokenizer, config, "generate")
    assert prompted.ids == (tuple(template_ids(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)),)
    empty = resolve_start(None, "", "empty", tokenizer, config, "generate")
    assert empty.ids == (tuple(template_ids(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=True)),)


def test_plain_text_records_keep_the_tokenizer_s_special_tokens(tmp_path):
    """No template, no change: a `text` record and a `completion` record are what the tokenizer makes of them."""
    tokenizer = eos_adding_tokenizer(tmp_path / "tok", NO_BOS_TEMPLATE)
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "2+3=5", "prompt": "2+3=", "completion": "5"}) + "\n")
    for fmt in ("text", "completion"):
        spec = DataSpec(path="t.jsonl", format=fmt)
        [record] = calibration_sequences({"e": spec}, ["e"], tokenizer, 1, 512, False, 0, tmp_path / "r.yaml")["e"]
        assert list(record) == tokenizer("2+3=5")["input_ids"] == [1, *tokenizer.convert_tokens_to_ids(list("2+3=5")), 2]
    assert record.response_from == 5  # past <s>2+3=: the prompt's own </s> is not the response's
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    raw = resolve_start(["hi"], "prompts", "off", tokenizer, config, "generate")
    assert raw.ids == ((1, *tokenizer.convert_tokens_to_ids(["h", "i"])),)  # BOS kept, the appended EOS dropped
