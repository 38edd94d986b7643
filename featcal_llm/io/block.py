"""The ``featcal:`` block of a recipe, as pydantic models: every key, its type, default and range.

Strict: an unknown or misspelled key is an error that names it. The nested sections (data, generate, merge_options,
tune, head, refine) are in ``featcal_llm.io.block_sections``. Reading a recipe file, the mergekit part and the
checks across both parts are in ``featcal_llm.io.recipe``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from featcal_llm.errors import FeatCalError
from featcal_llm.io.block_sections import MAX_TOKENS, SEED_MAX, DataSpec, HeadSpec, MergeOptionsSpec, RefineSpec, TuneSpec
from featcal_llm.io.recipe_model import RecipeModel

try:  # the evaluation package owns its own block; the engine works without it
    from featcal_llm.evaluation.config import EvalSection
except ImportError:  # pragma: no cover - only while the evaluation package is absent
    EvalSection = dict[str, Any]  # type: ignore[misc,assignment]


# what a path written with `~` is told: mergekit, datasets and the run take paths as written (only the eval: block, lm-eval's,
# expands it)
TILDE_NOT_EXPANDED = "run takes a path as written, so `~` would be a folder of that name here; write the path out in full"


def beside_recipe(path: str, base_dir: Path | None) -> Path:
    """`path` as given (relative to the current directory, as mergekit reads paths), or under the recipe's directory where only that one exists."""
    given = Path(path)
    if not given.is_absolute() and base_dir is not None and not given.exists() and (base_dir / given).exists():
        return base_dir / given
    return given


