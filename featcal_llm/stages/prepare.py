"""The run's first stages: resolve the models, read (or generate) the data, merge, open the run context.

Everything before the passes that weigh experts and tokens: each stage checks
what it is given and fails in one line before anything is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal_llm import __version__, runlog
from featcal_llm.hardware import stream_budget
from featcal_llm.family.architectures import architecture_for, check_head_refit, select_projections
from featcal_llm.engine.teachers import check_judged
from featcal_llm.engine.devices import head_stats_dtype, resolve_device, resolve_dtype, resolve_stats_dtype, stored_dtype
from featcal_llm.engine.context import Models, RunContext
from featcal_llm.engine.distributed import Single, rank_device
from featcal_llm.engine.head import experts_that_changed_the_head
from featcal_llm.engine.method import head_setting, objective_for
from featcal_llm.io.checkpoint import (
    CheckpointReader,
    check_same_layers,
)
from featcal_llm.family.compat import check_compatible, check_embedding_rows, check_unquantized, check_tokenizer, check_vocabulary_sizes
from featcal_llm.io.data import calibration_sequences
from featcal_llm.generation.rank import with_generated
from featcal_llm.engine.drift import Probe, drift_sample
from featcal_llm.errors import FeatCalError, warn
from featcal_llm.family.layers import LayerRunner
from featcal_llm.io.merge import ensure_merged
from featcal_llm.io.merge_identity import merge_identity, supplied_merge
from featcal_llm.io.mergekit_architecture import check_merge_inputs
from featcal_llm.io.mergekit_config import merge_config_dict
from featcal_llm.io.model_files import calibration_tokenizer_directory, read_config_json
from featcal_llm.io.output_dir import not_an_output, partial_dir, unwritable
from featcal_llm.engine.plan import CalibrationPlan
from featcal_llm.engine.profiling import NullTimer
from featcal_llm.io.forms import changes_tokenizer, check_slice_depth, merge_makes_tokenizer
from featcal_llm.io.merge_vocabulary import merge_vocabulary
from featcal_llm.io.recipe import Recipe
from featcal_llm.io.run_settings import resolved_settings
from featcal_llm.io.references import ModelSource, check_override_architecture, resolve_source
from featcal_llm.io.tokenizers import load_tokenizer
from featcal_llm.engine.resume import (
    StagingArea,
    StagingReader,
    checkpoint_identity,
    fingerprint,
    library_versions,
    sequences_digest,
    source_digest,
)
from featcal_llm.engine.streams import HostStore, make_batches
from featcal_llm.engine.tuning import split_holdout



def _load_config(directory: Path, what: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        read_config_json(directory)  # refused in validate's words before transformers reads it
    except ValueError as error:
        raise FeatCalError(f"{what}: {error}") from None
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise FeatCalError(f"{what}: {directory / 'config.json'}: cannot be read ({str(error).splitlines()[0]})") from None
    check_unquantized(config, f"{what}: {directory / 'config.json'}")
    return config


def check_output(recipe: Recipe, output: Path, force: bool) -> None:
    where = f"{recipe.path}: {recipe.output_key}"
    problem = not_an_output(output)
    if problem is not None:
        raise FeatCalError(f"{where}: {problem}")
    if output.exists() and not force:
        partial = partial_dir(output)
        beside = (f"; {partial} beside it holds the saved progress of a run that did not finish or clean up, or "
                  "that kept it (--keep-layers), which --force resumes as far as it matches the recipe (remove it to start over)") if partial.is_dir() else ""
        raise FeatCalError(f"{where}: {output} already exists (pass --force, or force=True to calibrate(), to replace it){beside}")
    problem = unwritable(output)
    if problem is not None:
        raise FeatCalError(f"{where}: {problem}")


def _embedding_rows(reader: CheckpointReader, name: str) -> int:
    layout = reader.layout()
    if name not in layout:
        raise FeatCalError(f"{reader.what}: {reader.directory}: tensor {name} is missing")
    return layout[name][0][0]


def _open_checkpoints(merged_dir: Path, base: ModelSource, experts: dict[str, ModelSource], layer_prefix: str) -> Models:
    """Open every checkpoint (a LoRA expert as base + adapter, merged on the fly) and check, from shard headers only, that their layer tensors line up."""
    models = Models(
        merged=CheckpointReader(merged_dir, f"merged model {merged_dir}"),
        base=base.open(f"base model {base.directory}"),
        experts={name: source.open(f"expert {name}") for name, source in experts.items()},
    )
    reference = models.merged.layout()
    for reader in (models.base, *models.experts.values()):
        check_same_layers(reference, reader.layout(), layer_prefix, f"{reader.what}: {reader.directory}")
    return models


def run_fingerprint(
    recipe: Recipe, sequences, probe_sequences, models: Models, runner: LayerRunner, batch_tokens: int, sources: dict[str, ModelSource]
) -> str:
    # Where the merged model is does not matter: its files and the configuration it was merged from are recorded.
    return fingerprint(
        [
            __version__,
            source_digest(),
            library_versions(),
            resolved_settings(recipe.featcal),
            merge_config_dict(recipe.merge_config),
            sequences_digest(sequences),
            sequences_digest(probe_sequences),
            checkpoint_identity(models.merged.directory),
            merge_identity(models.merged.directory),
            {name: [source.identity(), checkpoint_identity(source.directory)] for name, source in sources.items()},
            [runner.device.type, str(runner.dtype), str(runner.stats_dtype), str(runner.head_stats_dtype), batch_tokens, torch.get_num_threads()],
        ]
    )


def _staging(comm: Single, partial: Path, run_fingerprint: str) -> StagingArea:
    """Rank 0 owns the staging area (and decides whether to resume); the others read what it staged."""
    staging = StagingArea(partial, run_fingerprint) if comm.is_main else None
    completed = comm.broadcast_object(staging.completed if staging is not None else None)
    return staging if staging is not None else StagingReader(partial, run_fingerprint, completed)


def _merge(recipe: Recipe, merged_path: Path, device: str, inputs: dict[str, ModelSource], trust: bool) -> Path:
    """`ensure_merged`, announced: mergekit's merge is a stage of its own, minutes long on large models."""
    if merged_path.exists():  # checked against the recipe: re-merged if featcal-llm made it from other inputs, else refused
        return ensure_merged(recipe, merged_path, device, inputs, trust)
    runlog.stage(f"merging with mergekit ({recipe.merge_config.merge_method}) into {merged_path}")
    start = time.perf_counter()
    merged = ensure_merged(recipe, merged_path, device, inputs, trust)
    runlog.stage(f"merged in {time.perf_counter() - start:.0f} s")
    return merged


