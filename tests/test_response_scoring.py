"""Prompt/response records are scored on their response alone.

An expert trained on answers can trail the merge over every token of a record (its prompt is whatever the user
typed) and still be the only model that knows the answers. For `alpaca`, `chat` and `completion` data the net lead
over the merge, which decides whose records the merge teaches (`trailing_experts: merge`, the default), counts the
response's tokens only; the token weights and the samples still count every token.

The reference takes the response's start from the prompt's own token count (the tokenizer, not the product's
prefix rule) and the leads from each whole HF model's forward (tests/reference.py); the updates must agree to 1e-8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from reference import advantage_token_weights, brute_force_featcal, mean_leads
from test_coverage import card_front, trained_scenario
from test_exactness import TOLERANCE, calibration_sequences, delta_error, load, read_weights

from featcal_llm.errors import FeatCalError
from featcal_llm.io.records import Record
from featcal_llm.engine.streams import make_batches
from featcal_llm.engine.scoring import response_positions, scored_positions
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import response_start, tokenize_texts, record_prompt, record_to_text
from featcal_llm.pipeline import run_recipe
from featcal_llm.tiny import build_char_tokenizer

RECORD = {"instruction": "add 2 and 3", "input": "", "prompt": "2+3=", "response": "5 ok", "completion": "5 ok"}


@pytest.mark.parametrize("fmt, scored", [("completion", "5 ok"), ("alpaca", "5 ok"), ("chat", "5 ok</s>")])
def test_each_prompt_response_format_scores_the_response_s_tokens(fmt, scored):
    tokenizer = build_char_tokenizer()  # one token per character: the response's tokens are known without the product
    spec = DataSpec(path="x.jsonl", format=fmt)
    text, prompt = record_to_text(RECORD, spec, tokenizer, "d", 0), record_prompt(RECORD, spec, tokenizer, "d", 0)
    [record] = tokenize_texts([text], tokenizer, 512, "d", [prompt])
    assert isinstance(record, Record) and tokenizer.decode(record[record.response_from:]) == scored
    assert record.response_from == len(record) - len(tokenizer(scored, add_special_tokens=False)["input_ids"])
    assert record_prompt({"text": "x"}, DataSpec(path="x.jsonl"), tokenizer, "d", 0) is None  # plain text: every token


def test_a_chat_that_ends_on_the_user_s_turn_scores_every_token():
    tokenizer = build_char_tokenizer()
    spec = DataSpec(path="x.jsonl", format="chat", messages="messages")
    assert record_prompt({"messages": [{"role": "user", "content": "hi"}]}, spec, tokenizer, "d", 0) is None


def test_the_response_starts_where_the_record_and_its_prompt_first_differ():
    assert response_start([5, 6, 7, 8], [5, 6]) == 2
    assert response_start([5, 6, 9, 8], [5, 6, 7]) == 2  # a token spanning the boundary is the response's
    assert response_start([5, 6], [5, 6, 7]) == 2  # truncated inside the prompt: nothing is scored


def test_prompts_that_fill_max_length_are_one_line():
    tokenizer = build_char_tokenizer()
    with pytest.raises(FeatCalError, match=r"^d: no record keeps a response token within featcal\.max_length 4 ") as error:
        tokenize_texts(["2+3=5", "1+1=2"], tokenizer, 4, "d", ["2+3=", "1+1="])
    assert "\n" not in str(error.value)
    with pytest.raises(FeatCalError, match=r"^d: no record has a response to score: every response is empty$"):  # not the prompts' length
        tokenize_texts(["2+3=", "1+1="], tokenizer, 64, "d", ["2+3=", "1+1="])
    [whole] = tokenize_texts(["a"], tokenizer, 64, "d", [""])  # an empty prompt: every token is the response
    assert whole.response_from == 0 and len(whole) == 1


def test_a_tokenizer_that_appends_its_eos_does_not_make_a_truncated_prompt_a_response():
    """Truncation keeps the EOS such a tokenizer appends: a record cut inside its prompt ends in that EOS, which the
    prompt's own encoding ends in too; it is no response token, so no record keeps one and the run says so."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tokenizer.bos_token_id), ("</s>", tokenizer.eos_token_id)])
    [whole] = tokenize_texts(["2+3=5"], tokenizer, 64, "d", ["2+3="])
    assert whole.response_from == 5 and list(whole)[5:] == [tokenizer.convert_tokens_to_ids("5"), tokenizer.eos_token_id]
    with pytest.raises(FeatCalError, match=r"^d: no record keeps a response token within featcal\.max_length 4 "):
        tokenize_texts(["2+3=5", "1+1=2"], tokenizer, 4, "d", ["2+3=", "1+1="])


