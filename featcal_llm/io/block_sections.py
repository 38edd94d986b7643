"""The nested sections of the ``featcal:`` block (data per expert and its `generate:`, `merge_options:`, `tune:`,
`head:`, `refine:`), as strict pydantic models; the block itself, its tunable hyper-parameters and the checks across
keys are in ``featcal_llm.io.block``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from featcal_llm.io.recipe_model import RecipeModel

SEED_MAX = 2**32 - 1  # numpy's and mergekit's set_seed take no other seed
MAX_TOKENS = 1 << 24  # a record or sample longer than any context window; beyond int64 the tokenizer overflows


class GenerateSpec(RecipeModel):
    """An expert writes its own calibration texts (featcal_llm/generation): from its BOS token, answering requests
    through its chat template, or continuing prompts.

    Defaults sample at temperature 0.7 with no top-p or top-k cut: calibration wants inputs on which the expert behaves
    as itself, and a cooler draw keeps a small expert's samples on its own kind of text (measured: a larger share of
    the merge's gap recovered than at temperature 1 for raw-text, chat-tuned and broad experts, docs/data-free.md);
    the samples that fall into repetition loops are dropped and drawn again.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    samples: int | None = Field(None, ge=1, description="texts kept after filtering; default the data entry's samples (beside generate), else featcal.samples")
    max_new_tokens: int | None = Field(None, ge=1, description="default min(512, featcal.max_length); calibration sees no token past featcal.max_length, so a larger value only costs time")
    prompts: str | None = Field(None, min_length=1, description=".txt (one prompt per line) or .jsonl (field `prompt`); default: no prompts, the start set by chat_template")
    start: str | None = Field(None, description="without prompts: the token every sample begins with (default the tokenizer's BOS, else the config's bos_token_id, else EOS)")
    temperature: float = Field(0.7, ge=0.0, description="0: greedy; 1: the expert's own distribution; between 0 and 0.01 samples at 0.01, as vLLM does")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest set of tokens with this much probability (1: no cut)")
    min_p: float = Field(0.0, ge=0.0, lt=1.0, description="drop the tokens less likely than min_p × the most likely one's probability, after temperature (0: no cut)")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="default featcal.seed")
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


class DataSpec(RecipeModel):
    """Where one expert's calibration texts come from (a dataset, or the expert itself) and how records become text."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str | None = Field(None, min_length=1, description="local .jsonl/.json/.parquet/.csv file, local dataset dir (data files, or a folder datasets' save_to_disk wrote), or hub dataset id")
    generate: GenerateSpec | None = Field(None, description="instead of path: the expert samples its own texts")
    split: str = Field("train", description="dataset split (local dataset directories and hub datasets)")
    name: str | None = Field(None, description="dataset configuration name for load_dataset")
    format: Literal["text", "alpaca", "chat", "completion"] = Field("text", description="text: one field as is; alpaca: instruction/input/response in the Alpaca template; chat: the tokenizer's chat template, its output tokenised as is (no special token added, as `apply_chat_template(tokenize=True)` does); completion: prompt then completion, as is (TRL's standard prompt-completion records: string fields prompt and completion; its conversational form, lists of messages, is refused). With the last three, whether an expert leads the merge on its records (trailing_experts) is judged on the responses (a conversation's: every assistant turn, not the system and user turns between them, as TRL's assistant_only_loss; one with no assistant turn: every token)")
    text: str = Field("text", description="field holding the text (format: text)")
    instruction: str = Field("instruction", description="field holding the instruction (format: alpaca)")
    input: str | None = Field("input", description="field holding the optional input (format: alpaca); null: none")
    response: str = Field(default_factory=lambda data: "completion" if data.get("format") == "completion" else "response",
                          description="field holding the response (formats alpaca, chat and completion)",
                          json_schema_extra={"shown_default": "`completion` (format completion, TRL's name), else `response` "
                                             "(format alpaca: `output`, Stanford Alpaca's name, where the records have an `output` field and no `response`)"})
    prompt: str = Field("prompt", description="field holding the user turn or prompt (formats chat without messages, and completion)")
    messages: str | None = Field(None, description="field holding a list of chat messages (format: chat)",
                                 json_schema_extra={"shown_default": "null; with format chat and none of messages, prompt and response "
                                                    "set: `messages` where the records have a `messages` field but not both prompt and response"})
    samples: int | None = Field(None, ge=1, description="overrides featcal.samples for this expert")
    weight: float = Field(1.0, ge=0, description="how much this expert counts in the re-fit: it multiplies the expert's ω against the others' and against "
                          "the ridge λ, which stays as set, so scaling every weight alike leans the fit from the anchor (×10) or "
                          "to it (÷10); 0: merged in, not calibrated toward")

    @field_validator("generate", mode="before")
    @classmethod
    def _bare_generate(cls, value: Any) -> Any:
        """`generate:` written bare (YAML null) is `generate: {}`: the expert writes with the defaults."""
        return {} if value is None else value

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


class MergeOptionsSpec(RecipeModel):
    """`merge_options:`: what `mergekit-yaml` takes as options, for the merge featcal-llm runs when `merged` is missing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    random_seed: int | None = Field(
        None, ge=0, le=SEED_MAX, description="seed of the random merge methods (dare_ties, dare_linear, della, della_linear, arcee_fusion): default "
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


class TuneSpec(RecipeModel):
    """How `auto`/list hyper-parameters are chosen (featcal_llm/engine/tuning.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    holdout: float = Field(0.25, gt=0.0, lt=1.0, description="share of each expert's records kept aside for selection (and for refine's stopping: with refine and fixed values, the one tune key that applies); drawn by featcal.seed and the expert's position in the recipe, so moving the experts' folders does not change it")
    budget: int = Field(12, ge=1, description="at most this many candidate settings evaluated per layer (in a stack, by each stage)")
    criterion: Literal["output", "hidden"] = Field(
        "hidden", description="hidden: the layer output's relative drift to each expert, averaged over experts; output: each expert's next-token KL through the final norm and LM head, geometric mean over experts"
    )


class HeadSpec(RecipeModel):
    """`head:`: after the last layer, the LM head is re-fitted by the same ridge rule on the final norm's outputs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    when: Literal["auto", "always"] = Field(
        "always", description="auto: only where an expert's LM head (or the input embedding it is tied to) is not the base's, "
        "as stored (bit for bit, or within one unit in the last place across dtypes); always: in every run",
        json_schema_extra={"shown_default": "`always` (`auto` when `head:` is not written)"},
    )
    lambda_: float = Field(1e-5, alias="lambda", gt=0, description="ridge strength of the head's re-fit")
    alpha: float = Field(1.0, ge=0, le=1, description="target input mix at the head (1: each expert's own logits)")
    rho: float = Field(0.5, ge=-100, le=100, description="anchor rho * merged head + (1 - rho) * base head (-100 to 100, as featcal.rho)")


