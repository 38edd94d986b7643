"""A conversation is judged on every assistant turn, as TRL's assistant_only_loss trains on them: turn by turn against
transformers' prefix renders, with one BOS, and the recorded lead against a brute force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from reference import _token_leads
from test_coverage import trained_scenario
from test_exactness import load

from featcal_llm.engine.streams import make_batches
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import tokenize_texts, record_prompt, record_to_text
from featcal_llm.pipeline import run_recipe
from featcal_llm.tiny import build_char_tokenizer


GENERATION_TEMPLATE = (  # tiny.CHAT_TEMPLATE with the assistant's turns marked, for transformers' assistant mask
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def assistant_turns_by_prefix_renders(tokenizer, messages) -> list[list[int]]:
    """Independent of the product: each assistant turn's ids, as transformers' own `apply_chat_template` renders them:
    the conversation through the turn less the conversation before it with the generation prompt (a prefix of it)."""
    turns = []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:index], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            through = tokenizer.apply_chat_template(messages[:index + 1], tokenize=True, return_dict=True)["input_ids"]
            assert through[:len(before)] == before
            turns.append(list(through[len(before):]))
    return turns


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5, é\r\n"}]


def test_a_conversation_is_judged_on_every_assistant_turn_with_one_bos():
    """Every assistant turn is judged, as TRL's `assistant_only_loss` trains on every one; the system and user turns
    between them are not. Against transformers' own renders of the conversation's prefixes (each turn's ids, turn by
    turn) and its `apply_chat_template(return_assistant_tokens_mask=True)`; the record's ids are the template's (a
    tokenizer that adds BOS does not add a second one to the template's). `max_length` cuts the spans with the ids."""
    from tokenizers.processors import TemplateProcessing

    from featcal_llm.engine.refine_data import judged_positions as refine_judged, pad
    from featcal_llm.io.records import judged_positions, response_mask

    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    tokenizer.chat_template = GENERATION_TEMPLATE
    spec = DataSpec(path="x.jsonl", format="chat", messages="messages")
    record = {"messages": CONVERSATION}
    text, prompt = record_to_text(record, spec, tokenizer, "d", 0), record_prompt(record, spec, tokenizer, "d", 0)
    [ids] = tokenize_texts([text], tokenizer, 512, "d", [prompt])
    reference = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert list(ids) == reference["input_ids"] and list(ids).count(tokenizer.bos_token_id) == 1
    turns = assistant_turns_by_prefix_renders(tokenizer, CONVERSATION)
    assert [list(ids[start:end]) for start, end in ids.spans] == turns and len(turns) == 2  # "2</s>", then "5, é\r\n</s>"
    assert response_mask(len(ids), ids.spans) == [bool(flag) for flag in reference["assistant_masks"]]
    assert judged_positions(len(ids), ids.spans) == [p for p in range(len(ids) - 1) if reference["assistant_masks"][p + 1]]
    [batch] = make_batches([ids], 10_000)  # the token-weight pass's mask and the refine stage's positions say the same
    assert batch.response[0].tolist() == response_mask(len(ids), ids.spans)
    assert refine_judged(ids) == judged_positions(len(ids), ids.spans) and pad([("e", 0)], {"e": [ids]}).judged[0].tolist() == [
        p in refine_judged(ids) for p in range(len(ids))]
    cut = ids.spans[1][0] + 3  # inside the second answer: its first three tokens are left
    [short] = tokenize_texts([text], tokenizer, cut, "d", [prompt])
    assert list(short) == list(ids)[:cut] and short.spans == (ids.spans[0], (ids.spans[1][0], cut))
    [first] = tokenize_texts([text], tokenizer, ids.spans[0][1] - 1, "d", [prompt])  # inside the first: the second is gone
    assert first.spans == ((ids.spans[0][0], ids.spans[0][1] - 1),)
    ends_on_user = {"messages": CONVERSATION + [{"role": "user", "content": "ok"}]}  # the answers before it are still judged
    [longer] = tokenize_texts([record_to_text(ends_on_user, spec, tokenizer, "d", 0)], tokenizer, 512, "d",
                              [record_prompt(ends_on_user, spec, tokenizer, "d", 0)])
    assert longer.spans == ids.spans and len(longer) > len(ids)


def _as_conversations(scenario) -> dict[str, list[list[dict]]]:
    """Each record's text cut in four, written as a conversation: user, assistant, user, assistant."""
    conversations = {}
    for name, path in scenario.data.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            text = row["text"]
            cuts = [0, *(max(1, len(text) * k // 4) for k in (1, 2, 3)), len(text)]
            roles = ["user", "assistant", "user", "assistant"]
            row["messages"] = [{"role": role, "content": text[a:b]} for role, a, b in zip(roles, cuts, cuts[1:])]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        conversations[str(scenario.experts[name])] = [row["messages"] for row in rows]
    return conversations


def test_a_conversation_s_lead_is_its_every_assistant_turn_s_by_brute_force(tmp_path):
    """The mean lead the run records for chat data equals one computed by hand from the whole models' per-token
    log-probabilities on exactly the tokens of every assistant turn, each found by transformers' own renders of the
    conversation's prefixes (cut at max_length as the records are); the last turn alone gives another lead."""
    from test_coverage import exact_weights
    from transformers import AutoTokenizer

    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    conversations = _as_conversations(scenario)
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150,
                                                  dtype="float64", token_weights="expert_lead").read_text())
    for spec in recipe["featcal"]["data"].values():
        spec.update(format="chat", messages="messages")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)

    tokenizer = AutoTokenizer.from_pretrained(scenario.root / "merged")
    merged = load(scenario.root / "merged", torch.float64)
    length = recipe["featcal"]["max_length"]
    by_hand, last_only = {}, {}
    for path, expert in ((str(p), load(p, torch.float64)) for p in scenario.experts.values()):
        sums = {"every": [0.0, 0], "last": [0.0, 0]}
        for messages in conversations[path][:recipe["featcal"]["samples"]]:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][:length]
            lead = _token_leads(merged, expert, ids)  # at p: the lead on token p + 1
            starts, turns = [], assistant_turns_by_prefix_renders(tokenizer, messages)
            for index, message in enumerate(messages):
                if message["role"] == "assistant":
                    starts.append(len(tokenizer.apply_chat_template(messages[:index], tokenize=True, add_generation_prompt=True,
                                                                    return_dict=True)["input_ids"]))
            for key, spans in (("every", list(zip(starts, turns))), ("last", [(starts[-1], turns[-1])])):
                for start, turn in spans:
                    judged = [p for p in range(start - 1, start + len(turn) - 1) if p + 1 < len(ids)]
                    assert [ids[p + 1] for p in judged] == turn[:len(judged)]
                    sums[key][0] += float(lead[judged].sum())
                    sums[key][1] += len(judged)
        name = Path(path).name
        by_hand[name], last_only[name] = (sums["every"][0] / sums["every"][1]), (sums["last"][0] / sums["last"][1])
    recorded = exact_weights(output)["expert_lead"]
    for name in by_hand:
        assert recorded[name]["net_lead"] == pytest.approx(by_hand[name], abs=6e-5), (name, recorded, by_hand, last_only)
    assert max(abs(by_hand[name] - last_only[name]) for name in by_hand) > 1e-3, (by_hand, last_only)
