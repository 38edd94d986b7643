"""mergekit's recipe schema (`mergekit.config.MergeConfiguration` and the models under it), without torch.

Importing `mergekit.config` imports torch, transformers and peft (5-8 s); `validate` must answer in
under a second. These are the same pydantic models, field for field: tests/test_mergekit_schema.py
compares their JSON schema with the installed mergekit's, so a mergekit upgrade that changes the
recipe format fails that test instead of letting `validate` and `run` drift apart. `run` still parses
the recipe with mergekit itself (io/recipe.py). mergekit's validators raise RuntimeError, which
pydantic does not catch; here they raise ValueError with the same text, so each becomes one problem
line with its key.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, model_serializer, model_validator

ScalarParameter = Union[bool, int, float, str]
ScalarOrGradient = Union[ScalarParameter, List[ScalarParameter]]


class ConditionalParameter(BaseModel):
    value: ScalarOrGradient
    filter: Optional[str] = None


ParameterSetting = Union[ConditionalParameter, List[ConditionalParameter], ScalarOrGradient]


class ModelPath(BaseModel, frozen=True):
    path: str
    revision: Optional[str] = None

    @model_validator(mode="before")
    def validate_string(cls, value):
        if isinstance(value, str):
            if value.count("@") > 1:
                raise ValueError(f"Invalid model path - multiple @: {value}")
            if "@" in value:
                path, revision = value.split("@")
                return {"path": path, "revision": revision}
            return {"path": value}
        return value

    def __str__(self) -> str:
        return f"{self.path}@{self.revision}" if self.revision else self.path


class ModelReference(BaseModel, frozen=True):
    """A reference to a language model.

    Can be a hf hub path (username/repo), or local. Optionally includes a LoRA."""

    model: ModelPath
    lora: Optional[ModelPath] = None
    override_architecture: Optional[str] = None

    @model_validator(mode="before")
    def validate_string(cls, value):
        if isinstance(value, str):
            chunks = value.split("+")
            if len(chunks) == 1:
                return {"model": value}
            if len(chunks) == 2:
                return {"model": chunks[0], "lora": chunks[1]}
            raise ValueError(f"Can't parse {value}")
        return value

    @model_serializer()
    def serialize(self):
        """As mergekit writes it: the string form, unless override_architecture (or a quote or space) needs the mapping."""
        if self.override_architecture is not None:
            return {"model": self.model, "lora": self.lora, "override_architecture": self.override_architecture}
        text = str(self)
        return self if '"' in text or " " in text else text

    def __str__(self) -> str:
        return f"{self.model}+{self.lora}" if self.lora else str(self.model)


class ModelTokenEmbedding(BaseModel, frozen=True):
    kind: Literal["model_token"]
    model: ModelReference
    token_id: Optional[int] = None
    token: Optional[str] = None

    @model_validator(mode="after")
    def validate_token(self):
        if self.token_id is None and self.token is None:
            raise ValueError("token_id or token must be specified")
        if self.token_id is not None and self.token is not None:
            raise ValueError("only one of token_id or token may be specified")
        return self


class ZeroEmbedding(BaseModel, frozen=True):
    kind: Literal["zero"]


class TokenEmbeddingConfig(BaseModel, frozen=True):
    source: Union[ModelTokenEmbedding, ZeroEmbedding, ModelReference, None] = None
    force: bool = False


class TokenizerConfig(BaseModel, frozen=True):
    source: Union[ModelReference, Literal["union"], Literal["base"]] = "union"
    tokens: Optional[Dict[str, TokenEmbeddingConfig]] = None
    pad_to_multiple_of: Optional[int] = None


class InputSliceDefinition(BaseModel):
    model: ModelReference
    layer_range: Tuple[int, int]
    parameters: Optional[Dict[str, ParameterSetting]] = None


class InputModelDefinition(BaseModel):
    model: ModelReference
    parameters: Optional[Dict[str, ParameterSetting]] = None


class OutputSliceDefinition(BaseModel):
    sources: List[InputSliceDefinition]
    base_model: Optional[ModelReference] = None
    residual_weight: Optional[float] = None
    parameters: Optional[Dict[str, ParameterSetting]] = None


class OutputModuleDefinition(BaseModel):
    slices: Optional[List[OutputSliceDefinition]] = None
    models: Optional[List[InputModelDefinition]] = None
    parameters: Optional[Dict[str, ParameterSetting]] = None

    @model_validator(mode="after")
    def validate_inputs(self):
        if ((not self.slices) and (not self.models)) or (self.slices and self.models):
            raise ValueError("Must specify either output slices or models to merge")
        return self


class MergeConfiguration(BaseModel):
    modules: Optional[Dict[str, OutputModuleDefinition]] = None
    slices: Optional[List[OutputSliceDefinition]] = None
    models: Optional[List[InputModelDefinition]] = None

    merge_method: str
    base_model: Optional[ModelReference] = None
    dtype: Optional[str] = None
    tokenizer_source: Union[Literal["union"], Literal["base"], ModelReference, None] = None
    tokenizer: Optional[TokenizerConfig] = None
    chat_template: Optional[str] = None
    out_dtype: Optional[str] = None
    parameters: Optional[Dict[str, ParameterSetting]] = None

    @model_validator(mode="after")
    def validate_inputs(self):
        if sum(bool(part) for part in (self.modules, self.slices, self.models)) != 1:
            raise ValueError("Exactly one of 'models', 'slices', or 'modules' must be present")
        return self

    @model_validator(mode="after")
    def validate_tokenizer(self):
        if self.tokenizer_source and self.tokenizer:
            raise ValueError("Cannot specify both tokenizer_source and tokenizer")
        return self


def merge_config_dict(config: BaseModel) -> dict:
    """``config.model_dump(mode="json", exclude_none=True)``, also where a model's path holds a space or a quote.

    mergekit's ``ModelReference`` serialises itself as itself there (its YAML writer's way of quoting), which pydantic
    refuses as a circular reference, so a recipe under a folder with a space in its name could not be compared or
    fingerprinted. Dumped in python mode, such a reference is left as the object; its string form is what it parses
    back from. Works for mergekit's own models and for this module's copy of them.
    """
    return _json_ready(config.model_dump(mode="python", exclude_none=True))


def _json_ready(node):
    if isinstance(node, BaseModel):  # only a model reference that declined to serialise itself is left as an object
        return str(node)
    if isinstance(node, dict):
        return {key: _json_ready(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_json_ready(item) for item in node]
    return node
