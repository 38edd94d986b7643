"""Which files a model directory holds (weights, tokenizer): read from its listing alone, so `validate` can ask
without safetensors, transformers or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"  # sampling defaults and stop ids: transformers, vLLM and lm-eval read them


def index_weight_map(directory: Path) -> dict[str, str]:
    """Tensor name → shard file of a sharded checkpoint's index (ValueError where it is none)."""
    import json

    try:
        weight_map = json.loads((directory / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        return {str(name): str(shard) for name, shard in dict(weight_map).items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise ValueError(f"{INDEX_FILE}: not a safetensors index (expected a 'weight_map' mapping)") from None


def read_config_json(directory: Path) -> dict:
    """A model folder's config.json as a mapping: ValueError naming the folder or file and why it is none (missing,
    not JSON, not an object), for `validate`, `run` and `eval` to refuse in the same words."""
    import json

    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"{directory}: not a model directory (no config.json)")
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{config}: not a readable JSON file ({str(error).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{config}: expected a JSON object (a model config)")
    return values


def damaged_shard(path: Path) -> str | None:
    """Why a safetensors file cannot be read (None: its header parses and its tensors fit in the file), from its header
    alone: a download cut short or a file of something else fails here, not half-way through a merge in mergekit."""
    import json

    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                return f"{path.name}: not a safetensors file (its {size} bytes hold no header); download it again"
            header = json.loads(handle.read(length))
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        return f"{path.name}: not a safetensors file ({type(error).__name__} reading its header); download it again"
    if ends and 8 + length + max(ends) > size:
        return f"{path.name}: cut short ({size} bytes; its header lists {8 + length + max(ends)}); download it again"
    return None


def tensor_names(directory: Path) -> set[str]:
    """The tensor names a checkpoint stores (its index's, else its one file's header's), without loading a tensor or
    importing safetensors; empty where `missing_weights` finds no readable weights (it reports why)."""
    import json

    if (directory / INDEX_FILE).is_file():
        try:
            return set(index_weight_map(directory))
        except ValueError:
            return set()
    try:
        with (directory / SINGLE_FILE).open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    except (OSError, ValueError):
        return set()
    return {str(name) for name in header if name != "__metadata__"} if isinstance(header, dict) else set()


def missing_weights(directory: Path) -> str | None:
    """Why `directory` holds no safetensors weights featcal-llm can read (None: an index whose shards are all there, or
    a single file, each with a header that parses), from the listing, the index and the shards' headers alone."""
    if (directory / INDEX_FILE).is_file():
        try:
            shards = sorted(set(index_weight_map(directory).values()))
        except ValueError as error:
            return str(error)
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            return f"{INDEX_FILE}: points at missing shard file {missing[0]}"
        return next((problem for shard in shards if (problem := damaged_shard(directory / shard)) is not None), None)
    if (directory / SINGLE_FILE).is_file():
        return damaged_shard(directory / SINGLE_FILE)
    if any(directory.glob("*.bin")):
        return "only pickled .bin weights found; featcal-llm reads safetensors only (convert with transformers' save_pretrained)"
    return f"no {SINGLE_FILE} or {INDEX_FILE} found"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
NO_TOKENIZER = f"no tokenizer files ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}); name one with featcal.tokenizer"


def calibration_tokenizer_directory(tokenizer: str | None, merged: Path | None, base: Path) -> Path:
    """The directory the records are tokenised with: featcal.tokenizer, else the merge once it exists, else the base."""
    return Path(tokenizer) if tokenizer else merged if merged is not None and merged.exists() else base


def unparsable_tokenizer_config(directory: Path) -> str | None:
    """JSON's reason where the folder's tokenizer_config.json does not parse (None: it does, or there is none): what
    transformers' tokenizer loader, which reads it with `json`, fails with."""
    import json

    try:
        json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def generating_expert_without_tokenizer(directory: Path, name: str) -> str:
    """The refusal for an expert that is to write its samples but has no tokenizer to write them with."""
    return (f"expert {name}: {directory} has no tokenizer files (tokenizer.json or tokenizer_config.json); an expert that "
            "writes its own data needs its tokenizer: copy it into that directory, or give this expert a data file")


def carries_chat_template(tokenizer: Any) -> bool:
    """Whether a loaded tokenizer has a chat template that renders something: transformers loads an empty
    chat_template.jinja as "", which renders every conversation as nothing."""
    return renders_something(getattr(tokenizer, "chat_template", None))


def renders_something(template: Any) -> bool:
    """Whether a chat template (a string, a mapping of named templates, or tokenizer_config.json's older list of
    them) holds one that is not blank."""
    if isinstance(template, dict):
        templates = list(template.values())
    elif isinstance(template, list):  # tokenizer_config.json's older form: [{"name": ..., "template": ...}]
        templates = [item.get("template") if isinstance(item, dict) else item for item in template]
    else:
        templates = [template]
    return any(isinstance(text, str) and text.strip() for text in templates)


def _saved_tokenizer(directory: Path) -> tuple[Any, list[dict]] | None:
    """tokenizer.json's model vocabulary (a mapping, or Unigram's [[piece, score], ...]) and its added-token entries;
    None where there is no readable one (a SentencePiece model file alone)."""
    import json

    try:
        saved = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        vocabulary = saved["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return vocabulary, [entry for entry in saved.get("added_tokens") or [] if isinstance(entry, dict)]


def vocabulary_has(directory: Path, token: str) -> bool | None:
    """Whether `token` is a token of the tokenizer saved in `directory` (tokenizer.json's vocabulary or its added
    tokens), as `convert_tokens_to_ids` finds it; None where no tokenizer.json says (a SentencePiece model file)."""
    saved = _saved_tokenizer(directory)
    if saved is None:
        return None
    vocabulary, added_tokens = saved
    added = {entry.get("content") for entry in added_tokens}
    if isinstance(vocabulary, dict):
        found = token in vocabulary or token in added
    elif isinstance(vocabulary, list):  # Unigram: [[piece, score], ...]
        found = token in added or any(isinstance(entry, list) and entry and entry[0] == token for entry in vocabulary)
    else:
        return None
    if not found and token in _configured_tokens(directory):  # transformers adds it on loading, with an id past the
        return None  # vocabulary's, which the embedding may not have: run checks that id against the config
    return found


def saved_vocabulary(directory: Path) -> dict[str, int] | None:
    """tokenizer.json's vocabulary with its added tokens, as a fast tokenizer's `get_vocab()` gives it; None where
    loading could give another (no tokenizer.json, a vocabulary that is not a mapping, a token tokenizer_config.json
    names that transformers would add on loading, an added token the file gives another id than loading does)."""
    saved = _saved_tokenizer(directory)
    if saved is None or not isinstance(saved[0], dict):
        return None
    ids = {str(token): index for token, index in saved[0].items() if isinstance(index, int)}
    held, following = set(ids.values()), len(ids)
    for entry in saved[1]:
        if isinstance(entry.get("content"), str) and isinstance(entry.get("id"), int):
            # tokenizers ignores an added token's saved id: one its vocabulary has keeps that id, a new one gets the
            # next (the model vocabulary's size, then on); a file that says otherwise is not what loading gives
            if entry["content"] not in ids:
                if following in held:
                    return None
                ids[entry["content"]], following = following, following + 1
                held.add(ids[entry["content"]])
            if ids[entry["content"]] != entry["id"]:
                return None
    return None if _configured_tokens(directory) - set(ids) else ids


def special_tokens(directory: Path) -> dict[str, Any] | None:
    """The tokenizer class and special tokens a saved tokenizer names (tokenizer_config.json, special_tokens_map.json),
    as written: two tokenizers that name the same ones get the same special ids from the same vocabulary."""
    import json

    named: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            values = json.loads((directory / name).read_text(encoding="utf-8")) if (directory / name).is_file() else {}
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if not isinstance(values, dict):
            return None
        named[name] = {key: value.get("content") if isinstance(value, dict) else value for key, value in values.items()
                       if key in ("tokenizer_class", "bos_token", "eos_token", "unk_token")}
    return named


def _configured_tokens(directory: Path) -> set[str]:
    """The tokens tokenizer_config.json names (special tokens, additional or extra ones, its added tokens), which
    transformers adds to the vocabulary as it loads the tokenizer where tokenizer.json lacks them."""
    import json

    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return set()
    if not isinstance(config, dict):
        return set()
    values = [value for key, value in config.items() if key.endswith("_token")]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        listed = config.get(key)
        values += list(listed.values()) if isinstance(listed, dict) else listed if isinstance(listed, list) else []
    decoder = config.get("added_tokens_decoder")
    values += list(decoder.values()) if isinstance(decoder, dict) else []
    names = (value.get("content") if isinstance(value, dict) else value for value in values)
    return {name for name in names if isinstance(name, str)}


def saved_chat_template(directory: Path) -> str | None:
    """The chat template of the tokenizer saved in `directory`, as transformers loads it (chat_template.jinja, else
    chat_template.json's key, else tokenizer_config.json's; of named templates, the default), or None: a blank one is
    none, as carries_chat_template judges the loaded tokenizer. One reader for validate, the run and the evaluation."""
    import json

    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8", errors="replace")
        return template if renders_something(template) else None
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((directory / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError, UnicodeDecodeError):
            continue
        if isinstance(value, list) and value:  # tokenizer_config.json's older form: [{"name": ..., "template": ...}]
            named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
            value = named.get("default") or next(iter(named.values()), None)
        elif isinstance(value, dict) and value:
            value = value.get("default") or next(iter(value.values()), None)
        if isinstance(value, str):  # the first file that holds one decides, blank or not
            return value if renders_something(value) else None
    return None


def chat_template_syntax_error(template: str) -> str | None:
    """Where a chat template fails to parse (`line 1: Unexpected end of template ...`), or None: parsed in the
    environment transformers renders chat templates in, its `{% generation %}` tag included, so a template it renders
    passes and one it cannot fails here first, before any record is read or model merged."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' `{% generation %}…{% endgeneration %}` (its AssistantTracker), parsed alike
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        return f"line {error.lineno}: {error.message}"
    return None


def has_chat_template(directory: Path) -> bool:
    return saved_chat_template(directory) is not None


def lend_generation_config(source: Path, target: Path) -> bool:
    """`source`'s generation_config.json copied into `target` where `target` has none (mergekit writes none where it
    builds the tokenizer); whether it was."""
    import shutil

    if (target / GENERATION_CONFIG).exists() or not (source / GENERATION_CONFIG).is_file():
        return False
    shutil.copy2(source / GENERATION_CONFIG, target / GENERATION_CONFIG)
    return True
