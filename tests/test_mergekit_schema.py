"""The torch-free copy of mergekit's recipe schema and the shipped table of merge methods are mergekit's own (issue 56).

`validate` checks the mergekit part from these without importing mergekit (which imports torch: seconds);
they are regenerated from the installed mergekit here, so an upgrade that changes either fails this file.
"""

from __future__ import annotations

import json

import pytest

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


TENSORS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
           "model.norm.weight", "lm_head.weight")
COVERAGE_SETTINGS = [
    0.5, [0.1, 0.2], [0.1, 0.2, 0.4], [], {"filter": "mlp", "value": 0.3}, [{"filter": "mlp", "value": 0.3}],
    [{"filter": "mlp", "value": 0.3}, {"value": 0.5}], [{"value": 0.5}, {"filter": "mlp", "value": 0.3}],
    [{"filter": "mlp", "value": 0.3}, {"filter": "self_attn", "value": [0.1, 0.2]}, {"value": [0.5, 0.6]}],
    {"value": 0.5}, [{"filter": "mlp", "value": [0.1, 0.2]}],
]


@pytest.mark.parametrize("setting", COVERAGE_SETTINGS, ids=str)
def test_covers_every_tensor_is_whether_mergekit_finds_a_value_for_each_tensor(setting):
    """mergekit's own lookup (config.evaluate_setting: first entry whose filter matches, None where none does), for
    tensors some filters match and some none does: a value for each of them exactly where covers_every_tensor says so."""
    from mergekit.config import MergeConfiguration, evaluate_setting

    config = MergeConfiguration.model_validate({"merge_method": "linear", "models": [
        {"model": "expert", "parameters": {"weight": setting}}]})
    parsed = config.models[0].parameters["weight"]
    for t in (0.0, 0.5, 1.0):
        found = [evaluate_setting(name, parsed, t, validate=float) for name in TENSORS]
        assert mergekit_methods.covers_every_tensor(parsed) == all(value is not None for value in found), (setting, found)


@pytest.mark.parametrize("setting", [{"filter": "*", "value": 0.3}, [{"filter": "mlp", "value": 0.1}, {"filter": "*", "value": 0.3}],
                                     [{"filter": "", "value": 0.3}]], ids=str)
def test_a_filter_mergekit_matches_to_every_tensor_covers_every_tensor(setting):
    test_covers_every_tensor_is_whether_mergekit_finds_a_value_for_each_tensor(setting)


def _slices(method: str, sources: list[dict], slice_parameters: dict | None = None, base: str | None = "base") -> object:
    from mergekit.config import MergeConfiguration

    return MergeConfiguration.model_validate({
        "merge_method": method, **({"base_model": base} if base else {}),
        "slices": [{"sources": [{"layer_range": [0, 2], **source} for source in sources],
                    **({"parameters": slice_parameters} if slice_parameters else {})}]})


def test_slice_sources_read_their_own_then_the_slice_s_parameters():
    """A source's parameters, then its slice's, then the top level (mergekit's order): a weight given at either of the
    first two is given; the base, not among the sources, is merged by linear with the slice's."""
    assert mergekit_methods.parameter_problems(_slices("task_arithmetic", [
        {"model": "base"}, {"model": "e1", "parameters": {"weight": 0.5}}, {"model": "e2", "parameters": {"weight": 0.3}}]), "r") == []
    assert mergekit_methods.parameter_problems(_slices("linear", [
        {"model": "e1", "parameters": {"weight": 0.5}}, {"model": "e2"}], {"weight": 0.3}), "r") == []
    inputs = mergekit_methods.merge_inputs(_slices("linear", [{"model": "e1"}], {"weight": 0.3}))
    assert [(key, str(reference), [site for site, _ in chain]) for key, reference, chain in inputs] == [
        ("slices.0.sources.0", "e1", ["slices.0.sources.0.parameters", "slices.0.parameters", "parameters"]),
        ("base_model", "base", ["slices.0.parameters", "parameters"])]