def test_only_the_response_s_predictions_count_for_the_lead_and_plain_batches_have_no_mask():
    [batch] = make_batches([Record([3, 4, 5, 6], 2), [7, 8, 9]], 100)
    assert response_positions(batch).tolist() == [[False, True, True, False], [True, True, False, False]]
    assert scored_positions(batch).tolist() == [[True, True, True, False], [True, True, False, False]]
    assert make_batches([[3, 4, 5]], 100)[0].response is None


def _as_completion(scenario, split: float = 0.5) -> dict[str, list[int]]:
    """Each record's text split in two (prompt, completion), written as completion records; the prompts' token counts."""
    tokenizer = build_char_tokenizer()
    starts = {}
    for name, path in scenario.data.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            cut = max(1, int(len(row["text"]) * split))
            row.update(prompt=row["text"][:cut], completion=row["text"][cut:])  # TRL's field names
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        starts[str(scenario.experts[name])] = [len(tokenizer(row["prompt"])["input_ids"]) for row in rows][:12]
    return starts


def test_leads_weights_and_teachers_count_the_response_alone(tmp_path):
    scenario = trained_scenario(tmp_path / "scenario", "llama", (24, 6))
    starts = _as_completion(scenario)
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), batch_tokens=150,
                                                  dtype="float64", token_weights="expert_lead", trailing_experts=None).read_text())
    recipe["featcal"] = {key: value for key, value in recipe["featcal"].items() if value is not None}  # the default teachers
    for spec in recipe["featcal"]["data"].values():
        spec.update(format="completion")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)

    merged, base = load(scenario.root / "merged", torch.float64), load(scenario.base, torch.float64)
    experts = {str(p): load(p, torch.float64) for p in scenario.experts.values()}
    sequences = {str(scenario.experts[n]): s for n, s in calibration_sequences(scenario, 12, 64).items()}
    leads = mean_leads(merged, experts, sequences, starts)
    every_token = mean_leads(merged, experts, sequences)
    first, second = experts
    assert leads[first] > 0 and leads[second] < 0 and abs(leads[second] - every_token[second]) > 0.01, (leads, every_token)
    # the weights count every token; a record of a leading expert that trails on its response weighs 0
    weights = advantage_token_weights(merged, experts, sequences, judged_starts=starts)
    teachers = {first: experts[first], second: merged}  # expert1 trails on its responses: the merge teaches them
    alike = {first: weights[first], second: [torch.ones(len(s), dtype=torch.float64) for s in sequences[second]]}
    reference = brute_force_featcal(merged, base, teachers, sequences, 1e-3, 0.3, 0.5, 1e-8, token_weights=alike).state_dict()
    ours, merged_weights = read_weights(output), read_weights(scenario.root / "merged")
    changed = [name for name in ours if not torch.equal(ours[name], merged_weights[name])]
    errors = {name: delta_error(ours[name], reference[name], merged_weights[name]) for name in changed}
    assert changed and max(errors.values()) <= TOLERANCE, errors
    front = card_front(output)["featcal"]
    assert front["taught_by_merge"] == {"expert1": pytest.approx(leads[second], abs=1e-4)}
    scored = sum(len(s) - 1 for s in sequences[first])
    every = advantage_token_weights(merged, experts, sequences, drop_trailing_records=False)
    assert front["expert_lead"]["expert0"]["tokens_ahead"] == round(float((torch.cat(every[first]) > 0.5).sum()) / scored, 4)


