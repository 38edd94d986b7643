"""lm-eval model backends: vLLM on GPUs, lm-eval's `hf` everywhere else.

Only the arguments are built here (in the parent process); the model itself is created in the
per-model worker, so importing this module never imports torch, vLLM or lm-eval.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation.config import BackendSettings
from featcal_llm.hardware import installed as _installed  # one name, so that tests can stand in for the machine

if TYPE_CHECKING:
    from featcal_llm.evaluation.suite import Suite


def cuda_available() -> bool:
    if not _installed("torch"):
        return False
    import torch

    return torch.cuda.is_available()


def require_lm_eval(origin: str = "eval") -> None:
    if not _installed("lm_eval"):
        raise FeatCalError(f"{origin}: lm-eval is not installed; install the extra: pip install 'featcal-llm[eval]'")


def resolve_backend_name(settings: BackendSettings, origin: str = "--backend") -> str:
    """auto -> vllm when CUDA is present, else hf; a missing backend is a one-line error."""
    require_lm_eval()
    name = settings.name
    if name == "auto":
        name = "vllm" if cuda_available() else "hf"
    _check_installed(name, settings.name, origin)
    return name


def planned_backend_name(settings: BackendSettings, origin: str) -> str | None:
    """`resolve_backend_name`'s answer, asked by `validate` without starting torch: the backend where that is certain
    (None: `auto` on a machine whose CUDA only torch can confirm), refusing what the run would refuse only after the
    calibration (lm-eval or the backend not installed, vLLM without CUDA)."""
    from featcal_llm.hardware import cuda_refusal

    require_lm_eval(origin.rsplit(".backend", 1)[0])
    refusal = cuda_refusal()
    if settings.name == "auto" and refusal is None:
        return None
    name = "hf" if settings.name == "auto" else settings.name
    _check_installed(name, settings.name, origin)
    if name == "vllm" and refusal is not None:
        raise FeatCalError(f"{origin}: vllm scores on a CUDA GPU, but {refusal}; use hf")
    return name


def _check_installed(name: str, asked: str, origin: str) -> None:
    other = "pass --backend hf" if origin.startswith("--") else f"set {origin}: hf"
    if name == "vllm" and not _installed("vllm"):
        picked = "auto picked vllm (CUDA is present) but vLLM" if asked == "auto" else "vllm"
        raise FeatCalError(f"{origin}: {picked} is not installed; install the extra: pip install 'featcal-llm[vllm]', or {other}")
    if name == "hf" and not (_installed("torch") and _installed("transformers")):
        raise FeatCalError(f"{origin}: hf needs torch and transformers; pip install 'featcal-llm[eval]'")


HF_DECODING = "the task's settings; of generation_config.json only the token ids; top_k 0"  # as vLLM decodes under lm-eval


@dataclass(frozen=True)
class BackendPlan:
    """Everything the worker needs to build the lm-eval model; recorded in every result."""

    name: str
    model_args: dict
    batch_size: int | str

    def identity(self) -> dict:
        """The part that can change scores: everything but the model path (hf: and how it decodes, worker.decode_as_vllm,
        so that answers cached under the checkpoint's own generation settings are not taken for these)."""
        args = {k: v for k, v in self.model_args.items() if k != "pretrained"}
        return {"name": self.name, "model_args": args, "batch_size": self.batch_size,
                **({"decoding": HF_DECODING} if self.name == "hf" else {})}


# lm-eval model_args each backend sets from an option of its own: engine_args may not repeat them
# (lm-eval's vllm model takes max_length as max_model_len; batch_size reaches lm-eval beside model_args; `model` would
# replace the model lm-eval hands vllm.LLM, scoring another model under this one's name)
OWN_ARGS = {"vllm": ("pretrained", "dtype", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "seed",
                     "data_parallel_size", "chat_template_args", "max_length", "batch_size", "model"),
            "hf": ("pretrained", "dtype", "device", "max_length", "chat_template_args", "batch_size")}


def check_settings(name: str, settings: BackendSettings, model_config: dict | None = None) -> None:
    """What a backend refuses of its settings alone: asked by `validate` and again before a model is scored.
    `model_config` (the scored model's config.json, where one can be read) lets hf check engine_args' keys."""
    if name == "vllm" and settings.device:
        raise FeatCalError("backend.device: not used by vllm; select GPUs with CUDA_VISIBLE_DEVICES")
    if name == "hf" and (settings.device or "").startswith("cuda"):
        from featcal_llm import hardware

        refusal = hardware.cuda_refusal()
        if refusal is not None:
            raise FeatCalError(f"backend.device: {settings.device}, but {refusal}; use cpu")
    if settings.name == "hf" and "gpu_memory_utilization" in settings.model_fields_set:  # `auto` may be vllm elsewhere
        raise FeatCalError("backend.gpu_memory_utilization: only the vllm backend sizes its memory by it")
    if name == "hf" and settings.tensor_parallel_size != 1:
        raise FeatCalError("backend.tensor_parallel_size: only the vllm backend shards a model")
    if name == "hf" and settings.data_parallel_size != 1:
        raise FeatCalError("backend.data_parallel_size: only the vllm backend runs replicas")
    clash = sorted(set(settings.engine_args) & set(OWN_ARGS[name]))
    if clash:
        raise FeatCalError(f"backend.engine_args.{clash[0]}: set by its own option, not through engine_args")
    if name == "vllm":
        from featcal_llm.evaluation.vllm_arguments import check_vllm_engine_args

        check_vllm_engine_args(settings.engine_args, "backend.engine_args")
    if name == "hf":
        from featcal_llm.evaluation.hf_arguments import check_hf_engine_args

        check_hf_engine_args(settings.engine_args, "backend.engine_args", model_config)


def plan_backend(name: str, settings: BackendSettings, model_dir: Path, context_length: int,
                 model_max_positions: int | None, chat_template_args: dict | None = None,
                 model_dtype: str | None = None) -> BackendPlan:
    """Build lm-eval `model_args` for one model.

    The context length is the suite's (or the user's) capped at the model's
    max_position_embeddings: vLLM refuses a longer max_model_len, and without a cap Llama-3.x's
    131,072 makes vLLM size its KV cache for sequences no task produces. `chat_template_args`
    (the suite's, e.g. a fixed `date_string` for Llama-3.x templates that print today's date) go to
    lm-eval's chat templating; `engine_args` are passed through unchanged (a key the backend does not take refused
    first: vllm's from its sources, hf's from lm-eval's, transformers' and the model's config's). `auto` asks for the dtype the
    checkpoint's config names (`model_dtype`), which each backend then serves: vLLM's own `auto` would run a float32
    checkpoint in bfloat16, where hf keeps float32.
    """
    from featcal_llm.evaluation.hf_arguments import read_model_config

    check_settings(name, settings, read_model_config(model_dir))
    dtype = model_dtype if settings.dtype == "auto" and model_dtype else settings.dtype
    length = context_tokens(settings, context_length, model_max_positions)
    if name == "vllm":
        args = {
            "pretrained": str(model_dir),
            "dtype": dtype,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "gpu_memory_utilization": settings.gpu_memory_utilization,
            "max_model_len": length,
            "seed": settings.seed,
        }
        if settings.data_parallel_size != 1:
            args["data_parallel_size"] = settings.data_parallel_size
        return BackendPlan("vllm", _extend(args, settings, chat_template_args), settings.batch_size or "auto")
    device = settings.device or ("cuda" if cuda_available() else "cpu")
    args = {"pretrained": str(model_dir), "dtype": dtype, "device": device, "max_length": length}
    batch = settings.batch_size or ("auto" if device.startswith("cuda") else 1)
    return BackendPlan("hf", _extend(args, settings, chat_template_args), batch)


def _extend(args: dict, settings: BackendSettings, chat_template_args: dict | None) -> dict:
    if chat_template_args:
        args = {**args, "chat_template_args": dict(chat_template_args)}
    return {**args, **settings.engine_args}


def context_tokens(settings: BackendSettings, suite_context: int, model_max_positions: int | None) -> int:
    """The context each request gets: --max-model-len, else the suite's capped at the model's positions."""
    if settings.max_model_len is not None:
        return settings.max_model_len
    return min(suite_context, model_max_positions) if model_max_positions else suite_context


def check_generation_room(suite: "Suite", task_ids: list[str], max_gen_toks: int | None, context: int) -> None:
    """A generation budget that fills the whole context leaves the prompt no room: lm-eval's hf model asserts
    `context − max_gen_toks > 0` after loading the model, and its vLLM model would keep a nonsense slice of each
    prompt. Refused before any model loads (by `validate` too), with the numbers to change."""
    for task_id in task_ids:
        budget = suite.tasks[task_id].generation_kwargs.get("max_gen_toks")
        if budget is None:  # not a generation task, or lm-eval's default (256)
            continue
        budget = max_gen_toks or budget
        if budget >= context:
            said = "--max-gen-toks (eval.max_gen_toks)" if max_gen_toks else f"the suite's max_gen_toks for {task_id}"
            raise FeatCalError(f"{task_id}: generates up to {budget} tokens ({said}) in a context of {context} tokens "
                               f"(the model's max_position_embeddings or --max-model-len): no room is left for its "
                               f"prompt; pass --max-gen-toks below {context} (recipe: eval.max_gen_toks) or a longer "
                               "--max-model-len where the model takes one")
