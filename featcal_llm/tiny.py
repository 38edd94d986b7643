"""Tiny, locally built Llama models and a character tokenizer, for the demo and the benchmark.

Nothing can be downloaded in the demo or the benchmark, so every model they
use is built here from a config and saved with ``save_pretrained``: the product then reads it exactly as it would
read a hub checkpoint.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, with a chat template, loadable by AutoTokenizer."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
    )


def tiny_llama_config(vocab_size: int, **overrides) -> LlamaConfig:
    """A Llama config small enough for CPU tests but with GQA and RoPE scaling."""
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    )
    settings.update(overrides)
    return LlamaConfig(**settings)






def new_tiny_llama(config, seed: int) -> torch.nn.Module:
    """A randomly initialised causal LM of the config's family (Llama unless the config says otherwise)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config) if isinstance(config, LlamaConfig) else AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def perturbed_copy(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """A stand-in for a fine-tuned expert: the model plus seeded relative noise on every weight.

    The noise scales with the tensor's mean magnitude, but never below 0.02 × `scale`,
    so zero-initialised tensors (biases) differ between experts too.
    """
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in clone.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.add_(noise * scale * max(float(parameter.abs().mean()), 0.02))
    return clone


def save_model(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    path: str | Path,
    max_shard_size: str | int = "10GB",
    dtype: torch.dtype | None = None,
) -> Path:
    """Save as a hub checkpoint would look: safetensors shards, config, tokenizer."""
    path = Path(path)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path
