"""io/model_files.saved_vocabulary: tokenizer.json's vocabulary as a loaded tokenizer's `get_vocab()` gives it, or None
where the files alone do not decide it. validate reads it (validate_models._first_tokenizer_clash) to refuse, as run
does, an expert whose tokenizer gives a token another id than the calibration tokenizer.

Reference: transformers' `AutoTokenizer.from_pretrained(folder).get_vocab()` for the same folder, and run's own check
of the loaded tokenizers (family/compat.check_tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

import featcal_llm.tiny as tiny
from featcal_llm.errors import FeatCalError
from featcal_llm.family.compat import SAME_IDS, check_tokenizer
from featcal_llm.io.model_files import saved_vocabulary
from featcal_llm.io.validate_models import _first_tokenizer_clash


def saved_tokenizer(folder: Path, *, added: list[str] = (), config: dict | None = None, reverse: bool = False) -> Path:
    """The tiny character tokenizer (its characters reversed: the same tokens at other ids) with `added` tokens
    appended to tokenizer.json's added_tokens, saved with `config` merged into its tokenizer_config.json."""
    characters = tiny.CHARACTERS
    try:
        tiny.CHARACTERS = characters[::-1] if reverse else characters
        tokenizer = tiny.build_char_tokenizer()
    finally:
        tiny.CHARACTERS = characters
    tokenizer.add_tokens(list(added))
    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(config or {})}))
    return folder


def file_tokens(folder: Path) -> set[str]:
    saved = json.loads((folder / "tokenizer.json").read_text())
    return set(saved["model"]["vocab"]) | {entry["content"] for entry in saved["added_tokens"]}


def test_a_token_tokenizer_config_names_and_tokenizer_json_lacks_leaves_the_vocabulary_undecided(tmp_path):
    """transformers adds such a token on loading (here the BOS tokenizer_config.json names) at an id the files do not
    hold: the files alone do not give the loaded vocabulary, so saved_vocabulary says None, and validate names no
    token clash where run refuses the expert by the special id it checks first (its BOS lands past the expert's
    longer vocabulary): validate leaves it to run's line rather than contradict it."""
    calibrating = saved_tokenizer(tmp_path / "cal", config={"bos_token": "<bos>"})
    loaded = AutoTokenizer.from_pretrained(calibrating)
    assert "<bos>" not in file_tokens(calibrating) and loaded.get_vocab()["<bos>"] == loaded.bos_token_id == 100
    assert saved_vocabulary(calibrating) is None

    expert = saved_tokenizer(tmp_path / "expert", added=["<x>"], config={"bos_token": "<bos>"}, reverse=True)
    with pytest.raises(FeatCalError) as refused:  # run's check of the loaded tokenizers
        check_tokenizer(loaded, AutoTokenizer.from_pretrained(expert), "expert e", str(calibrating))
    assert str(refused.value) == f"expert e: tokenizer bos_token_id = 101 differs from the calibration tokenizer's 100 (read from {calibrating}): {SAME_IDS}"
    assert _first_tokenizer_clash(tmp_path / "r.yaml", calibrating, {"e": SimpleNamespace(tokenizer_directory=expert)}) is None


def test_the_added_tokens_of_tokenizer_json_are_in_the_vocabulary_at_the_ids_loading_gives_them(tmp_path):
    """tokenizer.json's added_tokens: ones past the model's vocabulary (an added `<tool>`, `<|im_start|>`) and the
    special tokens its model vocabulary holds at the same ids; the whole is what the loaded tokenizer's get_vocab()
    gives, so validate compares what run compares."""
    folder = saved_tokenizer(tmp_path / "tok", added=["<tool>", "<|im_start|>"])
    saved = json.loads((folder / "tokenizer.json").read_text())
    assert {entry["content"]: entry["id"] for entry in saved["added_tokens"] if entry["id"] >= 100} == {"<tool>": 100, "<|im_start|>": 101}
    assert "<tool>" not in saved["model"]["vocab"] and saved["model"]["vocab"]["<s>"] == 1  # <s> is in both, at 1
    loaded = AutoTokenizer.from_pretrained(folder).get_vocab()
    assert loaded["<tool>"] == 100 and saved_vocabulary(folder) == loaded


@pytest.mark.parametrize("entries", [
    [(50, "<tool>")],  # an id the model vocabulary gives another token: loading puts <tool> at 100
    [(7, "K")],  # a token of the model vocabulary at another id: loading keeps its own
    [(150, "<gap>")],  # past the next id: loading gives it 100
    [(101, "<b>"), (100, "<a>")],  # listed out of id order: loading numbers them as listed
    [(100, "<a>"), (101, "<a>")],  # one token twice: loading keeps the first id
], ids=["id of another token", "model token moved", "gap", "out of order", "twice"])
def test_added_tokens_at_ids_loading_does_not_give_leave_the_vocabulary_undecided(tmp_path, entries):
    """tokenizers ignores an added token's saved id where it disagrees with the vocabulary (a hand-edited
    tokenizer.json): the file's ids are not the loaded tokenizer's, so saved_vocabulary says None, not a mapping
    validate would compare in run's stead."""
    folder = saved_tokenizer(tmp_path / "tok")
    saved = json.loads((folder / "tokenizer.json").read_text())
    saved["added_tokens"] += [{"id": index, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                               "normalized": False, "special": True} for index, content in entries]
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    loaded = AutoTokenizer.from_pretrained(folder).get_vocab()
    assert any(loaded[content] != index for index, content in entries)  # loading gives another id than the file says
    assert saved_vocabulary(folder) is None
