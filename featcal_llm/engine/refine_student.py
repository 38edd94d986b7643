"""The student of `refine:`: the calibrated model built whole, what trains in it (every parameter, or a peft LoRA
adapter on the projections with norms, biases and the head in full), and the tensors it writes back."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from featcal_llm.engine.drift import LM_HEAD
from featcal_llm.engine.refine_models import build_causal_lm
from featcal_llm.io.checkpoint import checkpoint_tensors

if TYPE_CHECKING:
    from featcal_llm.engine.refine import RefineJob


def keeps_the_tie(job: RefineJob) -> bool:
    """A family vLLM serves only tied whose config ties the head (stages/outputs writes a stored lm_head.weight as the
    embedding then): the student's head is its input embedding. An untied config keeps its own head, trained."""
    return job.head_tied_only and bool(getattr(job.config, "tie_word_embeddings", False))


def student_names(job: RefineJob) -> list[str]:
    """The student's tensors: the merge's, and a head the closed form untied from the embeddings (a head kept tied for
    vLLM is trained as the input embedding instead)."""
    names, _ = checkpoint_tensors(job.merged, job.replacements)
    return [name for name in names if name != LM_HEAD] if keeps_the_tie(job) else names


def student_parameters(job: RefineJob, names: list[str]) -> int:
    """How many parameters the student holds: the merge's layout, and the shape of a tensor only the closed form wrote
    (its untied head) read from the staged file's header."""
    layout = job.merged.layout()
    total = 0
    for name in names:
        if name in layout:
            total += math.prod(layout[name][0])
        else:
            with safe_open(job.replacements[name], framework="pt") as handle:
                total += math.prod(handle.get_slice(name).get_shape())
    return total


class Student:
    """The calibrated model being refined, its trainable parameters (by name) and how to write it back."""

    def __init__(self, job: RefineJob, params: str, master: torch.dtype, checkpointing: bool, autocast: torch.dtype | None = None):
        self.job, self.params, self.checkpointing = job, params, checkpointing
        _, stored = checkpoint_tensors(job.merged, job.replacements)
        self.stored = stored  # a tensor as the closed form left it, in its stored dtype
        self.stored_dtypes: dict[str, torch.dtype] = {}  # each tensor's, noted as the model is built: written() casts back

        def get(name: str) -> torch.Tensor:
            tensor = stored(name)
            self.stored_dtypes[name] = tensor.dtype
            return tensor
        self.names = names = student_names(job)  # kept tied where the output must be, whatever lm_head.weight the merge stores
        # frozen weights stay in the compute dtype under autocast, which casts every matmul alike; without it (float32
        # throughout) they are float32 too, or a float32 activation would meet a bf16 weight
        frozen = master if params == "full" or autocast is None else job.compute_dtype
        ranks = {name: len(shape) for name, (shape, _) in job.merged.layout().items()}
        # adapter: the frozen weights in the compute dtype, what trains in full (norms, biases, the head) in the master dtype
        dtypes = lambda name: master if params == "full" or name == LM_HEAD or ranks.get(name, 2) == 1 else frozen  # noqa: E731
        self.model = build_causal_lm(job.config, names, get, job.device, frozen, "the calibrated model", job.trust_remote_code,
                                     dtypes=dtypes)
        tied = LM_HEAD not in names
        if checkpointing:  # each layer's activations recomputed in the backward
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # transformers < 5.x's name
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if params == "full":
            self.model.requires_grad_(True)
            self.module = self.model
        else:
            from peft import LoraConfig, get_peft_model

            from featcal_llm.io.lora import peft_quietly

            head = self.model.get_output_embeddings().weight
            head.data = head.data.to(master)  # trained in full (the tied embedding with it)
            suffixes = sorted({p.rsplit(".", 1)[-1] for p in job.projections})
            lora = LoraConfig(r=job.spec.rank, lora_alpha=job.spec.rank, lora_dropout=0.0, target_modules=suffixes, bias="none")
            with peft_quietly():
                self.module = get_peft_model(self.model, lora)
            for name, parameter in self.model.named_parameters():
                if parameter.dim() == 1 or parameter is head:
                    parameter.requires_grad_(True)
        self.trainable = {name: p for name, p in self.module.named_parameters() if p.requires_grad}
        self.tied = tied

    def state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to("cpu", copy=True) for name, p in self.trainable.items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, parameter in self.trainable.items():
                parameter.copy_(state[name])

    def written(self) -> dict[str, torch.Tensor]:
        """Every tensor the refinement changed, by checkpoint name, in the dtype the checkpoint stores it in. An adapter
        is merged back into the weights as stored (`_merged_back`), one projection at a time."""
        merged_back = {}
        if self.params == "adapter":
            from peft.tuners.lora import LoraLayer

            merged_back = {f"{name}.weight": self._merged_back(f"{name}.weight", module)
                           for name, module in self.model.named_modules() if isinstance(module, LoraLayer)}
        model = self.module.unload() if self.params == "adapter" else self.model
        head = model.get_output_embeddings().weight
        projections = tuple(f"{p}.weight" for p in self.job.projections)
        tensors = {}
        for name, parameter in model.named_parameters():  # a tied head is listed once, as the input embedding
            if name not in self.names:
                continue
            if name in merged_back:
                tensors[name] = merged_back[name]
            elif self.params == "full" or parameter.dim() == 1 or parameter is head or name.endswith(projections):
                tensors[name] = parameter.detach().to("cpu", self.stored_dtypes[name])
        return tensors

    def _merged_back(self, name: str, module: torch.nn.Module) -> torch.Tensor:
        """W + scale·B·A with W as stored (the closed form's), in at least float32 on the device, then in W's dtype. The
        frozen copy the adapter trained against is in the compute dtype (bf16 under autocast): peft's own merge into it
        would round a float32 checkpoint's projections to bf16. One projection at a time: at 8B a float32 copy of every
        projection would be 28 GB of host memory."""
        stored = self.stored(name)
        delta = module.get_delta_weight("default").detach()
        wide = torch.promote_types(stored.dtype, torch.float32)
        return (stored.to(delta.device, wide) + delta.to(wide)).to(stored.dtype).cpu()