@dataclass
class Resolved:
    """Stage 1, resolve: where every model is, their configs (checked against the base) and what the run calibrates."""

    recipe: Recipe
    output: Path
    merged_path: Path
    device: torch.device
    base: ModelSource
    experts: dict[str, ModelSource]
    base_config: Any
    expert_configs: dict[str, Any]
    plan: CalibrationPlan

    @property
    def sources(self) -> dict[str, ModelSource]:
        return {"base_model": self.base, **self.experts}

    @property
    def merge_inputs(self) -> dict[str, ModelSource]:
        """Every model the merge reads, by its reference as the recipe writes it (how `ensure_merged` looks them up)."""
        return {str(self.recipe.base): self.base, **self.experts}


@dataclass
class Data:
    """Stage 2, data: each expert's calibration records (read or generated), the held-out or probe records, batched."""

    sequences: dict[str, list[list[int]]]  # what enters the statistics
    probe_sequences: dict[str, list[list[int]]]
    batches: dict[str, list]  # this rank's shard
    probe: Probe
    every: dict[str, list[list[int]]]  # every record read or generated, held-out ones included
    tokenizer: Any = None  # what the records were tokenised with (the output gets it where the merge has no tokenizer)
    fields: dict[str, dict[str, str]] | None = None  # expert → the keys its defaults resolved from its data (io/data_fields.py)


@dataclass
class Opened:
    """Stage 3, merge: the merged model made or checked, every checkpoint open, the layer runner in its dtypes."""

    models: Models
    merged_config: Any
    runner: LayerRunner

    @property
    def num_layers(self) -> int:
        return self.merged_config.num_hidden_layers