# bounds far above any use, for a clear line instead of a run that cannot end (at 8B a step of 8 records takes about
# 10 s: 100,000 of them, eleven days)
MAX_REFINE_STEPS = 100_000
MAX_BATCH_RECORDS = 65_536


class RefineSpec(RecipeModel):
    """`refine:`: after the closed form, a few gradient steps toward each record's teacher (engine/refine.py, docs/refine.md).

    Label-free: KL(teacher ‖ model) on the tokens each expert is judged on; the held-out records choose the step count.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    steps: int = Field(40, ge=1, le=MAX_REFINE_STEPS, description="at most this many optimizer steps (the held-out records may stop it sooner); "
                       "a small model can gain from more at as much more time (a 135M model on a CPU: 160 steps 0.87 of "
                       "the gap against 40's 0.84), while 40 already take 6-7 minutes at 8B on one H200")
    lr: float | None = Field(None, gt=0, le=1, description="peak AdamW learning rate (at most 1: past it every step diverges); default 1e-4 for params full, 3e-4 for adapter",
                             json_schema_extra={"shown_default": "1e-4 (full), 3e-4 (adapter)"})
    batch_records: int = Field(8, ge=1, le=MAX_BATCH_RECORDS, description="records per optimizer step, drawn in a seeded order across every expert")
    eval_every: int = Field(5, ge=1, description="steps between held-out checks")
    patience: int = Field(2, ge=1, description="held-out checks without improvement before stopping")
    params: Literal["auto", "full", "adapter"] = Field(
        "auto", description="full: every parameter; adapter: a LoRA of `rank` on the calibrated projections (merged back "
        "into the weights) plus the norms, biases and LM head (with the embedding, when tied) in full; auto: full when the full AdamW state "
        "(16 bytes a parameter) fits a quarter of the device's memory, else adapter")
    rank: int = Field(16, ge=1, description="LoRA rank (params: adapter)")
    top_k: int = Field(64, ge=1, description="teacher tokens kept per position; the rest is one bin, so the KL stays exact over k + 1 bins; "
                       "1,024 gained nothing at 40 steps and 0.02 of the gap at 160 on a small model, for 16× the teachers' "
                       "store on the host (9.7 GB at Llama-3.1-8B with 3 × 256 × 2048 tokens)")
    warmup: float = Field(0.1, ge=0.0, lt=1.0, description="share of the steps the learning rate warms up over, then a cosine down to a tenth of the peak")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients clipped to this global norm")
    precision: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="what the student computes in (master weights and AdamW's state stay float32; a float64 run "
        "refines in float64): bfloat16 autocast, or float32 throughout; auto: bfloat16 where the device computes it natively "
        "(a GPU with bf16, a CPU with AVX512-BF16 or AMX: 2-3x faster than float32 there), else float32")
    gradient_checkpointing: Literal["auto", True, False] = Field(
        "auto", description="recompute each decoder layer (and each chunk of logits) in the backward pass instead of "
        "keeping its activations; auto: off when the stage's peak without it fits half the device's memory (a small model "
        "on a CPU: 5-20% less time a step), else on (8B on one GPU)")

    @field_validator("rank")
    @classmethod
    def _rank_is_the_adapter_s(cls, rank: int, info: ValidationInfo) -> int:
        if info.data.get("params") == "full":  # a rank written beside params: full was ignored without a word
            raise ValueError("rank applies to params: adapter (or auto, which may choose it); params: full trains every weight")
        return rank

    def learning_rate(self, params: str) -> float:
        """The peak learning rate for the resolved `params` (full or adapter)."""
        return self.lr if self.lr is not None else (1e-4 if params == "full" else 3e-4)


__all__ = ["DataSpec", "GenerateSpec", "HeadSpec", "MergeOptionsSpec", "RefineSpec", "TuneSpec"]
