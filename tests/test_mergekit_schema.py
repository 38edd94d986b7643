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
