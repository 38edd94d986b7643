"""The record fields a data entry leaves to the default, resolved from its data's fields as TRL and datasets users expect.

`format: chat` with none of messages/prompt/response given reads a `messages` column (HF's conversational form,
HuggingFaceH4/ultrachat_200k's) where the records lack prompt/response; `format: alpaca` without `response` reads
`output` (tatsu-lab/alpaca's name) where the records lack `response`. A dataset that already resolved keeps its reading
(both present: today's fields), and its settings digests do not move. Neither present: one line naming the file and
its fields, by validate and run alike.

References, independent of the product: the tokenizer's own `apply_chat_template(messages, tokenize=True)` ids, the
Alpaca template filled by hand, and the same recipe with the keys written out (same sequences, same weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import ALPACA_NO_INPUT, ALPACA_WITH_INPUT, calibration_sequences
from featcal_llm.io.validate_data import check_data
from featcal_llm.tiny import build_char_tokenizer
from scenario import build_scenario

CONVERSATIONS = [
    [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok bye"}],
]
ALPACA = [{"instruction": "add 2 and 3", "input": "", "output": "5"},
          {"instruction": "name a colour", "input": "warm ones", "output": "red"}]


def write_source(folder: Path, rows: list[dict], kind: str) -> str:
    """The rows as a JSON-lines file, a parquet file or a folder `save_to_disk` wrote (hub-style columns)."""
    import datasets

    if kind == "jsonl":
        (folder / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(folder / "d.jsonl")
    if kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "d.parquet"))
        return str(folder / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(folder / "saved"))
    return str(folder / "saved")


def sequences(spec: DataSpec, folder: Path, tokenizer=None) -> list:
    tokenizer = tokenizer or build_char_tokenizer()
    return calibration_sequences({"e": spec}, ["e"], tokenizer, 8, 512, False, 0, folder / "r.yaml")["e"]


def as_pairs(records: list) -> list:
    return [(list(record), getattr(record, "response_from", None)) for record in records]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_format_chat_reads_a_messages_column_by_default_as_the_template_encodes_it(tmp_path, kind):
    path = write_source(tmp_path, [{"messages": turns, "id": str(i)} for i, turns in enumerate(CONVERSATIONS)], kind)
    tokenizer = build_char_tokenizer()
    read = sequences(DataSpec(path=path, format="chat"), tmp_path, tokenizer)
    expected = [list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"]) for turns in CONVERSATIONS]
    assert [list(record) for record in read] == expected
    assert as_pairs(read) == as_pairs(sequences(DataSpec(path=path, format="chat", messages="messages"), tmp_path, tokenizer))


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_format_alpaca_reads_an_output_column_where_the_records_have_no_response(tmp_path, kind):
    path = write_source(tmp_path, ALPACA, kind)
    tokenizer = build_char_tokenizer()
    read = sequences(DataSpec(path=path, format="alpaca"), tmp_path, tokenizer)
    texts = [(ALPACA_WITH_INPUT if row["input"] else ALPACA_NO_INPUT).format(instruction=row["instruction"], input=row["input"],
                                                                             response=row["output"]) for row in ALPACA]
    assert [list(record) for record in read] == [tokenizer(text)["input_ids"] for text in texts]
    assert as_pairs(read) == as_pairs(sequences(DataSpec(path=path, format="alpaca", response="output"), tmp_path, tokenizer))


@pytest.mark.parametrize("fmt, rows, explicit, digest", [
    ("chat", [{"prompt": "2+3?", "response": "5", "messages": CONVERSATIONS[1]}], {"prompt": "prompt", "response": "response"},
     "fc7ddafb3e776d8e"),
    ("alpaca", [{"instruction": "add", "response": "5", "output": "five"}], {"response": "response"}, "5790c4336930a3d4"),
])
def test_data_that_resolved_before_reads_as_before_and_keeps_its_digest(tmp_path, fmt, rows, explicit, digest):
    """Both readings present: the fields read before stand, and the settings digest of the entry as `made_from` and the
    resume fingerprint take it (resolved_settings: the block's model_dump) is the one taken before this change, so a
    saved run still resumes and `--eval-only` still scores its output."""
    from featcal_llm.io.run_settings import _digest

    path = write_source(tmp_path, rows, "jsonl")
    spec = DataSpec(path=path, format=fmt)
    assert as_pairs(sequences(spec, tmp_path)) == as_pairs(sequences(DataSpec(path=path, format=fmt, **explicit), tmp_path))
    assert _digest(DataSpec(path="d.jsonl", format=fmt).model_dump(mode="json")) == digest


@pytest.mark.parametrize("fmt, rows, said", [
    ("chat", [{"question": "2+3?", "answer": "5"}], "format: chat reads a `messages` field"),
    ("alpaca", [{"instruction": "add", "answer": "5"}], "format: alpaca reads the response from a `response` field (or `output`"),
])
@pytest.mark.parametrize("kind", ["jsonl", "saved"])
def test_data_with_neither_reading_is_refused_in_one_line_naming_the_file_and_its_fields_alike(tmp_path, fmt, rows, said, kind):
    path = write_source(tmp_path, rows, kind)
    spec = DataSpec(path=path, format=fmt)
    with pytest.raises(FeatCalError) as run:
        sequences(spec, tmp_path)
    with pytest.raises(FeatCalError) as validate:
        check_data(spec, "r.yaml: featcal.data.e", tmp_path, False, [])
    line = str(run.value).replace(str(tmp_path / "r.yaml"), "r.yaml")
    assert line == str(validate.value) and "\n" not in line
    assert line.startswith(f"r.yaml: featcal.data.e.path: {path}: {said}") and ", ".join(rows[0]) in line


def test_validate_reads_the_defaults_as_run_does(tmp_path):
    chat = write_source(tmp_path, [{"messages": turns} for turns in CONVERSATIONS], "jsonl")
    (tmp_path / "a").mkdir()
    alpaca = write_source(tmp_path / "a", ALPACA, "jsonl")
    assert check_data(DataSpec(path=chat, format="chat"), "r.yaml: featcal.data.e", tmp_path, False, []) == 2
    assert check_data(DataSpec(path=alpaca, format="alpaca"), "r.yaml: featcal.data.e", tmp_path, False, []) == 2
    saved = write_source(tmp_path, [{"messages": turns} for turns in CONVERSATIONS], "saved")  # its columns: dataset_info.json
    assert check_data(DataSpec(path=saved, format="chat"), "r.yaml: featcal.data.e", tmp_path, False, []) is None
    bad = write_source(tmp_path, [{"messages": "not a list"}], "jsonl")  # read as messages, so judged as messages
    with pytest.raises(FeatCalError, match="field 'messages' is 'not a list'; format: chat reads a non-empty list"):
        check_data(DataSpec(path=bad, format="chat"), "r.yaml: featcal.data.e", tmp_path, False, [])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("fields"), experts=2, layers=2, samples=8)
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


def calibrated(small, folder: Path, entries: list[dict]) -> tuple[bytes, dict, dict, str]:
    """Runs the scenario's recipe with these data entries; (the weights' bytes, the saved recipe, the run record, the card)."""
    import featcal_llm

    recipe = yaml.safe_load(small.recipe.read_text())
    for (name, _), entry in zip(recipe["featcal"]["data"].items(), entries):
        recipe["featcal"]["data"][name] = entry
    recipe["featcal"].update(output=str(folder / "out"), max_length=512)  # the Alpaca template is 150 characters
    (folder / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    from featcal_llm.io.validate import check_recipe

    assert check_recipe(folder / "r.yaml", plan=False).problems == []
    featcal_llm.calibrate(folder / "r.yaml", progress=False)
    weights = b"".join(file.read_bytes() for file in sorted((folder / "out").glob("*.safetensors")))
    return (weights, yaml.safe_load((folder / "out" / "featcal_recipe.yml").read_text()),
            json.loads((folder / "out" / "featcal_weights.json").read_text()), (folder / "out" / "README.md").read_text())


def test_a_run_on_the_defaults_makes_the_explicit_keys_weights_and_writes_them_out(small, tmp_path):
    (tmp_path / "data").mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{i} {t[:20]}"}, {"role": "assistant", "content": t}]}
            for i, t in enumerate(["the merge of", "experts loses skill", "calibration restores", "layer by layer"] * 2)]
    chat = write_source(tmp_path / "data", rows, "jsonl")
    (tmp_path / "alp").mkdir()
    alpaca = write_source(tmp_path / "alp", ALPACA * 4, "jsonl")
    (tmp_path / "default").mkdir()
    (tmp_path / "explicit").mkdir()
    default = calibrated(small, tmp_path / "default", [{"path": chat, "format": "chat"}, {"path": alpaca, "format": "alpaca"}])
    explicit = calibrated(small, tmp_path / "explicit", [{"path": chat, "format": "chat", "messages": "messages"},
                                                        {"path": alpaca, "format": "alpaca", "response": "output"}])
    assert default[0] == explicit[0]
    saved = list(default[1]["featcal"]["data"].values())
    assert saved[0]["messages"] == "messages" and saved[1]["response"] == "output"  # a replay reads the same fields
    assert list(default[2]["settings"]["data_fields"].values()) == [{"messages": "messages"}, {"response": "output"}]
    assert "data_fields" not in explicit[2]["settings"]
    assert "(resolved from its data's fields): `expert0`: messages: `messages`; `expert1`: response: `output`" in default[3]
    assert default[2]["made_from"].keys() == explicit[2]["made_from"].keys()
    import featcal_llm

    featcal_llm.calibrate(tmp_path / "default" / "out" / "featcal_recipe.yml", output=tmp_path / "replay", progress=False)
    assert b"".join(file.read_bytes() for file in sorted((tmp_path / "replay").glob("*.safetensors"))) == default[0]
