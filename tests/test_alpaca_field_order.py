"""An alpaca record is read field by field in one order by validate and run: instruction, response, input.

validate checks the records of a file it can read (io/validate_data.check_data); records it cannot read before the
run (a folder whose README may declare its layout, a hub dataset) are refused by the run's reader alone. A record
whose instruction is null and whose response is a number was refused by validate for its instruction and by the run
for its response: the same record, two different lines, depending on where it was stored.
"""

from __future__ import annotations

import json

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import calibration_sequences
from featcal_llm.io.validate_data import check_data
from featcal_llm.tiny import build_char_tokenizer

RECORDS = [{"instruction": "say a", "input": None, "response": "a"}, {"instruction": None, "input": 7, "response": 3}]


def _refusal(check) -> str:
    with pytest.raises(FeatCalError) as refused:
        check()
    return str(refused.value).split(": record ", 1)[1]


@pytest.mark.parametrize("record, field", [(RECORDS[1], "instruction"), ({**RECORDS[1], "instruction": "x"}, "response"),
                                           ({**RECORDS[1], "instruction": "x", "response": "y"}, "input")])
def test_validate_and_the_run_name_the_same_field_of_an_alpaca_record(tmp_path, record, field):
    (tmp_path / "d.jsonl").write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(record) + "\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").write_text((tmp_path / "d.jsonl").read_text())
    tokenizer = build_char_tokenizer()
    validated = _refusal(lambda: check_data(DataSpec(path="d.jsonl", format="alpaca"), "featcal.data.e", tmp_path, False, []))
    assert validated.startswith(f"1: field {field!r} is ")
    spec = DataSpec(path="folder", format="alpaca")  # a folder of data files: validate reads its JSON files' records too
    assert _refusal(lambda: check_data(spec, "featcal.data.e", tmp_path, False, [])) == validated
    (tmp_path / "folder" / "README.md").write_text("# records\n")  # a README may declare the layout: left to the run
    assert check_data(spec, "featcal.data.e", tmp_path, False, []) is None
    ran = _refusal(lambda: calibration_sequences({"e": spec}, ["e"], tokenizer, 4, 64, False, 0, tmp_path / "r.yaml"))
    assert ran == validated
