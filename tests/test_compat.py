"""family/compat's token-id checks at their edges, against hand-written vocabularies (mutation round 10)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.family.compat import SAME_IDS, check_embedding_rows, check_tokenizer, first_id_clash


@pytest.mark.parametrize("other, clash", [
    ({"a": 0, "b": 1}, None),  # the same ids
    ({"a": 0, "b": 1, "c": 2}, None),  # a token only the expert has, past the calibration's ids
    ({"a": 0}, None),  # a token only the calibration tokenizer has, its id free in the expert's
    ({"a": 2, "b": 1}, ("a", 2, 0)),  # 'a' moved to an id the calibration tokenizer does not use: nothing sits at 0
    ({"a": 0, "c": 1}, ("b", None, 1)),  # 'b' missing, its id given to 'c'
    ({"a": 1, "b": 0}, ("a", 1, 0)),  # swapped: the token of lowest calibration id is named
])
def test_the_first_clash_is_the_calibration_token_of_lowest_id_moved_or_displaced(other, clash):
    assert first_id_clash({"b": 1, "a": 0}, other) == clash


def _tokenizer(vocab: dict[str, int], **ids: int | None) -> SimpleNamespace:
    return SimpleNamespace(get_vocab=lambda: vocab, **{key: ids.get(key, index) for key, index in
                                                       (("bos_token_id", 1), ("eos_token_id", 2), ("unk_token_id", 3))})


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id", "unk_token_id"])
def test_each_special_id_of_the_expert_must_be_the_calibration_tokenizer_s(key):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    check_tokenizer(_tokenizer(vocab), _tokenizer(dict(vocab)), "r.yaml: expert e", "cal")
    with pytest.raises(FeatCalError) as error:
        check_tokenizer(_tokenizer(vocab), _tokenizer(dict(vocab), **{key: 0}), "r.yaml: expert e", "cal")
    assert str(error.value) == (f"r.yaml: expert e: tokenizer {key} = 0 differs from the calibration tokenizer's "
                                f"{_tokenizer(vocab).__dict__[key]} (read from cal): {SAME_IDS}")


def test_an_embedding_needs_a_row_for_its_largest_token_id_and_the_merge_for_every_expert_s():
    sequences = {"a": [[0, 4], [2]], "b": [[7, 1]]}
    check_embedding_rows(sequences, {"merged": 8, "a": 5, "b": 8}, {})  # one row past each largest id: enough
    with pytest.raises(FeatCalError) as error:  # id 4 needs a fifth row
        check_embedding_rows(sequences, {"a": 4}, {"a": "expert a"})
    assert str(error.value) == "expert a: embedding of 4 rows cannot embed calibration token id 4 (tokenizer mismatch?)"
    with pytest.raises(FeatCalError) as error:  # the merge embeds b's records too; a's 5 rows are enough for a's
        check_embedding_rows(sequences, {"a": 5, "merged": 7}, {"merged": "the merged model m"})
    assert str(error.value) == "the merged model m: embedding of 7 rows cannot embed calibration token id 7 (tokenizer mismatch?)"