def test_completion_records_without_their_fields_are_one_line_and_write_nothing(tmp_path):
    from scenario import build_scenario

    from featcal_llm.io.validate import validate_recipe

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    for spec in recipe["featcal"]["data"].values():
        spec.update(format="completion", response="answer")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert len(validate_recipe(tmp_path / "r.yaml")) == 2
    with pytest.raises(FeatCalError) as error:
        run_recipe(tmp_path / "r.yaml", progress=False)
    lines = str(error.value).splitlines()  # one line per expert, each naming its data entry and the missing field
    assert len(lines) == 2 and all(".featcal.data." not in line and "featcal.data." in line and "has no field 'prompt' (fields: text)"
                                   in line for line in lines), lines
    assert not (tmp_path / "out").exists()


def test_completion_reads_trl_s_field_names_by_default():
    spec = DataSpec(path="x.jsonl", format="completion")
    assert (spec.prompt, spec.response) == ("prompt", "completion")
    assert DataSpec(path="x.jsonl", format="completion", response="answer").response == "answer"  # a named field wins
    assert DataSpec(path="x.jsonl", format="alpaca").response == DataSpec(path="x.jsonl", format="chat").response == "response"
    tokenizer = build_char_tokenizer()
    record = {"prompt": "2+3=", "completion": "5"}
    assert record_to_text(record, spec, tokenizer, "d", 0) == "2+3=5" and record_prompt(record, spec, tokenizer, "d", 0) == "2+3="


@pytest.mark.parametrize("field, value, kind", [
    ("prompt", [{"role": "user", "content": "2+3="}], "a list of messages (TRL's conversational form)"),
    ("completion", [{"role": "assistant", "content": "5"}], "a list of messages (TRL's conversational form)"),
    ("completion", 5, "a number (int)"),
])
def test_completion_refuses_a_field_that_is_not_a_string_in_one_line(field, value, kind):
    tokenizer = build_char_tokenizer()
    spec = DataSpec(path="cal.jsonl", format="completion")
    record = {"prompt": "2+3=", "completion": "5", field: value}
    for read in (record_to_text, record_prompt) if field == "prompt" else (record_to_text,):
        with pytest.raises(FeatCalError) as error:
            read(record, spec, tokenizer, "r.yaml: featcal.data.e", 3)
        assert str(error.value) == (f"r.yaml: featcal.data.e.path: cal.jsonl: record 3: field {field!r} is {kind}, not a string; "
                                    "format: completion reads string prompt and completion fields (for messages, use format: chat "
                                    "with messages)")


def test_a_conversational_completion_file_is_refused_before_anything_is_written(tmp_path):
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=4)
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["output"] = str(tmp_path / "out")
    for spec in recipe["featcal"]["data"].values():
        spec.update(format="completion")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}] * 4
    for path in scenario.data.values():  # nested: read through datasets, as a hub set is
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(FeatCalError) as error:
        run_recipe(tmp_path / "r.yaml", progress=False)
    lines = str(error.value).splitlines()  # the recipe's check refuses each expert's file, one line each, before any model loads
    assert len(lines) == len(scenario.data)
    assert all(": record 0: field 'prompt' is a list of messages (TRL's conversational form)" in line for line in lines)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec, record, field, kind", [
    (DataSpec(path="cal.jsonl"), {"text": None}, "text", "null (or missing: datasets fills a field some records lack with null)"),
    (DataSpec(path="cal.jsonl", format="alpaca"), {"instruction": ["a", "b"], "response": "c"}, "instruction", "a list"),
    (DataSpec(path="cal.jsonl", format="alpaca"), {"instruction": "a", "input": 3, "response": "c"}, "input", "a number (int)"),
    (DataSpec(path="cal.jsonl", format="chat"), {"prompt": "hi", "response": {"text": "yo"}}, "response", "a dict"),
])
def test_every_format_refuses_a_text_field_that_is_not_text(spec, record, field, kind):
    """Not only completion: a null text or a list instruction was calibrated on as its Python repr ('None', "['a', 'b']")."""
    with pytest.raises(FeatCalError) as error:
        record_to_text(record, spec, build_char_tokenizer(), "r.yaml: featcal.data.e", 2)
    assert str(error.value).startswith(f"r.yaml: featcal.data.e.path: cal.jsonl: record 2: field {field!r} is {kind}, not a string; "
                                       f"format: {spec.format} reads it as text")


