"""`validate`'s checks of the models a recipe names, from their config.json files and file listings, without torch.

Base, experts, an existing merge and the calibration tokenizer: each resolves (a local directory, or a hub id
looked up only `online`), has weights run can read, an architecture and shapes the base's layers share, a vocabulary
the merge will have (io/merge_vocabulary.py), and the tokenizer files the run reads. Each refusal is run's own line.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from featcal_llm.errors import FeatCalError
from featcal_llm.family.compat import (FAMILY_KEYS, SHAPE_KEYS, check_compatible, check_unquantized, check_vocabulary_sizes,
                                       first_id_clash, id_clash_message)
from featcal_llm.io.block_sections import DataSpec
from featcal_llm.io.data import chat_template_unparsable
from featcal_llm.io.data_files import looks_like_hub_id
from featcal_llm.io.hub_lookup import hub_config, hub_lookup
from featcal_llm.io.merge_identity import supplied_merge
from featcal_llm.io.mergekit_architecture import check_mergekit_weights, reads_other_weights
from featcal_llm.io.merge_vocabulary import MergeVocabulary, merge_vocabulary, tokenizer_source
from featcal_llm.io.model_files import (NO_TOKENIZER, calibration_tokenizer_directory, chat_template_syntax_error,
                                        generating_expert_without_tokenizer, has_chat_template, has_tokenizer_files,
                                        missing_weights, read_config_json, saved_chat_template, saved_vocabulary, special_tokens,
                                        unparsable_tokenizer_config, vocabulary_has)
from featcal_llm.io.problems import Problem, collect
from featcal_llm.io.recipe import Expert, _experts_of, misspelt_models
from featcal_llm.io.references import is_hub_reference

if TYPE_CHECKING:
    from featcal_llm.io.validate import Report


def _refuse_local_typo(path: str, what: str, kind: str = "model") -> None:
    """`experts/cod` beside an existing `experts/code`: a local path with a typo, not a hub id (which it would be read as)."""
    import difflib

    parent = Path(path).parent
    if not parent.is_dir():
        return
    siblings = [child.name for child in parent.iterdir() if child.is_dir()]
    close = difflib.get_close_matches(Path(path).name, siblings, n=1, cutoff=0.75)
    if close:
        raise FeatCalError(f"{what}: {kind} directory does not exist ({parent}/ is a local directory, so it is no hub id); "
                           f"did you mean {str(parent / close[0])!r}?")


def _read_config(directory: Path, what: str) -> dict:
    try:
        data = read_config_json(directory)
    except ValueError as error:
        raise FeatCalError(f"{what}: {error}") from None
    check_unquantized(data, f"{what}: {directory / 'config.json'}")
    return data


def _first_tokenizer_clash(path: Path, calibrating: Path, experts: dict[str, Any]) -> Problem | None:
    """run's refusal of the first expert whose tokenizer gives a token another id than the calibration tokenizer
    (stages/prepare.read_data, family/compat.check_tokenizer), from the saved files; only where they decide what the
    loaded tokenizers give (tokenizer.json vocabularies, the same class and special tokens at the same ids on both
    sides), the rest left to run."""
    ours, named = saved_vocabulary(calibrating), special_tokens(calibrating)
    for name, source in experts.items() if ours is not None and named is not None else ():
        directory = source.tokenizer_directory
        if not (directory / "tokenizer_config.json").is_file() or special_tokens(directory) != named:
            continue
        theirs = saved_vocabulary(directory)
        specials = {value for values in named.values() for value in values.values() if isinstance(value, str)}
        if theirs is None or any(ours.get(token) != theirs.get(token) for token in specials):
            continue  # run's special-id check speaks first there, in its own words
        clash = first_id_clash(ours, theirs)
        if clash is not None:
            return Problem(str(path), f"expert {name}", id_clash_message(clash, str(calibrating)))
    return None


def _model_config(reference: Any, what: str, online: bool, report: Report, base: Any = None,
                  recipe_dir: Path | None = None) -> tuple[Any, dict | None]:
    """(ModelSource or None, config.json) of one recipe model; local paths only on disk, hub ids only when online."""
    from featcal_llm.io.references import resolve_source

    hub = [p for p in (reference.model, reference.lora) if p is not None and is_hub_reference(p)]
    for model_path in hub:
        named = f"{what}" if str(model_path.path) in what else f"{what}: {model_path.path}"
        beside = (recipe_dir / model_path.path) if recipe_dir is not None else None
        if beside is not None and beside.is_dir() and beside.resolve() != Path(model_path.path).resolve():
            raise FeatCalError(f"{named}: no such folder here, where run reads model paths (as mergekit does), but "
                               f"{beside} is beside the recipe: run from {recipe_dir} or write the path out in full")
        _refuse_local_typo(model_path.path, named)
    if not hub:
        source = resolve_source(reference, what, base)  # every path is local: no hub call
        config = _read_config(source.directory, what)
        problem = missing_weights(source.directory)  # what run's checkpoint reader refuses, from the listing
        if problem is not None:
            raise FeatCalError(f"{what}: {source.directory}: {problem}")
        if source.adapter is not None:
            from featcal_llm.io.references import adapter_config_problem

            problem = adapter_config_problem(source.adapter)  # what run's LoRA reader refuses of its config
            if problem is not None:
                raise FeatCalError(f"{what}: {problem}")
            from featcal_llm.io.lora_layout import checkpoint_shapes, read_adapter_layout

            # its tensors against the base's, from the safetensors headers: an adapter for another base, in run's words
            read_adapter_layout(source.adapter, checkpoint_shapes(source.directory, what), source.directory, what)
        return source, config
    for model_path in hub:
        if online:
            hub_lookup("model", model_path.path, model_path.revision, what, report.offline)
        else:
            report.unchecked.append(str(model_path))
    if reference.lora is None and hub == [reference.model]:
        config = hub_config(reference.model, online and reference.model.path not in report.offline)  # unreachable: the cache only
        if config is not None:
            check_unquantized(config, f"{what}: {reference.model.path}/config.json")
        return None, config
    return None, None


def check_per_layer(featcal: Any, num_layers: int, where: str) -> None:
    """A tuned run's replayed `per_layer` values cover every decoder layer (engine/method.py refuses it so, with torch)."""
    for attribute, key in (("lambda_", "lambda"), ("alpha", "alpha"), ("rho", "rho"), ("reduction", "reduction")):
        values = getattr(getattr(featcal, attribute, None), "per_layer", None)
        if values is not None and len(values) != num_layers:
            raise FeatCalError(f"{where}: featcal.{key}.per_layer: {len(values)} values for a model of {num_layers} decoder layers")