def test_a_base_outside_the_slice_sources_needs_linear_s_weight_too():
    """mergekit's planner adds the base model to each slice's inputs (linear then needs its weight: "Missing required
    parameter weight", as for the models: form, tests/test_validate_agrees.py)."""
    problems = mergekit_methods.parameter_problems(_slices("linear", [
        {"model": "e1", "parameters": {"weight": 0.5}}, {"model": "e2", "parameters": {"weight": 0.5}}]), "r")
    assert [problem.key for problem in problems] == ["parameters"] and "for the base model too" in problems[0].message


def test_a_base_listed_among_the_models_is_one_input_of_the_merge():
    """mergekit refuses "Duplicate merge inputs": the base listed under models: is that input, with its own parameters,
    and nothing asks for a weight for it a second time."""
    from mergekit.config import MergeConfiguration

    config = MergeConfiguration.model_validate({"merge_method": "linear", "base_model": "base", "models": [
        {"model": "base", "parameters": {"weight": 0.2}}, {"model": "e1", "parameters": {"weight": 0.8}}]})
    references = [str(reference) for _, reference, _ in mergekit_methods.merge_inputs(config)]
    assert sorted(references) == ["base", "e1"]
    assert mergekit_methods.parameter_problems(config, "r") == []


def test_a_filtered_model_weight_falls_back_to_the_top_level_for_the_tensors_it_leaves():
    """Per tensor, mergekit takes the first level (model, then top) whose setting gives it a value: filtered entries at
    the model and a plain top-level weight leave no tensor without one, so nothing is missing."""
    from mergekit.config import MergeConfiguration, evaluate_setting

    config = MergeConfiguration.model_validate({"merge_method": "task_arithmetic", "base_model": "base", "parameters": {"weight": 0.5},
                                                "models": [{"model": "e1", "parameters": {"weight": [{"filter": "mlp", "value": 0.3}]}}]})
    levels = [config.models[0].parameters["weight"], config.parameters["weight"]]
    for name in TENSORS:
        assert next(v for v in (evaluate_setting(name, level, validate=float) for level in levels) if v is not None) is not None
    assert evaluate_setting("lm_head.weight", levels[0], validate=float) is None  # the model level alone leaves it
    assert mergekit_methods.parameter_problems(config, "r") == []


def test_the_largest_value_is_the_bound_the_message_states():
    """`a finite number between -1000000 and 1000000`: the bounds pass (mergekit merges them finite), the next float
    past either does not, nor do inf and NaN."""
    import math

    schema = {"type": "number"}
    bound = mergekit_methods.LARGEST_VALUE
    for value in (bound, -bound, int(bound), 0.5, 0):
        assert mergekit_methods._bad_value(schema, value) is None, value
    for value in (math.nextafter(bound, math.inf), -math.nextafter(bound, math.inf), int(bound) + 1, 1.5e6, math.inf, math.nan):
        refused = mergekit_methods._bad_value(schema, value)
        assert refused is not None and refused[1] == "a finite number between -1000000 and 1000000", value


@pytest.mark.parametrize("setting, refused", [
    ({"filter": "mlp", "value": 0.3}, False), ([{"filter": "mlp", "value": [0.1, 0.2]}, {"value": 0.5}], False),
    ({"filter": "mlp", "value": float("nan")}, True), ([{"filter": "mlp", "value": 0.3}, {"value": [0.1, 1e300]}], True),
], ids=str)
def test_the_values_inside_a_conditional_setting_are_judged_as_mergekit_reads_them(setting, refused):
    """What mergekit reads for a tensor (config.evaluate_setting) out of filtered entries and gradients: a value past the
    finite range anywhere inside is refused, a conditional of plain numbers is not."""
    import math

    from mergekit.config import MergeConfiguration, evaluate_setting

    config = MergeConfiguration.model_validate({"merge_method": "linear", "models": [{"model": "e", "parameters": {"weight": setting}}]})
    parsed = config.models[0].parameters["weight"]
    read = [evaluate_setting(name, parsed, t, validate=float) for name in TENSORS for t in (0.0, 1.0)]
    assert any(v is not None and not (math.isfinite(v) and abs(v) <= 1e6) for v in read) == refused
    assert (mergekit_methods._bad_value({"type": "number"}, parsed) is not None) == refused
