"""io/model_files.saved_vocabulary's edges a mutation round found unpinned: a Unigram tokenizer.json (T5's, XLM-R's
kind: its vocabulary a list of [piece, score] pairs, not a mapping) is left undecided, and validate leaves the id
comparison to run's loaded tokenizers rather than stop with a traceback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from featcal_llm.io.model_files import saved_vocabulary
from featcal_llm.io.validate_models import _first_tokenizer_clash


def unigram_tokenizer(folder: Path, pieces: list[str]) -> Path:
    backend = Tokenizer(models.Unigram([("<unk>", 0.0), *[(piece, -1.0 - i) for i, piece in enumerate(pieces)]], unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)
    return folder


def test_a_unigram_vocabulary_is_left_undecided_and_validate_leaves_it_to_run(tmp_path):
    ours = unigram_tokenizer(tmp_path / "cal", ["a", "b", "c"])
    theirs = unigram_tokenizer(tmp_path / "expert", ["c", "b", "a"])  # the same pieces at other ids
    assert AutoTokenizer.from_pretrained(ours).get_vocab()["a"] != AutoTokenizer.from_pretrained(theirs).get_vocab()["a"]
    assert saved_vocabulary(ours) is None and saved_vocabulary(theirs) is None
    assert _first_tokenizer_clash(tmp_path / "r.yaml", ours, {"e": SimpleNamespace(tokenizer_directory=theirs)}) is None


def test_an_expert_whose_special_tokens_differ_is_left_to_run_s_special_id_check(tmp_path):
    """An expert that names another EOS, or holds the calibration tokenizer's BOS at another id, is refused by run's
    special-id check first (the reference, on the loaded tokenizers): validate names no ordinary token's clash there,
    though the vocabularies also differ, rather than contradict run's line."""
    import json

    import pytest

    from featcal_llm.errors import FeatCalError
    from featcal_llm.family.compat import check_tokenizer
    from test_saved_vocabulary import saved_tokenizer

    calibrating = saved_tokenizer(tmp_path / "cal")
    named_other = saved_tokenizer(tmp_path / "eos", config={"eos_token": "<unk>"}, reverse=True)
    moved = saved_tokenizer(tmp_path / "bos", reverse=True)
    saved = json.loads((moved / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    vocab["<s>"], vocab["a"] = vocab["a"], vocab["<s>"]
    saved["added_tokens"] = [entry for entry in saved["added_tokens"] if entry["content"] != "<s>"]
    (moved / "tokenizer.json").write_text(json.dumps(saved))
    assert saved_vocabulary(calibrating) is not None and saved_vocabulary(moved) is not None
    for expert, special in ((named_other, "eos_token_id"), (moved, "bos_token_id")):
        with pytest.raises(FeatCalError, match=f"expert e: tokenizer {special} = "):
            check_tokenizer(AutoTokenizer.from_pretrained(calibrating), AutoTokenizer.from_pretrained(expert), "expert e",
                            str(calibrating))
        assert _first_tokenizer_clash(tmp_path / "r.yaml", calibrating, {"e": SimpleNamespace(tokenizer_directory=expert)}) is None
