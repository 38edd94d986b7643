"""A mergekit recipe plus its ``featcal:`` block, validated.

The mergekit part is parsed by mergekit's own ``MergeConfiguration`` (so what
``mergekit-yaml`` accepts we accept); the ``featcal:`` block is ours and is
strict: an unknown or misspelled key is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from featcal_llm.errors import FeatCalError
from featcal_llm.io.forms import check_forms
from featcal_llm.startup import heavy_import

try:  # the evaluation package owns its own block; the engine works without it
    from featcal_llm.evaluation.config import EvalSection
except ImportError:  # pragma: no cover - only while the evaluation package is absent
    EvalSection = dict[str, Any]  # type: ignore[misc,assignment]


def beside_recipe(path: str, base_dir: Path | None) -> Path:
    """`path` as given (relative to the current directory, as mergekit reads paths), or under the recipe's directory where only that one exists."""
    given = Path(path)
    if not given.is_absolute() and base_dir is not None and not given.exists() and (base_dir / given).exists():
        return base_dir / given
    return given


class GenerateSpec(BaseModel):
    """An expert writes its own calibration texts (featcal_llm/generation): from its BOS token, or continuing prompts.

    Defaults sample the expert's own distribution (temperature 1, no top-p or
    top-k cut): calibration wants inputs on which the expert behaves as itself,
    not its most likely text, which repeats itself far more often.
    """

    model_config = ConfigDict(extra="forbid")

    samples: int | None = Field(None, ge=1, description="texts kept after filtering; default featcal.samples")
    max_new_tokens: int = Field(512, ge=1)
    prompts: str | None = Field(None, description=".txt (one prompt per line) or .jsonl (field `prompt`); default: from BOS, or the shipped seed prompts for a chat template")
    start: str | None = Field(None, description="without prompts: the token every sample begins with (default the tokenizer's BOS, else EOS)")
    temperature: float = Field(1.0, ge=0.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, description="default featcal.seed")
    chat_template: Literal["auto", "on", "off"] = Field("auto", description="auto: on when the expert's tokenizer has one")
    batch_size: int = Field(32, ge=1, description="sequences per transformers generate call (part of what a seed reproduces)")
    backend: Literal["auto", "vllm", "transformers"] = Field("auto", description="auto: vLLM when installed and the device is a GPU")

    @field_validator("chat_template", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        """YAML 1.1 reads an unquoted `on`/`off` as a boolean: take it as the word written."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _start_without_prompts(self) -> "GenerateSpec":
        if self.start is not None and self.prompts is not None:
            raise ValueError("start is the first token of prompt-less samples; with prompts the prompts begin them")
        if self.start is not None and self.chat_template == "on":
            raise ValueError("start begins raw samples; chat_template: on answers prompts (set chat_template: off)")
        return self


class DataSpec(BaseModel):
    """Where one expert's calibration texts come from (a dataset, or the expert itself) and how records become text."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="local .jsonl/.json/.parquet/.csv file, local dataset dir, or hub dataset id")
    generate: GenerateSpec | None = Field(None, description="instead of path: the expert samples its own texts")
    split: str = "train"
    name: str | None = Field(None, description="dataset configuration name for load_dataset")
    format: Literal["text", "alpaca", "chat"] = "text"
    text: str = "text"
    instruction: str = "instruction"
    input: str | None = "input"
    response: str = "response"
    prompt: str = "prompt"
    messages: str | None = Field(None, description="field holding a list of chat messages (format: chat)")
    samples: int | None = Field(None, ge=1, description="overrides featcal.samples for this expert")

    @model_validator(mode="after")
    def _one_source(self) -> "DataSpec":
        if (self.path is None) == (self.generate is None):
            raise ValueError("expected either path (a dataset) or generate (the expert writes its own), not " + ("both" if self.path else "neither"))
        if self.generate is not None:
            given = [key for key in self.model_fields_set if key not in ("generate", "samples")]
            if given:
                raise ValueError(f"{given[0]} describes dataset records; with generate only samples applies")
            if self.samples is not None and self.generate.samples is not None:
                raise ValueError("samples is given twice (here and under generate); keep one")
        return self


class PerLayer(BaseModel):
    """One value per decoder layer, as a tuned run writes its winners (`lambda: {per_layer: [...]}`): replayed, not searched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_layer: tuple[float, ...]


# a fixed value, a candidate list, the documented default set, or one value per layer
Tunable = float | tuple[float, ...] | Literal["auto"] | PerLayer
_RANGES = {  # hyper-parameter → (lower bound, lower inclusive, upper bound)
    "lambda": (0.0, False, None),
    "alpha": (0.0, True, 1.0),
    "rho": (None, True, None),
    "reduction": (0.0, True, 1.0),
}
METHODS = ("featcal", "regmean", "regmean++")
STACKS = (("regmean", "featcal"), ("regmean++", "featcal"))  # `method: [first, then]`
# keys that only FeatCal reads, and the one only RegMean/RegMean++ read: setting one for the other method is an error
FEATCAL_ONLY = ("lambda_", "alpha", "rho", "norms", "biases")
REGMEAN_ONLY = ("reduction",)


def _check_tunable(key: str, value: Any) -> Any:
    """A number, `auto`, a non-empty list of numbers or {per_layer: [numbers]}, each inside the key's range.

    A one-element list is that value, fixed: there is nothing to choose between.
    """
    if value == "auto" or isinstance(value, PerLayer):
        return value
    if isinstance(value, dict):
        if set(value) != {"per_layer"} or not isinstance(value["per_layer"], (list, tuple)) or not value["per_layer"]:
            raise ValueError("expected {per_layer: [one number per decoder layer]}")
        return {"per_layer": _numbers(key, value["per_layer"])}
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError("expected a number, auto or a non-empty list of numbers")
    numbers = _numbers(key, values)
    if isinstance(value, (list, tuple)) and len(set(numbers)) > 1:
        return tuple(numbers)
    return numbers[0]


def _numbers(key: str, values: Any) -> list[float]:
    """Each value as a float inside the key's range."""
    low, inclusive, high = _RANGES[key]
    numbers = []
    for item in values:
        if isinstance(item, str):  # YAML 1.1 reads `1e-5` (no dot) as a string, as pydantic's floats accept
            try:
                item = float(item)
            except ValueError:
                pass
        if isinstance(item, bool) or not isinstance(item, (int, float)) or item != item:
            raise ValueError(f"expected a number, auto or a list of numbers, got {item!r}")
        numbers.append(float(item))
        if low is not None and (item < low or (item == low and not inclusive)):
            raise ValueError(f"every value should be greater than {'or equal to ' if inclusive else ''}{low:g}, got {item!r}")
        if high is not None and item > high:
            raise ValueError(f"every value should be less than or equal to {high:g}, got {item!r}")
    return numbers


class TuneSpec(BaseModel):
    """How `auto`/list hyper-parameters are chosen (featcal_llm/engine/tuning.py)."""

    model_config = ConfigDict(extra="forbid")

    holdout: float = Field(0.25, gt=0.0, lt=1.0, description="share of each expert's records kept aside for selection")
    budget: int = Field(12, ge=1, description="at most this many candidate settings evaluated per layer")
    criterion: Literal["output", "hidden"] = Field(
        "hidden", description="hidden: the layer output's drift to the expert; output: next-token KL through the final norm and LM head"
    )


class FeatCalConfig(BaseModel):
    """The ``featcal:`` block. Defaults are the paper's 3B settings where it has them."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    merged: str
    output: str
    data: dict[str, DataSpec]
    method: str | tuple[str, str] = Field(
        "featcal", description="featcal, regmean (expert i's own inputs), regmean++ (the propagated inputs), or a stack "
        "[regmean, featcal] / [regmean++, featcal]: RegMean first, then FeatCal on its result, in one run"
    )
    reduction: Tunable | None = Field(None, description="RegMean's off-diagonal scaling of the Grams (default 0.5)")
    samples: int = Field(256, ge=1)
    max_length: int = Field(2048, ge=2)
    lambda_: Tunable = Field(1e-5, alias="lambda")
    alpha: Tunable = 0.15
    rho: Tunable = 0.5
    tune: TuneSpec | None = None
    eps: float = Field(1e-8, gt=0)
    shuffle: bool = False
    seed: int = 0
    device: str = "auto"
    dtype: Literal["auto", "float64", "float32", "bfloat16", "float16"] = "auto"
    stats_dtype: Literal["auto", "float32", "float64"] = Field(
        "auto", description="precision of the statistics products (summed in float64); auto: float32 when every lambda the run uses is >= 1e-2, else float64 (float32 with a warning on GPUs without fast float64)"
    )
    host_memory_gb: float | None = Field(
        None, gt=0, description="RAM for hidden-state streams before they spill to memory-mapped files; default half the machine"
    )
    batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward batch")
    modules: list[str] | None = Field(None, description="restrict calibration to these projections, e.g. [q_proj, down_proj]")
    norms: bool = Field(False, description="also update RMSNorm scales")
    biases: bool = Field(True, description="update biases of projections that have one")
    tokenizer: str | None = Field(None, description="tokenizer source; default: the merged model's")
    trust_remote_code: bool = False
    eval: EvalSection | None = None  # type: ignore[valid-type]

    @field_validator("lambda_", "alpha", "rho", "reduction", mode="before")
    @classmethod
    def _tunable(cls, value: Any, info) -> Any:
        return _check_tunable("lambda" if info.field_name == "lambda_" else info.field_name, value)

    @field_validator("method", mode="before")
    @classmethod
    def _known_method(cls, value: Any) -> str | tuple[str, str]:
        if isinstance(value, (list, tuple)):
            if len(value) == 1 and value[0] in METHODS:
                return value[0]
            if tuple(value) not in STACKS:
                raise ValueError("expected a stack [regmean, featcal] or [regmean++, featcal]: RegMean first, then FeatCal on its result")
            return tuple(value)
        if value not in METHODS:
            raise ValueError(f"expected one of {', '.join(METHODS)}, or a stack [regmean++, featcal]")
        return value

    @property
    def stacked(self) -> bool:
        """Whether the method is a stack: RegMean or RegMean++ first, then FeatCal on its result."""
        return isinstance(self.method, tuple)

    def stage(self, index: int, intermediate: str) -> "FeatCalConfig":
        """The stack's stage as a one-method block: stage 0 writes RegMean to `intermediate`, stage 1 calibrates it.

        Each stage keeps its own keys; `tune:` goes to the stages that search or replay a search, so that a stack
        does what two recipes run one after the other do.
        """
        method = self.method[index]
        update: dict[str, Any] = {"method": method}
        if index == 0:
            update.update(output=intermediate, eval=None, **{key: FeatCalConfig.model_fields[key].default for key in FEATCAL_ONLY})
        else:
            update.update(merged=intermediate, reduction=None)
        stage = self.model_copy(update=update)
        searched = stage.tuned or stage.per_layer
        return stage.model_copy(update={"tune": self.tune if searched else None})

    @property
    def regmean(self) -> bool:
        """Whether the method is RegMean or RegMean++ (reduction is theirs; lambda/alpha/rho/norms/biases are FeatCal's)."""
        return self.method in ("regmean", "regmean++")

    def hyper_values(self) -> dict[str, Any]:
        """The method's hyper-parameters as the recipe gives them (numbers, `auto`, lists or per_layer); a stack's: both stages'."""
        values: dict[str, Any] = {}
        if self.regmean or self.stacked:
            values["reduction"] = 0.5 if self.reduction is None else self.reduction
        if not self.regmean:
            values.update({"lambda": self.lambda_, "alpha": self.alpha, "rho": self.rho})
        return values

    @property
    def tuned(self) -> bool:
        """Whether any hyper-parameter is chosen by the run (auto or a list) rather than given."""
        return any(v == "auto" or isinstance(v, tuple) for v in self.hyper_values().values())

    @property
    def holds_out(self) -> bool:
        """Whether records are held out of the statistics: by a search, or by the replay of one (per_layer values with `tune:`)."""
        return self.tuned or (self.per_layer and self.tune is not None)

    @property
    def per_layer(self) -> bool:
        """Whether any hyper-parameter is given per layer (a tuned run's written winners)."""
        return any(isinstance(v, PerLayer) for v in self.hyper_values().values())

    def tune_settings(self) -> TuneSpec:
        return self.tune or TuneSpec()

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or value.startswith("cuda:"):
            return value
        raise ValueError("expected auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class Expert:
    """An expert as the recipe names it, with where its weights live."""

    name: str  # exactly as written under `models:`; keys `featcal.data`
    reference: Any  # mergekit ModelReference


@dataclass(frozen=True)
class Recipe:
    path: Path
    text: str
    merge_config: Any  # mergekit MergeConfiguration
    featcal: FeatCalConfig
    base: Any  # mergekit ModelReference
    experts: tuple[Expert, ...]
    merged_label: str | None = None  # how the model card names the start of calibration (default featcal.merged)


def _format_validation_error(path: Path, error: ValidationError, prefix: str) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    key = f"{prefix}.{location}" if location else prefix
    if first["type"] == "extra_forbidden":
        return f"{path}: {key}: unknown key"
    if first["type"] == "missing":
        return f"{path}: {key}: required key is missing"
    message = first["msg"].removeprefix("Value error, ")
    return f"{path}: {key}: {message} (got {first.get('input')!r})"


def _read_yaml_mapping(path: Path) -> dict:
    if not path.is_file():
        raise FeatCalError(f"{path}: recipe file not found")
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise FeatCalError(f"{path}: not valid YAML{where}") from None
    if not isinstance(raw, dict):
        raise FeatCalError(f"{path}: expected a YAML mapping (a mergekit recipe), got {type(raw).__name__}")
    return raw


def _experts_of(merge_config: Any) -> list[Any]:
    """Every input model except the base, in recipe order, from `models:` or `slices:`."""
    references: list[Any] = []
    if merge_config.models:
        references = [entry.model for entry in merge_config.models]
    else:
        slices = merge_config.slices or [
            s for module in (merge_config.modules or {}).values() for s in (module.slices or [])
        ]
        for output_slice in slices:
            references.extend(source.model for source in output_slice.sources)
    unique: list[Any] = []
    for reference in references:
        if reference != merge_config.base_model and reference not in unique:
            unique.append(reference)
    return unique


def _stages(featcal: FeatCalConfig) -> list[FeatCalConfig]:
    """The block's one-method stages (itself, unless it is a stack)."""
    return [featcal.stage(i, featcal.output) for i in range(2)] if featcal.stacked else [featcal]


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe without touching any model or dataset."""
    MergeConfiguration = heavy_import("mergekit.config").MergeConfiguration

    path = Path(path)
    raw = _read_yaml_mapping(path)
    block = raw.pop("featcal", None)
    if block is None:
        raise FeatCalError(f"{path}: featcal: block is missing (add it after the mergekit recipe)")
    if not isinstance(block, dict):
        raise FeatCalError(f"{path}: featcal: expected a mapping")
    try:
        merge_config = MergeConfiguration.model_validate(raw)
    except ValidationError as error:
        raise FeatCalError(_format_validation_error(path, error, "recipe")) from None
    except Exception as error:  # mergekit raises RuntimeError from its own validators
        raise FeatCalError(f"{path}: not a valid mergekit recipe: {error}") from None
    try:
        featcal = FeatCalConfig.model_validate(block)
    except ValidationError as error:
        raise FeatCalError(_format_validation_error(path, error, "featcal")) from None
    wrong = [] if featcal.stacked else [key for key in (REGMEAN_ONLY if not featcal.regmean else FEATCAL_ONLY) if key in featcal.model_fields_set]
    if wrong:
        key = wrong[0].rstrip("_")
        owner = "regmean and regmean++" if not featcal.regmean else "featcal"
        raise FeatCalError(f"{path}: featcal.{key}: only method {owner} reads it (method is {featcal.method})")
    if any(stage.tuned and stage.per_layer for stage in _stages(featcal)):
        raise FeatCalError(f"{path}: featcal: per_layer values replay a tuned run and cannot be combined with auto or candidate lists")
    if featcal.tune is not None and not featcal.tuned and not featcal.per_layer:
        raise FeatCalError(f"{path}: featcal.tune: nothing to tune (set {'reduction' if featcal.regmean else 'lambda, alpha or rho'} to auto or a list of candidates)")
    check_forms(merge_config, path)
    if merge_config.base_model is None:
        raise FeatCalError(f"{path}: base_model: FeatCal needs the base model the experts were fine-tuned from")

    experts = tuple(Expert(str(reference), reference) for reference in _experts_of(merge_config))
    if not experts:
        raise FeatCalError(f"{path}: models: no expert besides the base model")
    names = [expert.name for expert in experts]
    for name in names:
        if name not in featcal.data:
            raise FeatCalError(f"{path}: featcal.data: no calibration data for expert {name!r}")
    for key in featcal.data:
        if key not in names:
            raise FeatCalError(f"{path}: featcal.data.{key}: not an expert of this recipe (experts: {', '.join(names)})")
    for name, spec in featcal.data.items():  # a prompts file is read now: a bad one stops the run before any work
        if spec.generate is not None and spec.generate.prompts is not None:
            from featcal_llm.generation.prompts import read_prompts

            read_prompts(beside_recipe(spec.generate.prompts, path.parent), f"{path}: featcal.data.{name}.generate.prompts")
    return Recipe(
        path=path,
        text=path.read_text(encoding="utf-8"),
        merge_config=merge_config,
        featcal=featcal,
        base=merge_config.base_model,
        experts=experts,
    )
