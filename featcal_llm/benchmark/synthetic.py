"""Synthetic Llama checkpoints with real layer shapes, written tensor by tensor (no model is ever built).

A base, N experts (base + seeded noise) and a merge (Task Arithmetic, scale
0.3, of the expert deltas) are written as bf16 sharded safetensors with a
`model.safetensors.index.json`, a `config.json` and a tokenizer, exactly as a
hub checkpoint looks. They are cached under the work directory by a hash of
their shapes, so repeated runs skip building.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FORMAT_VERSION = 1
MERGE_SCALE = 0.3  # Task Arithmetic scale of the paper's MergeBench runs
WEIGHT_STD = 0.02
COMPLETE = "complete.json"


@dataclass(frozen=True)
class SyntheticSpec:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    layers: int = 2  # layers physically written (see `distinct_layers` in the driver)
    vocab: int = 128
    experts: int = 3
    seed: int = 0
    shard_mb: int = 500
    expert_noise: float = 0.1  # expert delta, relative to the weight scale
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def key(self) -> str:
        text = json.dumps({**asdict(self), "format": FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name (relative to the layer) → shape, Llama naming."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }

    def layer_bytes(self) -> int:
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return sum(_numel(s) for s in self.layer_shapes().values()) * size

    def model_bytes(self) -> int:
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.layers * self.layer_bytes() + (2 * self.vocab * self.hidden + self.hidden) * size

    def config(self):
        from featcal_llm.tiny import tiny_llama_config

        return tiny_llama_config(
            self.vocab,
            architectures=["LlamaForCausalLM"],
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=131072,
            dtype=self.dtype,
            rope_parameters={  # Llama-3.1's
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class SyntheticCheckpoints:
    root: Path
    base: Path
    merged: Path
    experts: dict[str, Path]

    def all(self) -> list[Path]:
        return [self.base, self.merged, *self.experts.values()]

    def shard_files(self) -> list[Path]:
        return sorted(p for d in self.all() for p in d.glob("*.safetensors"))


def _paths(root: Path, spec: SyntheticSpec) -> SyntheticCheckpoints:
    return SyntheticCheckpoints(
        root=root,
        base=root / "base",
        merged=root / "merged",
        experts={f"expert{i}": root / f"expert{i}" for i in range(spec.experts)},
    )


def _shard_plan(spec: SyntheticSpec) -> list[list[int]]:
    """Consecutive layers per shard under the shard size (at least one layer per shard)."""
    per_shard = max(1, (spec.shard_mb * 1_000_000) // max(1, spec.layer_bytes()))
    return [list(range(s, min(s + per_shard, spec.layers))) for s in range(0, spec.layers, per_shard)]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_checkpoints(
    spec: SyntheticSpec, workdir: Path, rebuild: bool = False, log=print, device: torch.device | str = "cpu"
) -> SyntheticCheckpoints:
    """The cached checkpoints for `spec` under `workdir`, built if missing (or if `rebuild`); random numbers are drawn on `device`."""
    root = Path(workdir) / f"ckpt-{spec.key()}"
    paths = _paths(root, spec)
    if (root / COMPLETE).is_file() and not rebuild:
        log(f"bench: reusing synthetic checkpoints in {root}")
        return paths
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log(f"bench: building {2 + spec.experts} synthetic checkpoints ({spec.model_bytes() / 1e9:.2f} GB each) in {root}")
    _build(spec, paths, torch.device(device))
    (root / COMPLETE).write_text(json.dumps(asdict(spec), indent=1))
    return paths


def _build(spec: SyntheticSpec, paths: SyntheticCheckpoints, device: torch.device) -> None:
    from safetensors.torch import save_file

    from featcal_llm.tiny import build_char_tokenizer

    dtype = getattr(torch, spec.dtype)
    generator = torch.Generator(device=device).manual_seed(spec.seed)
    names = ["base", "merged", *paths.experts]
    directories = {"base": paths.base, "merged": paths.merged, **paths.experts}
    tokenizer = build_char_tokenizer()
    config = spec.config()
    for directory in directories.values():
        directory.mkdir(parents=True)
        config.to_json_file(directory / "config.json")
        tokenizer.save_pretrained(directory)

    def family(shape: tuple[int, ...], norm: bool) -> dict[str, torch.Tensor]:
        """base, merged and each expert's value of one tensor."""
        scale = WEIGHT_STD if not norm else 0.05
        base = torch.randn(shape, generator=generator, device=device)
        base.mul_(scale)
        if norm:
            base.add_(1.0)
        values = {"base": base.to(dtype).cpu()}
        merged = base.clone()
        for expert in paths.experts:
            delta = torch.randn(shape, generator=generator, device=device).mul_(scale * spec.expert_noise)
            values[expert] = (base + delta).to(dtype).cpu()
            merged.add_(delta, alpha=MERGE_SCALE)
            del delta
        values["merged"] = merged.to(dtype).cpu()
        return values

    plan = _shard_plan(spec)
    files = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map: dict[str, str] = {}
    for shard_index, (layers, file) in enumerate(zip(plan, files)):
        shards: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
        entries: list[tuple[str, tuple[int, ...], bool]] = []
        if shard_index == 0:
            entries.append(("model.embed_tokens.weight", (spec.vocab, spec.hidden), False))
        for layer in layers:
            entries += [(f"model.layers.{layer}.{n}", s, n.endswith("layernorm.weight")) for n, s in spec.layer_shapes().items()]
        if shard_index == len(plan) - 1:
            entries += [("model.norm.weight", (spec.hidden,), True), ("lm_head.weight", (spec.vocab, spec.hidden), False)]
        for tensor_name, shape, norm in entries:
            for model, value in family(shape, norm).items():
                shards[model][tensor_name] = value
            weight_map[tensor_name] = file
        for model in names:
            target = directories[model] / file
            save_file(shards[model], target, metadata={"format": "pt"})
            _fsync(target)  # clean pages, so the benchmark can drop them from the page cache
        del shards
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(_numel(s) for s in _all_shapes(spec)) * size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    for directory in directories.values():
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _all_shapes(spec: SyntheticSpec) -> list[tuple[int, ...]]:
    shapes = [(spec.vocab, spec.hidden), (spec.hidden,), (spec.vocab, spec.hidden)]
    for _ in range(spec.layers):
        shapes += list(spec.layer_shapes().values())
    return shapes