def resolve(comm: Single, recipe: Recipe, force: bool, device: str | None) -> Resolved:
    """Where the models are and that they agree (configs, shapes, readable weights), and the calibration plan."""
    featcal = recipe.featcal
    output, merged_path = Path(featcal.output), Path(featcal.merged)
    check_output(recipe, output, force)
    compute_device = rank_device(resolve_device(device or featcal.device))
    comm.use(compute_device)
    trust = featcal.trust_remote_code
    base = resolve_source(recipe.base, f"{recipe.path}: base_model")
    experts = {e.name: resolve_source(e.reference, f"{recipe.path}: models: {e.name}", base) for e in recipe.experts}
    base_config = _load_config(base.directory, f"{recipe.path}: base_model", trust)
    check_override_architecture(recipe.base, base_config, f"{recipe.path}: base_model {recipe.base}")
    check_slice_depth(recipe.merge_config, base_config.num_hidden_layers, recipe.path)
    expert_configs = {name: _load_config(source.directory, f"expert {name}", trust) for name, source in experts.items()}
    for expert in recipe.experts:
        check_override_architecture(expert.reference, expert_configs[expert.name], f"{recipe.path}: models: {expert.name}")
    for name, config in expert_configs.items():
        check_compatible(base_config, config, f"expert {name}: {experts[name].directory / 'config.json'}")
    architecture = architecture_for(base_config, f"{recipe.path}: base_model {recipe.base}")
    check_head_refit(architecture, featcal, str(recipe.path))
    readers = {}
    try:  # weights (and adapter) readable, from headers, before any merge
        for name, source in {"base_model": base, **experts}.items():
            readers[name] = source.open(f"{recipe.path}: {'base_model' if name == 'base_model' else 'models: ' + name}")
        own_heads = experts_that_changed_the_head(featcal, readers, architecture)
    finally:
        for reader in readers.values():
            reader.close()
    if not supplied_merge(merged_path):  # what mergekit's merge would stop at, hub snapshots included (validate reads none)
        check_merge_inputs(recipe.path, base, experts)
    plan = CalibrationPlan(
        architecture=architecture,
        projections=select_projections(architecture, featcal.modules, str(recipe.path)),
        norms=featcal.norms and not featcal.regmean,  # RegMean: norms and biases stay the merged model's
        biases=featcal.biases and not featcal.regmean,
        objective=objective_for(featcal, base_config.num_hidden_layers, str(recipe.path)),
        head=head_setting(featcal, own_heads),
        own_heads=own_heads,
    )
    return Resolved(recipe, output, merged_path, compute_device, base, experts, base_config, expert_configs, plan)


def read_data(comm: Single, resolved: Resolved, progress: bool) -> Data:
    """Tokenised (or generated) records, checked against every tokenizer and vocabulary, split and batched."""
    recipe, featcal, base_config = resolved.recipe, resolved.recipe.featcal, resolved.base_config
    trust, merged_path = featcal.trust_remote_code, resolved.merged_path
    sized = {name: config.vocab_size for name, config in resolved.expert_configs.items() if getattr(config, "vocab_size", None) is not None}
    expected = None if supplied_merge(merged_path) else \
        merge_vocabulary(recipe.merge_config, resolved.merge_inputs, base_config.vocab_size, trust)  # the rows mergekit writes
    if expected is not None:  # an expert of another size is refused before the merge, as validate refuses it
        check_vocabulary_sizes(sized, expected.rows, expected.what, {name: f"expert {name}" for name in sized})
    if not featcal.tokenizer and merge_makes_tokenizer(recipe.merge_config):  # calibrate with the tokenizer mergekit builds
        comm.run_on_main("merge", lambda: _merge(recipe, merged_path, str(resolved.device), resolved.merge_inputs, trust))
    tokenizer_source = calibration_tokenizer_directory(featcal.tokenizer, merged_path, resolved.base.directory)
    tokenizer = load_tokenizer(tokenizer_source, f"{recipe.path}: featcal.tokenizer", trust)
    fields: dict[str, dict[str, str]] = {}
    sequences = calibration_sequences(
        featcal.data, [e.name for e in recipe.experts if featcal.data[e.name].generate is None], tokenizer, featcal.samples,
        featcal.max_length, featcal.shuffle, featcal.seed, recipe.path, fields,
    )
    for name, source in resolved.experts.items():  # before any expert generates: minutes to hours that a refusal would waste
        directory = source.tokenizer_directory
        if (directory / "tokenizer_config.json").is_file():
            check_tokenizer(tokenizer, load_tokenizer(directory, f"expert {name}", trust), f"{recipe.path}: expert {name}",
                            str(tokenizer_source))
        elif changes_tokenizer(recipe.merge_config):
            raise FeatCalError(f"expert {name}: {directory}: no tokenizer files, so its token ids cannot be checked against the merged tokenizer (tokenizer_source/tokenizer)")
    dtypes = {name: resolve_dtype(featcal.dtype, resolved.device, stored_dtype(config)) for name, config in resolved.expert_configs.items()}
    sequences = with_generated(comm, recipe, sequences, resolved.experts, resolved.expert_configs, resolved.device, dtypes, progress)
    positions = getattr(base_config, "max_position_embeddings", None)
    longest = max((len(row) for rows in sequences.values() for row in rows), default=0)
    if positions and longest > positions:  # rotary positions past what the model was trained on: features it never had
        warn(f"{recipe.path}: featcal.max_length: records of up to {longest} tokens are longer than the base model's "
             f"max_position_embeddings {positions}; set max_length to {positions} or less")
    # Before any merging: each expert's configured vocabulary must embed its own calibration tokens (rows are re-checked after).
    check_embedding_rows(sequences, sized, {name: f"expert {name}" for name in sized})
    if featcal.holds_out:  # held-out records select the hyper-parameters and never enter the statistics
        calibration, probe_sequences = split_holdout(sequences, featcal.tune_settings().holdout, featcal.seed, str(recipe.path))
    else:
        calibration, probe_sequences = sequences, drift_sample(sequences)
    if featcal.trailing == "merge":  # who teaches is decided on each expert's judged tokens: none is no evidence
        check_judged(calibration, f"{recipe.path}: featcal", featcal.holds_out)
    # Padding is masked everywhere and never looked up; id 0 exists in every embedding (a pad id may not).
    # Each rank keeps its token-balanced shard of every expert's records (all of them in one process).
    batches = {task: make_batches(seqs, featcal.batch_tokens, pad_id=0) for task, seqs in comm.shard(calibration).items()}
    probe = Probe(
        {task: make_batches(seqs, featcal.batch_tokens, pad_id=0) for task, seqs in comm.shard(probe_sequences).items()},
        "held-out records" if featcal.holds_out else "calibration subsample",
    )
    comm.agree(None)  # every rank got its data; only rank 0 merges, the others wait for it in the next stage
    return Data(calibration, probe_sequences, batches, probe, sequences, tokenizer, fields)


