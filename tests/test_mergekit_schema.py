"""The torch-free copy of mergekit's recipe schema and the shipped table of merge methods are mergekit's own (issue 56).

`validate` checks the mergekit part from these without importing mergekit (which imports torch: seconds);
they are regenerated from the installed mergekit here, so an upgrade that changes either fails this file.
"""

from __future__ import annotations

import json

from featcal_llm.io import mergekit_config, mergekit_methods


def test_the_recipe_schema_is_mergekits():
    from mergekit.config import MergeConfiguration

    assert mergekit_config.MergeConfiguration.model_json_schema() == MergeConfiguration.model_json_schema()


def test_the_shipped_method_table_is_regenerated_from_the_installed_mergekit():
    shipped = json.loads(mergekit_methods.SCHEMA_FILE.read_text(encoding="utf-8"))
    assert shipped == mergekit_methods.generate(), "regenerate: python -m featcal_llm.io.mergekit_methods > featcal_llm/io/mergekit_methods.json"


def test_featcal_llm_has_a_word_for_every_mergekit_method():
    from featcal_llm.io.forms import MERGE_METHODS

    assert set(MERGE_METHODS) == set(mergekit_methods.methods())


def test_parameter_values_are_judged_as_mergekit_judges_them():
    """mergekit validates each value with pydantic's lax rules (`"1e-3"` is a number, `"x"` is not); so does the table."""
    from mergekit.merge_methods.registry import get
    from pydantic import ValidationError

    table = mergekit_methods.methods()
    for method in ("task_arithmetic", "karcher", "passthrough", "nuslerp"):
        for parameter in get(method).spec.parameters:
            schema = table[method]["parameters"][parameter.name]["type"]
            for value in (0.5, 3, True, "1e-3", "x", None, "true"):
                try:
                    parameter.validate(value)
                    refused = False
                except ValidationError:
                    refused = True
                assert (mergekit_methods._bad_value(schema, value) is not None) == refused, (method, parameter.name, value)


RECIPES_TO_DUMP = [
    {"merge_method": "task_arithmetic", "base_model": "base", "models": [{"model": "e0", "parameters": {"weight": 0.5}}], "dtype": "float32"},
    {"merge_method": "linear", "tokenizer_source": "base",
     "slices": [{"sources": [{"model": "a+lora", "layer_range": [0, 2], "parameters": {"weight": 0.5}}, {"model": "x@main", "layer_range": [0, 2]}]}]},
    {"merge_method": "ties", "base_model": {"model": {"path": "b", "revision": "r"}, "override_architecture": "LlamaForCausalLM"},
     "models": [{"model": "e", "parameters": {"weight": [0.1, 0.2], "density": {"value": 0.5, "filter": "mlp"}}}],
     "parameters": {"normalize": True}, "tokenizer": {"source": "base"}},
]


def _with_spaces(raw: dict) -> dict:
    """The same recipe with every model path under a folder whose name holds a space."""
    def move(node):
        if isinstance(node, dict):
            return {k: ("/my models/" + v if k in ("model", "base_model", "path") and isinstance(v, str) else move(v)) for k, v in node.items()}
        return [move(item) for item in node] if isinstance(node, list) else node
    return move(raw)


def test_merge_config_dict_is_mergekits_dump_and_also_takes_paths_with_spaces():
    """Where mergekit's own dump works, merge_config_dict is that dump; under a folder with a space in its name, where
    mergekit's ModelReference refuses to serialise itself, it still gives a dict that parses back to the same recipe."""
    from mergekit.config import MergeConfiguration

    for raw in RECIPES_TO_DUMP:
        for schema in (MergeConfiguration, mergekit_config.MergeConfiguration):
            config = schema.model_validate(raw)
            assert mergekit_config.merge_config_dict(config) == config.model_dump(mode="json", exclude_none=True)
            spaced = schema.model_validate(_with_spaces(raw))
            dumped = mergekit_config.merge_config_dict(spaced)
            assert json.loads(json.dumps(dumped)) == dumped  # plain JSON: fingerprints take it
            assert schema.model_validate(dumped) == spaced
            assert "/my models/" in json.dumps(dumped)


def test_the_dtypes_validate_accepts_are_those_mergekit_merges_in(tmp_path):
    """mergekit names its dtypes in dtype_from_name; any other one (`fp8`) had passed validate and failed the merge."""
    import pytest
    from mergekit.common import dtype_from_name

    from featcal_llm.io.merge_settings import MERGEKIT_DTYPES

    for name in MERGEKIT_DTYPES:
        assert dtype_from_name(name) is not None and dtype_from_name(f"torch.{name}") == dtype_from_name(name)
    for name in ("fp8", "float8_e4m3fn", "int8", "bf16"):
        with pytest.raises(RuntimeError, match="Unimplemented dtype"):
            dtype_from_name(name)