@pytest.mark.parametrize("format_, field", [("text", "text"), ("completion", "prompt")])
def test_a_column_of_texts_in_record_0_is_named_as_one_json_object_of_columns(format_, field):
    """What a JSON file holding one object of lists becomes: its lists of strings are columns, not chat messages."""
    record = {"text": ["a", "b"], "prompt": ["a", "b"], "completion": ["x", "y"]}
    with pytest.raises(FeatCalError) as error:
        record_to_text(record, DataSpec(path="cal.json", format=format_), build_char_tokenizer(), "r.yaml: featcal.data.e", 0)
    message = str(error.value)
    assert f"record 0: field {field!r} is a list, not a string;" in message and "messages (TRL" not in message
    assert message.endswith("a JSON file holding one object of lists (columns) is one record to datasets: write one record "
                            "per line (JSON lines) or an array of records")


def test_validate_refuses_what_run_refuses_in_the_records_run_reads(tmp_path):
    """validate checks the text fields of the first `samples` records (the ones run converts), not the ones after."""
    from featcal_llm.io.validate_data import check_data

    rows = [{"text": "fine"}] * 3 + [{"text": ["not", "text"]}]
    (tmp_path / "cal.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = DataSpec(path="cal.jsonl")
    check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, [], taken=3)
    with pytest.raises(FeatCalError, match=r"record 3: field 'text' is a list, not a string"):
        check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, [], taken=4)


@pytest.mark.parametrize("path, looked", [
    ("~/nowhere", ": run takes a path as written, so `~` would be a folder of that name here; write the path out in full"),
    ("./nowhere/x", " in the current directory nor beside the recipe ({tmp_path})"), ("/abs/nowhere", "")])
def test_validate_and_the_loader_take_the_same_paths_for_local_ones(tmp_path, path, looked):
    """One rule for what reads as a hub dataset id: a missing `~/…`, `./…` or absolute path is a missing local file to
    both `validate` and the loader `run` calls (the loader used to send `~/nowhere` to the hub), in one line saying
    where it was looked for: `~` is not expanded (as for featcal.output), a relative path in two places."""
    from featcal_llm.io.data_files import load_records
    from featcal_llm.io.validate_data import check_data

    spec = DataSpec(path=path)
    for check in (lambda: check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, []),
                  lambda: load_records(spec, "r.yaml: featcal.data.e", tmp_path)):
        with pytest.raises(FeatCalError) as refused:
            check()
        assert str(refused.value) == f"r.yaml: featcal.data.e.path: {Path(path)}: calibration file not found" + looked.format(tmp_path=tmp_path)


def test_a_dotted_hub_id_is_an_id_and_a_file_type_is_a_file():
    """The one hub-id rule: dots inside a repository name (a version) do not make it a file; a file type does."""
    from featcal_llm.io.data_files import looks_like_hub_id

    for value in ("teknium/OpenHermes-2.5", "meta-llama/Llama-3.1-8B-Instruct", "someone/calibration-set"):
        assert looks_like_hub_id(value), value
    for value in ("data/cal.jsonl", "data/cal.txt", "data/cal.CSV", "./a/b", "~/a", "/abs/x", "a/b/c", "cal.jsonl"):
        assert not looks_like_hub_id(value), value


