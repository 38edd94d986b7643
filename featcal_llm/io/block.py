"""The ``featcal:`` block of a recipe, as pydantic models: every key, its type, default and range.

Strict: an unknown or misspelled key is an error that names it. Reading a recipe file, the mergekit part and the
checks across both parts are in ``featcal_llm.io.recipe``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from featcal_llm.errors import FeatCalError

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
    """An expert writes its own calibration texts (featcal_llm/generation): from its BOS token, answering requests
    through its chat template, or continuing prompts.

    Defaults sample at temperature 0.7 with no top-p or top-k cut: calibration wants inputs on which the expert behaves
    as itself, and a cooler draw keeps a small expert's samples on its own kind of text (measured: a larger share of
    the merge's gap recovered than at temperature 1 for raw-text, chat-tuned and broad experts, docs/data-free.md);
    the samples that fall into repetition loops are dropped and drawn again.
    """

    model_config = ConfigDict(extra="forbid")

    samples: int | None = Field(None, ge=1, description="texts kept after filtering; default featcal.samples")
    max_new_tokens: int | None = Field(None, ge=1, description="default 512, at most featcal.max_length (calibration sees no token past it)")
    prompts: str | None = Field(None, description=".txt (one prompt per line) or .jsonl (field `prompt`); default: no prompts, the start set by chat_template")
    start: str | None = Field(None, description="without prompts: the token every sample begins with (default the tokenizer's BOS, else EOS)")
    temperature: float = Field(0.7, ge=0.0, description="0: greedy; 1: the expert's own distribution")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest set of tokens with this much probability (1: no cut)")
    min_p: float = Field(0.0, ge=0.0, lt=1.0, description="drop the tokens less likely than min_p × the most likely one's probability, after temperature (0: no cut)")
    seed: int | None = Field(None, description="default featcal.seed")
    chat_template: Literal["auto", "on", "off", "empty"] = Field(
        "auto", description="without prompts or start: on answers the shipped seed prompts, empty answers an empty request, off starts at BOS, auto measures which start shows the expert's own behaviour; with prompts: auto is on when the expert's tokenizer has a chat template"
    )
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
        if self.start is not None and self.chat_template in ("on", "empty"):
            raise ValueError(f"start begins raw samples; chat_template: {self.chat_template} answers requests (set chat_template: off)")
        if self.prompts is not None and self.chat_template == "empty":
            raise ValueError("chat_template: empty answers an empty request instead of prompts; with prompts, use on (or off)")
        return self


class DataSpec(BaseModel):
    """Where one expert's calibration texts come from (a dataset, or the expert itself) and how records become text."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="local .jsonl/.json/.parquet/.csv file, local dataset dir, or hub dataset id")
    generate: GenerateSpec | None = Field(None, description="instead of path: the expert samples its own texts")
    split: str = Field("train", description="dataset split (local dataset directories and hub datasets)")
    name: str | None = Field(None, description="dataset configuration name for load_dataset")
    format: Literal["text", "alpaca", "chat", "completion"] = Field("text", description="text: one field as is; alpaca: instruction/input/response in the Alpaca template; chat: the tokenizer's chat template; completion: prompt then completion, as is (TRL's standard prompt-completion records: string fields prompt and completion; its conversational form, lists of messages, is refused). With the last three, whether an expert leads the merge on its records (trailing_experts) is judged on the responses")
    text: str = Field("text", description="field holding the text (format: text)")
    instruction: str = Field("instruction", description="field holding the instruction (format: alpaca)")
    input: str | None = Field("input", description="field holding the optional input (format: alpaca); null: none")
    response: str = Field(default_factory=lambda data: "completion" if data.get("format") == "completion" else "response",
                          description="field holding the response (formats alpaca, chat and completion)",
                          json_schema_extra={"shown_default": "`completion` (format completion, TRL's name), else `response`"})
    prompt: str = Field("prompt", description="field holding the user turn or prompt (formats chat without messages, and completion)")
    messages: str | None = Field(None, description="field holding a list of chat messages (format: chat)")
    samples: int | None = Field(None, ge=1, description="overrides featcal.samples for this expert")
    weight: float = Field(1.0, ge=0, description="how much this expert counts in the re-fit, relative to the others (0: merged in, not calibrated toward)")

    def records(self, default: int) -> int:
        """How many calibration records this expert contributes (generated ones included); `default`: featcal.samples."""
        return (self.generate.samples if self.generate is not None else None) or self.samples or default

    @model_validator(mode="after")
    def _one_source(self) -> "DataSpec":
        if (self.path is None) == (self.generate is None):
            raise ValueError("expected either path (a dataset) or generate (the expert writes its own), not " + ("both" if self.path else "neither"))
        if self.generate is not None:
            given = [key for key in self.model_fields_set if key not in ("generate", "samples", "weight")]
            if given:
                raise ValueError(f"{given[0]} describes dataset records; with generate only samples and weight apply")
            if self.samples is not None and self.generate.samples is not None:
                raise ValueError("samples is given twice (here and under generate); keep one")
        return self