def _check_layers(path: Path, featcal: Any, base_config: dict, base_what: str, problems: list[Problem]) -> bool:
    """What `run` refuses from the base's config before its first layer: the architecture, `modules`, a head re-fit
    vLLM could not serve, per-layer values. Whether the architecture is one featcal-llm calibrates."""
    from featcal_llm.family.architectures import architecture_for, check_head_refit, select_projections

    architecture = collect(problems, path, lambda: architecture_for(SimpleNamespace(**base_config), base_what))  # run's words
    if architecture is not None and featcal is not None:
        collect(problems, path, lambda: select_projections(architecture, featcal.modules, str(path)))
        collect(problems, path, lambda: check_head_refit(architecture, featcal, str(path)))
    if featcal is not None and isinstance(base_config.get("num_hidden_layers"), int):
        collect(problems, path, lambda: check_per_layer(featcal, base_config["num_hidden_layers"], str(path)))
    return architecture is not None


def check_models(path: Path, merge_config: Any, merged: str | None, tokenizer: str | None, online: bool, report: Report,
                  data: dict[str, DataSpec] | None = None, featcal: Any = None) -> dict[str, dict]:
    """Base, experts, an existing merge and the tokenizer: resolvable, with config.json files whose shapes agree, of an
    architecture featcal-llm calibrates."""
    from featcal_llm.io.forms import check_slice_depth, merge_makes_tokenizer
    from featcal_llm.io.references import check_override_architecture

    problems, configs = report.problems, {}
    base_reference = merge_config.base_model
    base_source = base_config = None
    base_what = f"{path}: base_model"
    supplied = bool(merged) and supplied_merge(Path(merged))  # run merges nothing: it compares each expert with the merge
    weights = False  # whether mergekit's required weights are checked
    if base_reference is not None:
        result = collect(problems, path, lambda: _model_config(base_reference, base_what, online, report, recipe_dir=path.parent))
        base_source, base_config = result or (None, None)
    if base_config is not None:
        configs["base_model"] = base_config
        collect(problems, path, lambda: check_override_architecture(base_reference, SimpleNamespace(**base_config), f"{base_what} {base_reference}"))
        # what mergekit's merge would stop at, of an architecture featcal-llm calibrates (else that is the one refusal)
        calibrated = _check_layers(path, featcal, base_config, f"{base_what} {base_reference}", problems)
        weights = calibrated and not supplied
        if base_source is not None and weights:
            collect(problems, path, lambda: check_mergekit_weights(base_source.directory, base_config, base_what))
        slices_refused = any(problem.key.startswith("slices") for problem in problems)  # depth would only repeat it
        if isinstance(base_config.get("num_hidden_layers"), int) and not slices_refused:
            collect(problems, path, lambda: check_slice_depth(merge_config, base_config["num_hidden_layers"], path))
    experts = _experts_of(merge_config)
    vocabularies: list[tuple[dict, str]] = []  # (config, what) of each expert whose config could be read
    sources = {str(base_reference): base_source} if base_source is not None else {}
    typos = misspelt_models(tuple(Expert(str(reference), reference) for reference in experts), data or {})
    for reference in experts:
        what = f"{path}: models: {reference}"
        if str(reference) in typos:  # one error: the model path, not the data key that names the right one
            problems.append(Problem(str(path), "models", f"{reference}: model directory does not exist; did you mean "
                                                         f"{typos[str(reference)]!r} (featcal.data names it)?"))
            continue
        if base_source is None and _plain_adapter(reference):
            continue  # applies to a base that could not be resolved: already reported
        result = collect(problems, path, lambda: _model_config(reference, what, online, report, base_source, path.parent))
        source, config = result or (None, None)
        if config is None:
            continue
        configs[str(reference)] = config
        before = len(problems)
        collect(problems, path, lambda: check_override_architecture(reference, SimpleNamespace(**config), what))
        spec = (data or {}).get(str(reference))
        if source is not None and spec is not None and spec.generate is not None:
            problems.extend(_writer_problems(path, str(reference), spec.generate, source.tokenizer_directory))
            if spec.generate.start is not None and vocabulary_has(source.tokenizer_directory, spec.generate.start) is None:
                report.notes.append(f"{path}: featcal.data.{reference}.generate.start: {spec.generate.start!r} not checked: validate "
                                    "reads a vocabulary from tokenizer.json, and this expert's has none or lacks it (a token "
                                    "tokenizer_config.json adds on loading); run checks it, "
                                    "with every generating expert's start, before any expert samples")
        named = f"{what}: {(source.directory if source is not None else Path(str(reference.model))) / 'config.json'}"
        if base_config is not None:
            collect(problems, path, lambda: check_same_shapes(base_config, config, named))
        if weights and source is not None and len(problems) == before and reads_other_weights(source, getattr(base_source, "directory", None)):
            collect(problems, path, lambda: check_mergekit_weights(source.directory, config, f"{path}: models"))  # the line names the directory
        vocabularies.append((config, named))
        if source is not None:
            sources[str(reference)] = source
    builds_tokenizer = tokenizer_source(merge_config) is not None
    # mergekit builds its tokenizer from every model's files and the source's: here, all local (else left to run, which
    # checks it before merging; validate asks the Hub nothing without --online)
    local = len(sources) == len(experts) + 1 and _local_source(merge_config)
    if base_config is not None and not supplied and (local or not builds_tokenizer):  # run's check before it merges
        expected = merge_vocabulary(merge_config, sources, base_config.get("vocab_size"), bool(getattr(featcal, "trust_remote_code", False)))
        for expert_config, expert_what in vocabularies if expected is not None else ():
            collect(problems, path, lambda: _same_vocabulary(expected, expert_config, expert_what))
    merged_config = None
    if merged and Path(merged).exists():
        what, merged = f"{path}: featcal.merged", Path(merged)
        if not merged.is_dir():
            problems.append(Problem(str(path), "featcal.merged", f"{merged}: expected the merged model's directory"))
        else:
            config = merged_config = collect(problems, path, lambda: _read_config(merged, what))
            unreadable = missing_weights(merged)  # what run's checkpoint reader refuses of it
            if unreadable is not None:
                problems.append(Problem(str(path), "featcal.merged", f"{merged}: {unreadable}"))
            if config is not None and base_config is not None:
                collect(problems, path, lambda: check_same_shapes(base_config, config, f"{what}: {merged / 'config.json'}"))
            rows = config.get("vocab_size") if config is not None and supplied else None
            for expert_config, expert_what in vocabularies if isinstance(rows, int) else ():
                collect(problems, path, lambda: _same_vocabulary(MergeVocabulary(rows, "the merged model"), expert_config, expert_what))
            from featcal_llm.io import merge_identity  # looked up when called: tests set it aside to reach run's own check

            collect(problems, path, lambda: merge_identity.check_supplied_merge(path, merge_config, merged))
    if tokenizer and not Path(tokenizer).exists() and not looks_like_hub_id(tokenizer):
        problems.append(Problem(str(path), "featcal.tokenizer", f"{tokenizer}: tokenizer directory does not exist"))
    elif tokenizer and Path(tokenizer).is_file():  # transformers would read it as a hub id
        problems.append(Problem(str(path), "featcal.tokenizer", f"{tokenizer}: a file; name the directory that holds it"))
    elif tokenizer and not Path(tokenizer).exists():  # a hub id, as a model path is: a local typo first, then the hub
        before = len(problems)
        collect(problems, path, lambda: _refuse_local_typo(tokenizer, f"featcal.tokenizer: {tokenizer}", "tokenizer"))
        if len(problems) == before and online:
            collect(problems, path, lambda: hub_lookup("model", tokenizer, None, "featcal.tokenizer", report.offline))
        elif len(problems) == before:
            report.unchecked.append(f"{tokenizer} (tokenizer)")
    # the tokenizer the merge (and so the output, which `eval:` scores) carries: the merge's own, else the base's it copies
    report.scored_tokenizer = Path(merged) if merged and Path(merged).is_dir() else \
        base_source.tokenizer_directory if base_source is not None and not merge_makes_tokenizer(merge_config) else None
    # the config the evaluated models carry (the merge's, which the calibration keeps): hf's engine_args are checked by it
    report.scored_config = merged_config if merged_config is not None else base_config
    # the directory run tokenises the records with (prepare.read_data); a changed tokenizer is mergekit's, made first
    calibrating = Path(tokenizer) if tokenizer else None if base_source is None or merge_makes_tokenizer(merge_config) else \
        calibration_tokenizer_directory(None, Path(merged) if merged else None, base_source.directory)
    if calibrating is not None and calibrating.is_dir() and not has_tokenizer_files(calibrating):
        problems.append(Problem(str(path), "featcal.tokenizer", f"{calibrating}: {NO_TOKENIZER}"))
    elif calibrating is not None and calibrating.is_dir() and (reason := unparsable_tokenizer_config(calibrating)) is not None:
        problems.append(Problem(str(path), "featcal.tokenizer", f"{calibrating}: cannot load a tokenizer ({reason})"))  # run's words
    elif calibrating is not None and calibrating.is_dir() and not has_chat_template(calibrating):
        for name, spec in (data or {}).items():  # io/data.py's refusal, from the saved tokenizer's files
            if spec.path is not None and spec.format == "chat":
                problems.append(Problem(str(path), f"featcal.data.{name}.format", "chat needs a tokenizer with a chat template"))
    elif calibrating is not None and calibrating.is_dir():
        clash = _first_tokenizer_clash(path, calibrating, {str(r): sources[str(r)] for r in experts if str(r) in sources})
        if clash is not None:
            problems.append(clash)
        chat = [name for name in map(str, experts) if (spec := (data or {}).get(name)) is not None and spec.path is not None
                and spec.format == "chat"]
        unparsable = chat_template_syntax_error(saved_chat_template(calibrating)) if chat else None
        if unparsable is not None:  # run refuses the first chat entry it reads (the recipe's order), before any record
            problems.append(Problem(str(path), f"featcal.data.{chat[0]}.format", chat_template_unparsable(unparsable)))
    return configs