def test_a_shuffled_records_error_names_its_number_in_the_file(tmp_path):
    """`shuffle: true` takes records in datasets' seeded order; an error names the record's line in its file, not its
    position after the shuffle."""
    from featcal_llm.io.data import calibration_sequences

    rows = [{"text": f"record {i}"} for i in range(12)]
    rows[7] = {"text": ""}
    (tmp_path / "cal.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = {"e": DataSpec(path="cal.jsonl")}
    order = [row["text"] for row in __import__("datasets").Dataset.from_list(rows).shuffle(seed=3)]
    assert order.index("") != 7  # the shuffle moves it
    with pytest.raises(FeatCalError) as error:
        calibration_sequences(data, ["e"], build_char_tokenizer(), 12, 64, True, 3, tmp_path / "r.yaml")
    assert "cal.jsonl: record 7: field 'text' is empty" in str(error.value)


def test_a_blank_chat_template_is_no_template_to_validate_and_run(tmp_path):
    """transformers loads an empty chat_template.jinja as "", which renders every conversation as nothing: validate
    (from the files) and run (from the loaded tokenizer) both read it as no template, as they read a missing one."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from featcal_llm.io.data import record_to_text
    from featcal_llm.io.model_files import carries_chat_template, has_chat_template

    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("  \n")
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template is not None and not carries_chat_template(loaded) and not has_chat_template(tmp_path)
    with pytest.raises(FeatCalError, match=r"\.format: chat needs a tokenizer with a chat template"):
        record_to_text({"messages": [{"role": "user", "content": "hi"}]}, DataSpec(path="c.jsonl", format="chat"), loaded, "d", 0)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert has_chat_template(tmp_path) and carries_chat_template(AutoTokenizer.from_pretrained(tmp_path))
    named = [{"name": "default", "template": "{{ messages }}"}]  # tokenizer_config.json's older list form
    assert carries_chat_template(SimpleNamespace(chat_template=named))
    assert not carries_chat_template(SimpleNamespace(chat_template={"default": ""}))


def test_the_log_says_on_its_responses_only_for_the_experts_judged_on_them(tmp_path, capsys):
    """An expert given prompt/response records is judged on its responses; one given plain text, on every token."""
    from scenario import build_scenario

    scenario = build_scenario(tmp_path / "scenario", experts=2, layers=1, samples=6, dtype="float64")
    _as_completion(scenario)
    recipe = yaml.safe_load(scenario.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"),
                                                  token_weights="expert_lead").read_text())
    recipe["featcal"]["data"][str(scenario.experts["expert0"])].update(format="completion")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_recipe(tmp_path / "r.yaml", progress=False)
    [line] = [line for line in capsys.readouterr().err.splitlines() if "tokens weighed by the expert's lead" in line]
    first, second = line.split("; ")
    assert "expert0 ahead on" in first and "(net of where it trails, on its responses: " in first, line
    assert "expert1 ahead on" in second and "(net of where it trails: " in second, line


def test_the_tokens_a_record_is_judged_on_are_those_whose_successor_is_scored():
    """Plain text: every token but the last (a one-token record has none); prompt/response: from the response's start."""
    from featcal_llm.io.records import judged_positions
    from featcal_llm.maths.advantage import judged_tokens

    assert (judged_tokens(1, [(0, 1)]), judged_tokens(5, [(0, 5)]), judged_tokens(5, [(3, 5)]), judged_tokens(3, [])) == (0, 4, 2, 0)
    assert judged_tokens(9, [(2, 4), (6, 9)]) == 5 == len(judged_positions(9, [(2, 4), (6, 9)]))  # two assistant turns


def test_a_tokenizer_that_truncates_on_the_left_still_keeps_each_record_s_start():
    """featcal.max_length keeps a record's first tokens whatever side the tokenizer truncates on for its own uses (some
    ship `truncation_side: left`): cut from the left, a record would lose its BOS and prompt, and the LCP rule would
    judge what is left of the prompt as response. Reference: one token a character, so the ids are the text's."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    tokenizer.truncation_side = "left"
    [record] = tokenize_texts(["2+3=five!"], tokenizer, 7, "d", ["2+3="])
    assert list(record) == [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids(list("2+3=fi"))
    assert record.response_from == 5 and tokenizer.truncation_side == "left"  # the tokenizer is left as it was


def test_a_completion_record_with_nothing_in_it_is_refused_alike_naming_the_file_and_fields(tmp_path):
    """An empty prompt with an empty completion is no text at all: `validate` passed it and `run` stopped on
    "record 1 tokenises to nothing", naming neither the file nor the fields. Both now say the same line."""
    from featcal_llm.io.data import calibration_sequences
    from featcal_llm.io.validate_data import check_data

    (tmp_path / "d.jsonl").write_text('{"prompt": "2+3=", "completion": "5"}\n{"prompt": "", "completion": ""}\n')
    spec = DataSpec(path="d.jsonl", format="completion")
    line = r"^r\.yaml: featcal\.data\.e\.path: d\.jsonl: record 1: fields 'prompt' and 'completion' are both empty; drop the record or fill it$"
    with pytest.raises(FeatCalError, match=line):
        check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, [])
    for shuffle in (False, True):
        with pytest.raises(FeatCalError, match=line.replace("^r", "^" + str(tmp_path).replace(".", r"\.") + "/r")):
            calibration_sequences({"e": spec}, ["e"], build_char_tokenizer(), 4, 64, shuffle, 0, tmp_path / "r.yaml")