class PerLayer(BaseModel):
    """One value per decoder layer, as a tuned run writes its winners (`lambda: {per_layer: [...]}`): replayed, not searched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_layer: tuple[float, ...] = Field(description="one value per decoder layer, in layer order")


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
FEATCAL_ONLY = ("lambda_", "alpha", "rho", "norms", "biases", "head", "trailing_experts", "trailing_records")
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


class MergeOptionsSpec(BaseModel):
    """`merge_options:`: what `mergekit-yaml` takes as options, for the merge featcal-llm runs when `merged` is missing."""

    model_config = ConfigDict(extra="forbid")

    random_seed: int | None = Field(
        None, description="seed of the random merge methods (dare_ties, dare_linear, della, della_linear, arcee_fusion): default "
        "the block's seed, so a re-merge (after an edit, or from featcal_recipe.yml) gives the same weights; a deterministic merge "
        "(task_arithmetic, ties, breadcrumbs, linear, ...) is reused under any seed"
    )
    out_shard_size: int | str = Field("5B", description="parameters per output shard, as mergekit writes it (e.g. 5B, 500M)")
    lazy_unpickle: bool = Field(False, description="mergekit's lazy unpickler, for less memory with .bin inputs")

    @field_validator("out_shard_size")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        from featcal_llm.io.names import parse_parameter_count

        parse_parameter_count(value)  # raises ValueError with what is expected
        return value


class TuneSpec(BaseModel):
    """How `auto`/list hyper-parameters are chosen (featcal_llm/engine/tuning.py)."""

    model_config = ConfigDict(extra="forbid")

    holdout: float = Field(0.25, gt=0.0, lt=1.0, description="share of each expert's records kept aside for selection")
    budget: int = Field(12, ge=1, description="at most this many candidate settings evaluated per layer")
    criterion: Literal["output", "hidden"] = Field(
        "hidden", description="hidden: the layer output's relative drift to each expert, averaged over experts; output: each expert's next-token KL through the final norm and LM head, geometric mean over experts"
    )


class HeadSpec(BaseModel):
    """`head:`: after the last layer, the LM head is re-fitted by the same ridge rule on the final norm's outputs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    when: Literal["auto", "always"] = Field(
        "always", description="auto: only where an expert's LM head (or the input embedding it is tied to) is not the base's, "
        "as stored (bit for bit, or within one unit in the last place across dtypes); always: in every run",
        json_schema_extra={"shown_default": "`always` (`auto` when `head:` is not written)"},
    )
    lambda_: float = Field(1e-5, alias="lambda", gt=0, description="ridge strength of the head's re-fit")
    alpha: float = Field(1.0, ge=0, le=1, description="target input mix at the head (1: each expert's own logits)")
    rho: float = Field(0.5, description="anchor rho * merged head + (1 - rho) * base head")


class RefineSpec(BaseModel):
    """`refine:`: after the closed form, a few gradient steps toward each record's teacher (engine/refine.py, docs/refine.md).

    Label-free: KL(teacher ‖ model) on the tokens each expert is judged on; the held-out records choose the step count.
    """

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(40, ge=1, description="at most this many optimizer steps")
    lr: float | None = Field(None, gt=0, description="peak AdamW learning rate; default 1e-4 for params full, 3e-4 for adapter",
                             json_schema_extra={"shown_default": "1e-4 (full), 3e-4 (adapter)"})
    batch_records: int = Field(8, ge=1, description="records per optimizer step, drawn in a seeded order across every expert")
    eval_every: int = Field(5, ge=1, description="steps between held-out checks")
    patience: int = Field(2, ge=1, description="held-out checks without improvement before stopping")
    params: Literal["auto", "full", "adapter"] = Field(
        "auto", description="full: every parameter; adapter: a LoRA of `rank` on the calibrated projections (merged back "
        "into the weights) plus the norms, biases and LM head (with the embedding, when tied) in full; auto: full when the full AdamW state "
        "(16 bytes a parameter) fits a quarter of the device's memory, else adapter")
    rank: int = Field(16, ge=1, description="LoRA rank (params: adapter)")
    top_k: int = Field(64, ge=1, description="teacher tokens kept per position; the rest is one bin, so the KL stays exact over k + 1 bins")
    warmup: float = Field(0.1, ge=0.0, lt=1.0, description="share of the steps the learning rate warms up over, then a cosine down to a tenth of the peak")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients clipped to this global norm")
    precision: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="what the student computes in (master weights and AdamW's state stay float32; a float64 run "
        "refines in float64): bfloat16 autocast, or float32 throughout; auto: bfloat16 where the device computes it natively "
        "(a GPU with bf16, a CPU with AVX512-BF16 or AMX: 2-3x faster than float32 there), else float32")

    def learning_rate(self, params: str) -> float:
        """The peak learning rate for the resolved `params` (full or adapter)."""
        return self.lr if self.lr is not None else (1e-4 if params == "full" else 3e-4)


# keys and values renamed since they were published: refused with a one-line error that names the new one
RENAMED_KEYS = {"balance": "expert_weights"}
RENAMED_VALUES = {"token_weights": {"advantage": "expert_lead"}}