def open_merged(comm: Single, resolved: Resolved, data: Data) -> Opened:
    """Merge with mergekit (rank 0) or check an existing merge, open every checkpoint, check the vocabularies."""
    recipe, featcal, trust = resolved.recipe, resolved.recipe.featcal, resolved.recipe.featcal.trust_remote_code
    merged_dir = resolved.merged_path
    comm.run_on_main("merge", lambda: _merge(recipe, merged_dir, str(resolved.device), resolved.merge_inputs, trust))
    merged_config = _load_config(merged_dir, f"{recipe.path}: featcal.merged", trust)
    check_compatible(resolved.base_config, merged_config, f"merged model {merged_dir / 'config.json'}")
    architecture = resolved.plan.architecture
    models = _open_checkpoints(merged_dir, resolved.base, resolved.experts, architecture.layer_prefix.split("{")[0])
    readers = {"merged": models.merged, **models.experts}
    check_embedding_rows(data.every, {m: _embedding_rows(r, architecture.embed_tokens) for m, r in readers.items()}, {m: r.what for m, r in readers.items()})
    for tensor in dict.fromkeys((architecture.embed_tokens, "lm_head.weight")):  # the drift's LM heads compare one vocabulary
        rows = {m: _embedding_rows(r, tensor) for m, r in readers.items() if tensor in r.names()}
        merged_rows = rows.pop("merged", None)
        if merged_rows is not None:
            check_vocabulary_sizes(rows, merged_rows, f"the merged model {merged_dir}", {m: r.what for m, r in readers.items()})
    compute_dtype = resolve_dtype(featcal.dtype, resolved.device, stored_dtype(merged_config))
    stats_dtype = resolve_stats_dtype(featcal.stats_dtype, resolved.plan.objective.smallest_lambda(), compute_dtype, resolved.device)
    head = resolved.plan.head
    head_dtype = None if head is None else head_stats_dtype(head.lam, compute_dtype, resolved.device)
    return Opened(models, merged_config, LayerRunner(architecture, merged_config, resolved.device, compute_dtype, stats_dtype, head_dtype))


def run_context(comm: Single, resolved: Resolved, data: Data, opened: Opened) -> RunContext:
    """Fingerprint everything that determines the weights, open (or resume) the staging area and the hidden-state store."""
    featcal = resolved.recipe.featcal
    partial = partial_dir(resolved.output)
    digest = run_fingerprint(resolved.recipe, data.sequences, data.probe_sequences, opened.models, opened.runner,
                                       featcal.batch_tokens, resolved.sources)
    comm.agree(digest)  # ranks that see different recipes, data or models refuse to start
    staging = _staging(comm, partial, digest)
    spill = partial / "spill" if comm.world == 1 else partial / "spill" / f"rank-{comm.rank}"
    store = HostStore(stream_budget(featcal.host_memory_gb) // comm.world, spill, pin=resolved.device.type == "cuda")
    return RunContext(opened.models, resolved.plan, opened.runner, store, staging, data.batches, data.probe, NullTimer(), comm=comm)


