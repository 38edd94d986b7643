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
