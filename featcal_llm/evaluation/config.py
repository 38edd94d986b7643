"""Settings of one evaluation run, shared by the CLI and a recipe's `featcal.eval:` block.

Only pydantic lives here, so the recipe loader can import `EvalSection` without pulling in
lm-eval, torch or vLLM.
"""

from __future__ import annotations

import re
import sys

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PositiveInt,
    field_validator,
    model_validator,
)

from featcal_llm.io.recipe_model import RecipeModel

BackendName = Literal["auto", "vllm", "hf"]
ChatTemplateMode = Literal["auto", "on", "off"]


class BackendSettings(RecipeModel):
    """How lm-eval drives the model; every field is recorded and is part of the cache key."""

    model_config = ConfigDict(extra="forbid")

    name: BackendName = Field("auto", description="auto = vllm when CUDA is present, else hf")
    dtype: str = Field("auto", description="auto = the dtype the checkpoint's config names, asked of either backend "
                       "(vLLM's own auto would serve a float32 checkpoint in bfloat16)")
    batch_size: PositiveInt | Literal["auto"] | None = Field(
        None, description="None = vllm: auto; hf: auto on CUDA, 1 on CPU"
    )
    tensor_parallel_size: PositiveInt = Field(1, description="vllm: GPUs one model is split across")
    data_parallel_size: PositiveInt = Field(1, description="vllm: model replicas (lm-eval runs them with Ray)")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="more lm-eval model_args, passed through to vllm.LLM (e.g. enforce_eager, "
        "max_num_seqs) or to the hf model (e.g. attn_implementation, use_cache); may not repeat a key set above, and "
        "a key the backend does not take is refused before any model loads (vllm: lm-eval's vllm model, vllm.LLM, "
        "EngineArgs; hf: lm-eval's hf model, transformers' from_pretrained, the model's config)",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="vllm: share of GPU memory it may take")
    max_model_len: PositiveInt | None = Field(
        None,
        description="context length (vllm max_model_len, hf max_length); None = the suite's "
        "context_length capped at the model's max_position_embeddings",
    )
    device: str | None = Field(None, description="hf only: cuda, cuda:N or cpu (vllm: CUDA_VISIBLE_DEVICES)")
    seed: int = Field(1234, description="vllm sampling seed (lm-eval's default)")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", value):  # another string had run on the CPU
            raise ValueError(f"expected cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        allowed = {"auto", "bfloat16", "float16", "float32"}
        if value not in allowed:
            raise ValueError(f"expected one of {sorted(allowed)}")
        return value


class EvalSection(RecipeModel):
    """The `featcal.eval:` block of a recipe: score the merged and calibrated models after `run`.

    Relative paths of what it reads (suite file, data overrides, nltk_data) are read as `featcal.data` paths are: from
    the current directory, or beside the recipe where only that one exists; `output` is from the current directory, as
    featcal.output is.
    """

    model_config = ConfigDict(extra="forbid")

    suite: str = Field("mergebench", description="a suite by name (shipped: mergebench, mergebench-protocol; or in $FEATCAL_EVAL_DIR), or a suite YAML path")
    tasks: list[str] | None = Field(None, min_length=1, description="subset of the suite's task ids; None = all")
    backend: BackendSettings = Field(default_factory=BackendSettings, description="how lm-eval drives the model (see eval.backend:)")
    chat_template: ChatTemplateMode = Field(
        "auto", description="auto = on when the model or its merge base is an -Instruct/chat model"
    )
    allow_code_execution: bool = Field(
        False, description="run model-written code for HumanEval+/MBPP+ (subprocess per sample)"
    )
    limit: PositiveInt | None = Field(None, le=sys.maxsize, description="first N items per task (smoke runs only)")
    max_gen_toks: PositiveInt | None = Field(None, description="override every task's max_gen_toks")
    output: str = Field("eval-results", min_length=1, description="results directory")
    data: dict[str, str] = Field(default_factory=dict, description="task id -> local file or directory")
    nltk_data: str | None = Field(None, description="directory holding NLTK's punkt_tab (IFEval)")
    code_workers: PositiveInt | None = Field(None, description="programs run in parallel (default: min(8, CPUs))")
    reference: str | None = Field(
        None, description="paper rows to print alongside, e.g. 'Llama-3.2-3B-Instruct'"
    )

    @field_validator("chat_template", mode="before")
    @classmethod
    def _yaml_booleans(cls, value):
        """YAML 1.1 reads an unquoted `on`/`off` as a boolean."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @model_validator(mode="after")
    def _code_needs_opt_in(self) -> "EvalSection":
        """Catch a suite with code tasks and no opt-in when the recipe is read, not after hours
        of calibration. A suite given by a relative path is checked when it runs."""
        from featcal_llm.errors import FeatCalError
        from featcal_llm.evaluation.suite import code_opt_in_problem, load_suite

        by_name = not (self.suite.endswith((".yaml", ".yml")) or "/" in self.suite)
        if not by_name and not Path(self.suite).expanduser().is_absolute():
            return self
        try:
            suite = load_suite(self.suite)
        except FeatCalError as error:
            raise ValueError(f"suite: {error}") from None
        try:
            problem = code_opt_in_problem(suite, suite.select(self.tasks, "tasks"), self.allow_code_execution)
        except FeatCalError as error:  # "tasks: unknown task ..."
            raise ValueError(str(error)) from None
        if problem:
            raise ValueError(problem)
        return self

    def resolve(self, recipe_dir: Path | None = None) -> "EvalSection":
        """A copy whose relative paths are absolute: inputs from the current directory or beside the recipe
        (`recipe_dir`, as `beside_recipe` finds them), the output from the current directory."""
        from featcal_llm.io.block import beside_recipe

        def read(value: str) -> str:
            return str(beside_recipe(str(Path(value).expanduser()), recipe_dir).absolute())

        suite = self.suite
        if suite.endswith((".yaml", ".yml")) or "/" in suite:
            suite = read(suite)
        return self.model_copy(
            update={
                "suite": suite,
                "output": str(Path(self.output).expanduser().absolute()),
                "data": {task: read(path) for task, path in self.data.items()},
                "nltk_data": read(self.nltk_data) if self.nltk_data else None,
            }
        )


_OPTION_NAMES = {"backend.name": "--backend", "allow_code_execution": "--allow-code-execution"}


def section_from_options(options: dict, caller: str = "eval") -> EvalSection:
    """Validate CLI options (or `evaluate()`'s keyword arguments, `caller` "evaluate()") with the recipe's model;
    errors name the option or the argument, on one line."""
    from pydantic import ValidationError

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.problems import pydantic_problems

    try:
        section = EvalSection.model_validate(options)
    except ValidationError as error:
        first = pydantic_problems("", error, "", EvalSection)[0]
        where, message = first.key, first.message
        if not where:  # the whole section's check: its message opens with the key it is about, where one is
            key, _, rest = message.partition(": ")
            if caller == "eval" and key in ("suite", "tasks"):
                raise FeatCalError(f"eval --{key}: {rest}") from None
            raise FeatCalError(f"{caller}: {message}") from None
        if caller != "eval":  # a keyword argument, not a recipe key
            raise FeatCalError(f"{caller} {where}: {message.replace('unknown key', 'unknown argument', 1)}") from None
        option = _OPTION_NAMES.get(where) or "--" + where.split(".")[-1].replace("_", "-")
        raise FeatCalError(f"eval {option}: {message}") from None
    return section.resolve()
