"""A conversation under a template that renders an earlier assistant turn otherwise once a user turn follows it.

Qwen3's template drops an earlier turn's reasoning (`<think>...</think>`) and writes a think block only for the
assistant turns after the last user message, so a turn's tokens in the whole conversation are not the ones the expert
writes at that point (it writes a think block first). The judged tokens of such a turn are the ones both renders share
(io/data.turn_spans): none here, so the final exchange alone is judged, as Qwen3's own training masks do (they mask
the turns after the last user query); under a template that renders every turn alike, each one is.
Expected spans are counted from the rendered text, through the tokenizer's character offsets.
"""

from __future__ import annotations

import json

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import calibration_sequences
from featcal_llm.tiny import CHAT_TEMPLATE, build_char_tokenizer

# Qwen3's rule, written small: the last user message's index; turns after it render their reasoning in a think block
# (an empty one where they have none), turns before it their answer alone
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set answer = m.content.split('</think>')[-1] -%}"
    "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1] if '</think>' in m.content else '' -%}"
    "{%- if loop.index0 > ns.last_query -%}{{ '<|assistant|>' + '<think>' + reasoning + '</think>' + answer + eos_token }}"
    "{%- else -%}{{ '<|assistant|>' + answer + eos_token }}{%- endif -%}"
    "{%- else -%}{{ '<|' + m.role + '|>' + m.content + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
CONVERSATION = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "<think>add</think>5"},
                {"role": "user", "content": "and 4?"}, {"role": "assistant", "content": "<think>add again</think>9"}]
MARK = "<|assistant|>"


def _spans(tmp_path, template: str, conversation: list[dict], max_length: int = 512) -> tuple[str, tuple, object]:
    """The rendered conversation, its record's judged spans, and the token index at a character offset."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    spec = DataSpec(path="chat.jsonl", format="chat", messages="messages")
    [record] = calibration_sequences({"e": spec}, ["e"], tokenizer, 1, max_length, False, 0, tmp_path / "r.yaml")["e"]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(record) == encoded["input_ids"]
    starts = [start for start, _ in encoded["offset_mapping"]]
    return text, record.spans, lambda char: sum(start < char for start in starts)


def test_a_template_that_drops_earlier_reasoning_judges_the_final_exchange(tmp_path):
    text, spans, token = _spans(tmp_path, REASONING_TEMPLATE, CONVERSATION)
    assert "add</think>5" not in text and text.endswith(MARK + "<think>add again</think>9</s>")  # the earlier turn: "5" alone
    assert spans == ((token(text.rindex(MARK) + len(MARK)), token(len(text))),)
    _, without_reasoning, _ = _spans(tmp_path, REASONING_TEMPLATE, [{**turn, "content": turn["content"].split("</think>")[-1]}
                                                                 for turn in CONVERSATION])
    assert len(without_reasoning) == 1  # the empty think block a last turn gets is a re-render too


def test_a_template_that_renders_every_turn_alike_judges_each(tmp_path):
    text, spans, token = _spans(tmp_path, CHAT_TEMPLATE, CONVERSATION)
    first = text.index(MARK) + len(MARK)
    second = text.rindex(MARK) + len(MARK)
    # a middle turn ends where the conversation through it ends within the whole one: past its EOS
    assert spans == ((token(first), token(text.index("<|user|>", first))), (token(second), token(len(text))))


def test_conversations_whose_every_turn_is_re_rendered_are_refused_for_that_not_for_max_length(tmp_path):
    ends_on_user = CONVERSATION[:3]  # its one assistant turn comes before the last user message: rendered "5" alone
    tokenizer = build_char_tokenizer()
    text = tokenizer.apply_chat_template(ends_on_user, tokenize=False, chat_template=REASONING_TEMPLATE)
    assert len(text) < 512 and "<think>" not in text  # nothing is cut
    with pytest.raises(FeatCalError, match=r"^.*r\.yaml: featcal\.data\.e: no record has an assistant turn to judge: the chat "
                       r"template renders every one otherwise once a user turn follows it \(as Qwen3's drops its "
                       r"reasoning\), so none is judged; end each conversation on an assistant turn$"):
        _spans(tmp_path, REASONING_TEMPLATE, ends_on_user)
    _, spans, _ = _spans(tmp_path, CHAT_TEMPLATE, ends_on_user)  # a template that renders it alike judges it
    assert len(spans) == 1
    whole = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, chat_template=REASONING_TEMPLATE)
    cut = len(tokenizer(whole[:whole.rindex(MARK) + len(MARK)], add_special_tokens=False)["input_ids"])  # through its mark
    with pytest.raises(FeatCalError, match=rf"no record keeps a response token within featcal\.max_length {cut} "):
        _spans(tmp_path, REASONING_TEMPLATE, CONVERSATION, max_length=cut)  # cut before its final turn: max_length is why