class PerLayer(RecipeModel):
    """One value per decoder layer, as a tuned run writes its winners (`lambda: {per_layer: [...]}`): replayed, not searched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_layer: tuple[float, ...] = Field(description="one value per decoder layer, in layer order")


# a fixed value, a candidate list, the documented default set, or one value per layer
Tunable = float | tuple[float, ...] | Literal["auto"] | PerLayer
# |rho| past this is no anchor: the merge's task vector scaled so far overflows the weights (1e30 gives NaN at layer 0)
RHO_LIMIT = 100.0
_RANGES = {  # hyper-parameter → (lower bound, lower inclusive, upper bound)
    "lambda": (0.0, False, None),
    "alpha": (0.0, True, 1.0),
    "rho": (-RHO_LIMIT, True, RHO_LIMIT),
    "reduction": (0.0, True, 1.0),
}
METHODS = ("featcal", "regmean", "regmean++")
STACKS = (("regmean", "featcal"), ("regmean++", "featcal"))  # `method: [first, then]`
# keys that only FeatCal reads, and the one only RegMean/RegMean++ read: setting one for the other method is an error
FEATCAL_ONLY = ("lambda_", "alpha", "rho", "norms", "biases", "head", "trailing_experts", "trailing_records", "teachers")
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
        if isinstance(item, bool) or not isinstance(item, (int, float)) or item != item or item in (float("inf"), float("-inf")):
            raise ValueError(f"expected a finite number, auto or a list of numbers, got {item!r}")
        numbers.append(float(item))
        if low is not None and (item < low or (item == low and not inclusive)):
            raise ValueError(f"every value should be greater than {'or equal to ' if inclusive else ''}{low:g}, got {item!r}")
        if high is not None and item > high:
            raise ValueError(f"every value should be less than or equal to {high:g}, got {item!r}")
    return numbers


# keys and values renamed since they were published: refused with a one-line error that names the new one
RENAMED_KEYS = {"balance": "expert_weights"}
RENAMED_VALUES = {"token_weights": {"advantage": "expert_lead"}}


class FeatCalConfig(RecipeModel):
    """The ``featcal:`` block. lambda, alpha and rho default to the paper's 3B settings; expert_weights and
    token_weights default to featcal-llm's own (coverage, expert_lead), the paper's being equal and equal."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)
    renamed_keys: ClassVar[dict[str, str]] = RENAMED_KEYS

    merged: str = Field(min_length=1, description="directory of the mergekit merge (written by the run when it does not exist)")
    output: str = Field(min_length=1, description="directory the calibrated checkpoint is written to")
    data: dict[str, DataSpec] = Field(description="calibration data per expert, keyed by the expert's name as written under models:")
    method: str | tuple[str, str] = Field(
        "featcal", description="featcal, regmean (expert i's own inputs), regmean++ (the propagated inputs), or a stack "
        "[regmean, featcal] / [regmean++, featcal]: RegMean first, then FeatCal on its result, in one run"
    )
    reduction: Tunable | None = Field(None, description="RegMean's off-diagonal scaling of the Grams (default 0.5)")
    samples: int = Field(256, ge=1, description="calibration records per expert")
    expert_weights: Literal["coverage", "equal"] | None = Field(
        None, description="how the experts weigh against each other where data.<expert>.weight is not given. coverage "
        "(FeatCal's default): each expert counts once for its own records plus the share of every other expert's gain over "
        "the base that it also achieves on that expert's records, so a broad expert beside narrow ones counts for several "
        "(a pass over 16 records per expert, before the layers); equal: every expert 1 (RegMean's default, and the paper's)",
        json_schema_extra={"shown_default": "`coverage` (regmean, regmean++: `equal`)"},
    )
    token_weights: Literal["expert_lead", "equal"] | None = Field(
        None, description="how the tokens of an expert's records weigh. expert_lead (FeatCal's default): half of each token's "
        "weight is 1, half is the expert's lead over the merged model at predicting the next token, a = max(0, log p_expert − "
        "log p_merged), scaled to mean 1 over the expert's tokens: w = ½ + ½·a/mean(a), so a token weighs ½ (not 0) where the "
        "merge predicts it as well or better and the re-fit leans to where the expert knows what the merge lost (the merged "
        "model and each expert run over its records once, before the layers); equal: every token 1 (RegMean's default, and the paper's)",
        json_schema_extra={"shown_default": "`expert_lead` (regmean, regmean++: `equal`)"},
    )
    trailing_experts: Literal["keep", "merge"] | None = Field(
        None, description="what the records of an expert that trails the merged model on them are calibrated toward (its "
        "mean lead over the merge at predicting the next token of its own calibration records, log p_expert − log p_merged, "
        "is 0 or below even when raised by two standard errors counted over its records, so that a lead too close to 0 for "
        "its records to tell the sign leaves the expert its records; on a prompt/response record only the response counts). "
        "merge (the default for FeatCal): the merged "
        "model's own features and LM head, as if the merge were that expert, so that an expert behind the merge on its own "
        "text cannot pull the merge back; keep (the paper's, and RegMean's): the expert's, as for every other expert. The "
        "lead comes from the token-weight pass (the merged model and each expert run over its records once, before the layers). "
        "Where every expert with a weight above 0 trails, no layer is re-fitted and the output is the merged model; an expert "
        "whose calibration records keep no judged (response) token is refused, its lead being unmeasured",
        json_schema_extra={"shown_default": "`merge` (RegMean: `keep`)"},
    )
    teachers: Literal["own", "best"] | None = Field(
        None, description="which model each expert's records are calibrated toward. best (the default for FeatCal): "
        "another expert where it predicts those records better beyond doubt (its mean lead over the records' own expert "
        "at predicting the next token, on the judged tokens of the coverage pass's sample of 16 records, stays above 0 "
        "when lowered by two standard errors counted over the records), as a broad expert beside a narrow one that it "
        "beats on the narrow one's own text; else the expert itself. The records keep their expert's weight, and the "
        "token weights, trailing_experts and refine read the chosen teacher in the expert's place; where every expert "
        "predicts its own records best the run is own's, byte for byte. It runs the coverage pass even with "
        "expert_weights: equal. own (the paper's, and RegMean's): every expert teaches its own records (or the merge, by "
        "trailing_experts)",
        json_schema_extra={"shown_default": "`best` (RegMean: `own`)"},
    )
    trailing_records: Literal["drop", "keep"] = Field(
        "drop", description="with token_weights: expert_lead, what a record weighs whose own expert predicts it worse than "
        "the merged model (its lead over the merge, summed over the record's judged tokens, is below 0) while the expert "
        "teaches its own records (it is not behind the merge beyond doubt, as trailing_experts judges): drop (the default): 0, as the expert knows nothing there that the merge lacks and "
        "pulling toward it could only pull the merge back on that text (a broad expert on the kind a narrow expert beside it "
        "knows better); keep: its tokens weigh as any other's (w = ½ + ½·a/mean(a))")
    max_length: int = Field(2048, ge=2, le=MAX_TOKENS, description="tokens per record; longer records are truncated")
    lambda_: Tunable = Field(1e-5, alias="lambda", description="ridge strength of the re-fit (> 0); a number, a list of candidates, auto, or {per_layer: [...]}")
    alpha: Tunable = Field(0.15, description="target input mix: alpha times the expert's input plus (1 - alpha) times the calibrated model's (0 to 1); tunable like lambda")
    rho: Tunable = Field(0.5, description="ridge anchor rho * merged + (1 - rho) * base (-100 to 100; above 1 extrapolates past the merge); tunable like lambda")
    tune: TuneSpec | None = Field(None, description="how auto or candidate-list hyper-parameters are chosen (see tune:)")
    eps: float = Field(1e-8, gt=0, description="floor of each task's Gram norm in its weight 1 / max(norm, eps), also added to the ridge")
    shuffle: bool = Field(False, description="shuffle each expert's records (with seed) before taking the first samples")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="seed of the shuffle, the held-out split and generation")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (auto: cuda when available)")
    dtype: Literal["auto", "float64", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype of the layers; auto: bfloat16 on GPUs; on CPUs bfloat16 where the checkpoint is stored in bfloat16 and the CPU has bf16 units, else float32"
    )
    stats_dtype: Literal["auto", "float32", "float64"] = Field(
        "auto", description="precision of the statistics products (summed in float64); auto: float64 when dtype is float64; otherwise float32 when every lambda the run uses is >= 1e-2 (regmean and regmean++ have no ridge: never), else float64, or float32 with a warning on a GPU without fast float64; the LM head's re-fit (head:) takes float64 whatever this says (float32 with a warning on a GPU without fast float64)"
    )
    host_memory_gb: float | None = Field(
        None, gt=0, description="RAM for hidden-state streams before they spill to memory-mapped files, in GB (10^9 bytes, as the memory plan prints sizes); default half the machine"
    )
    batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward batch")
    modules: list[str] | None = Field(None, min_length=1, description="restrict calibration to these projections, e.g. [q_proj, down_proj]")
    norms: bool = Field(False, description="also update RMSNorm scales")
    head: HeadSpec | None = Field(
        default_factory=lambda: HeadSpec(when="auto"), description="also re-fit the LM head after the last layer: auto "
        "(re-fit it where an expert's LM head, or the input embedding it is tied to, is not the base's), true (always), "
        "false (never), or a mapping (see head:); a head tied to the input embeddings becomes a tensor of its own "
        "(config tie_word_embeddings: false)", json_schema_extra={"shown_default": "`auto` (regmean, regmean++: `false`)",
                                                                "shown_type": "`auto` \\| `true` \\| `false` \\| mapping (`featcal.head:`)"},
    )
    biases: bool = Field(True, description="update biases of projections that have one")
    tokenizer: str | None = Field(None, min_length=1, description="tokenizer source; default: the merged model's")
    merge_options: MergeOptionsSpec = Field(default_factory=MergeOptionsSpec, description="mergekit's options for the merge the run makes (see merge_options:)")
    trust_remote_code: bool = Field(False, description="let transformers run the model repository's own code")
    license: str | None = Field(
        None, description="the model card's license, a Hub license id (apache-2.0, llama3.2, other, ...); default: the base "
        "model's, when its card is on this machine (a local base, or a hub base already downloaded)"
    )
    eval: EvalSection | None = Field(None, description="score the merged and calibrated models after the run (see eval:)",  # type: ignore[valid-type]
                                     json_schema_extra={"shown_type": "mapping (`featcal.eval:`)", "shown_default": "none (no evaluation)"})
    refine: RefineSpec | None = Field(
        None, description="after the closed form, a few gradient steps toward each record's teacher on the calibration records, "
        "stopped by the held-out records (see refine:): false (default), true (its defaults) or a mapping",
        json_schema_extra={"shown_default": "`false`", "shown_type": "`true` \\| `false` \\| mapping (`featcal.refine:`)"},
    )
    # A stack's RegMean stage holds out the records its FeatCal stage holds out (set by `stage`, never by a recipe)
    _holds_out_for_stack: bool = PrivateAttr(False)
    # a stack's first stage: its saved layers stay until the whole stack has finished, so that a rerun after stage 2
    # failed (or was stopped) takes stage 1's layers from them instead of calibrating them again
    _keeps_progress: bool = PrivateAttr(False)

    @field_validator("lambda_", "alpha", "rho", "reduction", mode="before")
    @classmethod
    def _tunable(cls, value: Any, info) -> Any:
        return _check_tunable("lambda" if info.field_name == "lambda_" else info.field_name, value)

    @field_validator("token_weights", mode="before")
    @classmethod
    def _renamed_value(cls, value: Any) -> Any:
        """`advantage` was the 0.1 name of expert_lead: refused with the new one, so no recipe changes meaning silently."""
        if value in RENAMED_VALUES.get("token_weights", {}):
            raise ValueError(f"{value} was renamed: use {RENAMED_VALUES['token_weights'][value]}")
        return value

    @field_validator("refine", mode="before")
    @classmethod
    def _refine(cls, value: Any) -> Any:
        if value is None:  # `refine:` with every key commented out read as off, where `refine: {}` is on, with its defaults
            raise ValueError("empty; write true for its defaults, a mapping of its keys, or false")
        if value is True:
            return {}
        if value is False:
            return None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"expected true, false or a mapping {{steps, lr, params, ...}}, got {value!r}")
        return value

    @field_validator("eval", mode="before")
    @classmethod
    def _eval(cls, value: Any) -> Any:
        if value is None:  # `eval:` with every key commented out: no evaluation, where `eval: {}` asks for the suite's
            raise ValueError("empty; write its keys (tasks, backend, ...) or leave eval: out")
        return value

    @field_validator("head", mode="before")
    @classmethod
    def _head(cls, value: Any) -> Any:
        if value is None:  # `head:` with every key commented out: it read as false, where the default is auto
            raise ValueError("empty; write auto, true, false or a mapping of its keys")
        if value is True:
            return {}
        if value is False:
            return None
        if value == "auto":
            return {"when": "auto"}
        if isinstance(value, str):
            raise ValueError(f"expected auto, true, false or a mapping {{when, lambda, alpha, rho}}, got {value!r}")
        return value

    @property
    def head_when_changed(self) -> bool:
        """Whether the head is re-fitted only where an expert changed it (`head: auto`, the default)."""
        return self.head is not None and self.head.when == "auto"

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
            raise ValueError(f"expected one of {', '.join(METHODS)}, or a stack [regmean, featcal] or [regmean++, featcal]")
        return value

    @property
    def stacked(self) -> bool:
        """Whether the method is a stack: RegMean or RegMean++ first, then FeatCal on its result."""
        return isinstance(self.method, tuple)

    def stage(self, index: int, intermediate: str) -> "FeatCalConfig":
        """The stack's stage as a one-method block: stage 0 writes RegMean to `intermediate`, stage 1 calibrates it.

        Which keys each stage reads: stage 0 (RegMean/RegMean++) reads `reduction` and weighs every expert and every
        token alike, as the published baseline does (`expert_weights:` and `token_weights:` are the FeatCal stage's);
        stage 1 reads lambda/alpha/rho, norms, biases, head, expert_weights and token_weights. Both read the data (each
        expert's records and its `weight:`), samples, max_length, seed and the run settings. `tune:` goes to the
        stages that search or replay a search. When either stage holds records out (a search, or a replay of one),
        both hold out the same split, so that RegMean's Grams never see the records FeatCal's choices are scored on.
        """
        method = self.method[index]
        update: dict[str, Any] = {"method": method}
        if index == 0:
            update.update(output=intermediate, eval=None, token_weights=None, expert_weights=None, refine=None,
                          **{key: FeatCalConfig.model_fields[key].get_default(call_default_factory=True) for key in FEATCAL_ONLY})
        else:
            update.update(merged=intermediate, reduction=None)
        stage = self.model_copy(update=update)
        searched = stage.tuned or stage.per_layer
        stage = stage.model_copy(update={"tune": self.tune if searched or self.holds_out else None})
        stage._holds_out_for_stack = self.holds_out
        stage._keeps_progress = index == 0 or self._keeps_progress  # the run's own, kept with --keep-layers
        return stage

    @property
    def balancing(self) -> str:
        """The `expert_weights:` the run uses: the recipe's, else coverage for FeatCal and equal for RegMean."""
        return self.expert_weights or ("equal" if self.regmean else "coverage")

    @property
    def token_weighting(self) -> str:
        """The `token_weights:` the run uses: the recipe's, else expert_lead for FeatCal and equal for RegMean."""
        return self.token_weights or ("equal" if self.regmean else "expert_lead")

    @property
    def trailing(self) -> str:
        """The `trailing_experts:` the run uses: the recipe's, else merge for FeatCal and keep for RegMean."""
        return self.trailing_experts or ("keep" if self.regmean else "merge")

    @property
    def teaching(self) -> str:
        """The `teachers:` the run uses: the recipe's, else best for FeatCal and own for RegMean."""
        return self.teachers or ("own" if self.regmean else "best")

    @property
    def merge_seed(self) -> int:
        """The seed mergekit's random merge methods draw with: merge_options.random_seed, else the block's seed."""
        return self.seed if self.merge_options.random_seed is None else self.merge_options.random_seed

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
        """Whether records are held out of the statistics: by a search, by the replay of one (per_layer values with `tune:`), or for `refine:`."""
        return self.tuned or (self.per_layer and self.tune is not None) or self._holds_out_for_stack or self.refine is not None

    @property
    def per_layer(self) -> bool:
        """Whether any hyper-parameter is given per layer (a tuned run's written winners)."""
        return any(isinstance(v, PerLayer) for v in self.hyper_values().values())

    def tune_settings(self) -> TuneSpec:
        return self.tune or TuneSpec()

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        try:
            return check_device(value, "device")
        except FeatCalError as error:
            raise ValueError(str(error).removeprefix("device: ")) from None


def check_device(value: str, where: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N`, as the recipe key and the `--device` option both take it."""
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise FeatCalError(f"{where}: expected auto, cpu, cuda or cuda:N, got {value!r}")