class FeatCalConfig(BaseModel):
    """The ``featcal:`` block. lambda, alpha and rho default to the paper's 3B settings; expert_weights and
    token_weights default to featcal-llm's own (coverage, expert_lead), the paper's being equal and equal."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    renamed_keys: ClassVar[dict[str, str]] = RENAMED_KEYS

    merged: str = Field(description="directory of the mergekit merge (written by the run when it does not exist)")
    output: str = Field(description="directory the calibrated checkpoint is written to")
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
    trailing_records: Literal["drop", "keep"] = Field(
        "drop", description="with token_weights: expert_lead, what a record weighs whose own expert predicts it worse than "
        "the merged model (its lead over the merge, summed over the record's judged tokens, is below 0) while the expert "
        "teaches its own records (it is not behind the merge beyond doubt, as trailing_experts judges): drop (the default): 0, as the expert knows nothing there that the merge lacks and "
        "pulling toward it could only pull the merge back on that text (a broad expert on the kind a narrow expert beside it "
        "knows better); keep: its tokens weigh as any other's (w = ½ + ½·a/mean(a))")
    max_length: int = Field(2048, ge=2, description="tokens per record; longer records are truncated")
    lambda_: Tunable = Field(1e-5, alias="lambda", description="ridge strength of the re-fit (> 0); a number, a list of candidates, auto, or {per_layer: [...]}")
    alpha: Tunable = Field(0.15, description="target input mix: alpha times the expert's input plus (1 - alpha) times the calibrated model's (0 to 1); tunable like lambda")
    rho: Tunable = Field(0.5, description="ridge anchor rho * merged + (1 - rho) * base (any real; above 1 extrapolates past the merge); tunable like lambda")
    tune: TuneSpec | None = Field(None, description="how auto or candidate-list hyper-parameters are chosen (see tune:)")
    eps: float = Field(1e-8, gt=0, description="floor of each task's Gram norm in its weight 1 / max(norm, eps), also added to the ridge")
    shuffle: bool = Field(False, description="shuffle each expert's records (with seed) before taking the first samples")
    seed: int = Field(0, description="seed of the shuffle, the held-out split and generation")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N (auto: cuda when available)")
    dtype: Literal["auto", "float64", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype of the layers; auto: bfloat16 on GPUs, on CPUs bfloat16 where the CPU has bf16 units, else float32"
    )
    stats_dtype: Literal["auto", "float32", "float64"] = Field(
        "auto", description="precision of the statistics products (summed in float64); auto: float32 when every lambda the run uses is >= 1e-2, else float64 (float32 with a warning on GPUs without fast float64)"
    )
    host_memory_gb: float | None = Field(
        None, gt=0, description="RAM for hidden-state streams before they spill to memory-mapped files; default half the machine"
    )
    batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward batch")
    modules: list[str] | None = Field(None, description="restrict calibration to these projections, e.g. [q_proj, down_proj]")
    norms: bool = Field(False, description="also update RMSNorm scales")
    head: HeadSpec | None = Field(
        default_factory=lambda: HeadSpec(when="auto"), description="also re-fit the LM head after the last layer: auto "
        "(re-fit it where an expert's LM head, or the input embedding it is tied to, is not the base's), true (always), "
        "false (never), or a mapping (see head:); a head tied to the input embeddings becomes a tensor of its own "
        "(config tie_word_embeddings: false)", json_schema_extra={"shown_default": "`auto`"},
    )
    biases: bool = Field(True, description="update biases of projections that have one")
    tokenizer: str | None = Field(None, description="tokenizer source; default: the merged model's")
    merge_options: MergeOptionsSpec = Field(default_factory=MergeOptionsSpec, description="mergekit's options for the merge the run makes (see merge_options:)")
    trust_remote_code: bool = Field(False, description="let transformers run the model repository's own code")
    license: str | None = Field(
        None, description="the model card's license, a Hub license id (apache-2.0, llama3.2, other, ...); default: the base "
        "model's, when its card is on this machine (a local base, or a hub base already downloaded)"
    )
    eval: EvalSection | None = Field(None, description="score the merged and calibrated models after the run (see eval:)")  # type: ignore[valid-type]
    refine: RefineSpec | None = Field(
        None, description="after the closed form, a few gradient steps toward each record's teacher on the calibration records, "
        "stopped by the held-out records (see refine:): false (default), true (its defaults) or a mapping",
        json_schema_extra={"shown_default": "`false`"},
    )
    # A stack's RegMean stage holds out the records its FeatCal stage holds out (set by `stage`, never by a recipe)
    _holds_out_for_stack: bool = PrivateAttr(False)

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
        if value is True:
            return {}
        if value is False:
            return None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"expected true, false or a mapping {{steps, lr, params, ...}}, got {value!r}")
        return value

    @field_validator("head", mode="before")
    @classmethod
    def _head(cls, value: Any) -> Any:
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
            raise ValueError(f"expected one of {', '.join(METHODS)}, or a stack [regmean++, featcal]")
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
