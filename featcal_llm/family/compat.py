"""Checks that the merge, the base and every expert can share one config and one tokenizer.

Every expert's layers run with the merged model's config and every model is
fed the same token ids, so any setting that changes a layer's function (rope,
norm epsilon, sliding window, soft-capping, …) and the tokenizer's vocabulary
and special ids must agree up front, not show up as silently wrong features.
"""

from __future__ import annotations

from typing import Any

from featcal_llm.errors import FeatCalError

# Config keys of the shapes the layer loop depends on
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
# Config keys that change what a decoder layer computes, beyond its shapes (absent keys compare as None).
FAMILY_KEYS = (
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "rms_norm_eps", "layer_norm_eps",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "head_dim", "hidden_act",
    "hidden_activation", "attn_logit_softcapping", "query_pre_attn_scalar", "attention_bias", "mlp_bias",
)
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unk_token_id")


def check_unquantized(config: Any, where: str) -> None:
    """A config.json that declares quantized weights is refused: the merge and the solve read plain floating-point
    tensors, and a `quantization_config` copied to the output would make every runtime load plain weights as quantized
    ones (transformers asks for bitsandbytes; vLLM picks a quantized loader). `config`: the file's dict, or AutoConfig's."""
    quantization = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    raise FeatCalError(f"{where}: quantization_config ({method or 'unknown method'}): featcal-llm merges and calibrates "
                       "unquantized weights; give the unquantized checkpoint (where the block is a leftover over plain "
                       "weights, as peft's merge_and_unload can leave one, delete it)")


def check_compatible(reference: Any, other: Any, what: str) -> None:
    """Experts, base and merge must share architecture and every shape the layer loop depends on (configs as
    transformers reads them, its defaults filled in)."""
    if list(reference.architectures or []) != list(other.architectures or []):
        raise FeatCalError(f"{what}: architecture {other.architectures} differs from the base model's {reference.architectures}")
    for key in SHAPE_KEYS:
        if getattr(reference, key, None) != getattr(other, key, None):
            raise FeatCalError(f"{what}: config {key} = {getattr(other, key, None)} differs from the base model's {getattr(reference, key, None)}")
    check_family_settings(reference, other, what)


def check_family_settings(reference: Any, other: Any, what: str) -> None:
    for key in FAMILY_KEYS:
        mine, theirs = getattr(reference, key, None), getattr(other, key, None)
        if mine != theirs:
            raise FeatCalError(f"{what}: config {key} = {theirs} differs from the base model's {mine}")


SAME_IDS = ("every model reads the calibration tokenizer's ids, so each expert's tokenizer must give its tokens the same "
            "ids (the base's tokenizer, as fine-tuning keeps it)")


def check_tokenizer(calibration: Any, other: Any, what: str, source: str = "") -> None:
    """`other` (an expert's own tokenizer) gives no token another id than the calibration tokenizer (read from
    `source`), and has its special ids.

    Tokens only one side has (one appended a pad token, say) are allowed: ids
    beyond an embedding are caught by `check_embedding_rows`.
    """
    read = f" (read from {source})" if source else ""
    for key in SPECIAL_IDS:
        if getattr(calibration, key, None) != getattr(other, key, None):
            raise FeatCalError(f"{what}: tokenizer {key} = {getattr(other, key, None)} differs from the calibration tokenizer's "
                               f"{getattr(calibration, key, None)}{read}: {SAME_IDS}")
    clash = first_id_clash(calibration.get_vocab(), other.get_vocab())
    if clash is not None:
        raise FeatCalError(f"{what}: {id_clash_message(clash, source)}")


def first_id_clash(calibration: dict[str, int], other: dict[str, int]) -> tuple[str, int | None, int] | None:
    """(token, its id in `other` or None, its calibration id) of the calibration token of lowest id that `other` gives
    another id, or whose id `other` gives another token; None where none. By id, so `validate` (from tokenizer.json)
    and `run` (from the loaded tokenizers, whose vocabularies come in no set order) name the same token."""
    token_at = {index: token for token, index in other.items()}
    for token, index in sorted(calibration.items(), key=lambda item: (item[1], item[0])):
        if other.get(token, index) != index or token_at.get(index, token) != token:
            return token, other.get(token), index
    return None


def id_clash_message(clash: tuple[str, int | None, int], source: str = "") -> str:
    token, theirs, index = clash
    read = f" (read from {source})" if source else ""
    return f"tokenizer maps {token!r} to {theirs}, the calibration tokenizer to {index}{read}: {SAME_IDS}"


def check_embedding_rows(sequences: dict[str, list[list[int]]], rows: dict[str, int], what: dict[str, str]) -> None:
    """Every real calibration token id has a row in every embedding that embeds it (merged: all tasks; expert i: its own)."""
    for model, count in rows.items():
        tasks = sequences if model == "merged" else {model: sequences[model]}
        largest = max(max(sequence) for task_sequences in tasks.values() for sequence in task_sequences)
        if largest >= count:
            raise FeatCalError(f"{what[model]}: embedding of {count} rows cannot embed calibration token id {largest} (tokenizer mismatch?)")


def check_vocabulary_sizes(sizes: dict[str, int], reference: int, reference_what: str, what: dict[str, str]) -> None:
    """Every expert's vocabulary (embedding and LM head rows) is the merged model's size.

    The features are fed the same token ids everywhere (the identity mapping), and
    the next-token diagnostics compare each expert's distribution with the merged
    model's over one vocabulary; an expert with added or missing rows (union
    tokenizers, added tokens) has no exact counterpart there, so it is refused.
    """
    for model, count in sizes.items():
        if count != reference:
            raise FeatCalError(
                f"{what[model]}: vocabulary of {count} rows, {reference_what} has {reference}: experts whose vocabulary differs from the merge "
                "(added tokens, union tokenizers) are not supported; give every expert the base's vocabulary"
            )