def _writer_problems(path: Path, name: str, generate: Any, tokenizer_directory: Path) -> list[Problem]:
    """What generation refuses of an expert that writes its own samples, from its tokenizer's files."""
    if not has_tokenizer_files(tokenizer_directory):
        return [Problem(str(path), f"featcal.data.{name}.generate", generating_expert_without_tokenizer(tokenizer_directory, name))]
    if generate.start is not None and vocabulary_has(tokenizer_directory, generate.start) is False:  # prompts.start_token's
        return [Problem(str(path), f"featcal.data.{name}.generate.start", f"{generate.start!r} is not a token of the expert's vocabulary")]
    if generate.chat_template in ("on", "empty") and not has_chat_template(tokenizer_directory):  # generation/prompts.py's refusal
        return [Problem(str(path), f"featcal.data.{name}.generate.chat_template",
                        f"{generate.chat_template}, but the expert's tokenizer has no chat template")]
    return []


def _plain_adapter(reference: Any) -> bool:
    from featcal_llm.io.references import is_adapter_directory

    return reference.lora is None and is_adapter_directory(Path(reference.model.path))


def check_same_shapes(base: dict, other: dict, what: str) -> None:
    """Architecture, the shapes the layer loop depends on and the settings that change what a layer computes (rope, norm
    epsilon, windows: run's `check_compatible`), from config.json. Where a key stands in one file only, the configs are
    read as run reads them (transformers fills in the family's defaults, which imports torch: only then), and compared
    by run's own check; a key both files leave out is the same default on both."""
    keys = ("architectures", *SHAPE_KEYS, *FAMILY_KEYS)
    if any((_shape(base, key) is None) != (_shape(other, key) is None) for key in keys):
        loaded = _as_transformers_reads(base), _as_transformers_reads(other)
        if None not in loaded:
            check_compatible(*loaded, what)
            return
    if list(base.get("architectures") or []) != list(other.get("architectures") or []):
        raise FeatCalError(f"{what}: architecture {other.get('architectures')} differs from the base model's {base.get('architectures')}")
    for key in (*SHAPE_KEYS, *FAMILY_KEYS):
        mine, theirs = _shape(base, key), _shape(other, key)
        if mine is not None and theirs is not None and mine != theirs:
            raise FeatCalError(f"{what}: config {key} = {theirs} differs from the base model's {mine}")


def _local_source(merge_config: Any) -> bool:
    """Whether the tokenizer source the recipe names is `base`, `union` or a model in a local directory."""
    source = tokenizer_source(merge_config)
    if source is None or isinstance(source, str):
        return True
    return all(path is None or Path(path.path).is_dir() for path in (source.model, source.lora))


def _same_vocabulary(expected: MergeVocabulary, expert: dict, what: str) -> None:
    """An expert whose config counts another vocabulary than the merge will have (the base's, the tokenizer mergekit
    builds, or a supplied merge's): run refuses it (family/compat.check_vocabulary_sizes), in these words."""
    theirs = expert.get("vocab_size")
    if isinstance(theirs, int) and theirs != expected.rows:
        check_vocabulary_sizes({"expert": theirs}, expected.rows, expected.what, {"expert": what})


def _as_transformers_reads(config: dict) -> Any:
    """The config object `AutoConfig` builds from this config.json (None where it cannot: run reports why)."""
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
    except Exception:
        return None


def _shape(config: dict, key: str) -> Any:
    if key == "num_key_value_heads":
        return config.get(key) or config.get("num_attention_heads")
    return config.get(key)
