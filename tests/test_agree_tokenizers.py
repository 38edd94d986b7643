"""validate and run agree on tokenizers and chat templates: the vocabulary read as the tokenizer reads it, tokens
tokenizer_config.json adds left to run, a tokenizer block that pads the vocabulary, configs that are not JSON,
templates that do not parse, and an expert tokenizer of other ids."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from agreement import (error_lines, expert_of, recipe_of,
                       refused_alike)


def test_transformers_generation_tag_is_a_chat_template_validate_accepts():
    """`{% generation %}` (transformers' assistant-mask tag) parses in transformers' own environment, and in validate's."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from featcal_llm.io.merge_settings import chat_template_problem

    template = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}{% endfor %}"
    _compile_jinja_template(template)
    assert chat_template_problem(template) is None
    assert chat_template_problem(template.replace("{% endgeneration %}", "")).startswith("not a Jinja template")


def test_the_vocabulary_is_read_as_the_tokenizer_reads_it(scenario):
    """vocabulary_has against the loaded tokenizer's own lookup, for every token and an added one."""
    from transformers import AutoTokenizer

    from featcal_llm.io.model_files import vocabulary_has

    tokenizer = AutoTokenizer.from_pretrained(scenario.base)
    for token in [*tokenizer.get_vocab(), tokenizer.eos_token, "<nope>", "zz"]:
        known = tokenizer.convert_tokens_to_ids(token) not in (None, tokenizer.unk_token_id) or token == tokenizer.unk_token
        assert vocabulary_has(Path(scenario.base), token) is known, token


@pytest.mark.parametrize("key, value, token", [("extra_special_tokens", ["<x>"], "<x>"), ("additional_special_tokens", ["<y>"], "<y>"),
                                               ("extra_special_tokens", {"image_token": "<img>"}, "<img>")])
def test_a_token_the_tokenizer_config_adds_is_left_to_run(scenario, tmp_path, key, value, token):
    """A token tokenizer_config.json names but tokenizer.json lacks: transformers adds it as it loads, with an id past
    the vocabulary's. Validate had refused it as absent; whether the expert's embedding has that row is run's to tell
    (`start_token` against the config's vocab_size), so validate says it cannot (None: a note)."""
    import json

    from transformers import AutoTokenizer

    from featcal_llm.io.model_files import vocabulary_has

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(scenario.base) / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, key: value}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.convert_tokens_to_ids(token) == len(tokenizer) - 1 != tokenizer.unk_token_id
    assert vocabulary_has(tmp_path, token) is None and vocabulary_has(tmp_path, "<absent>") is False
    assert vocabulary_has(tmp_path, tokenizer.eos_token) is True
    from types import SimpleNamespace

    from featcal_llm.errors import FeatCalError
    from featcal_llm.generation.prompts import start_token

    with pytest.raises(FeatCalError) as error:  # the scenario's embedding has 100 rows, the added token id 100
        start_token(tokenizer, SimpleNamespace(vocab_size=len(tokenizer) - 1), token, "r.yaml: featcal.data.e.generate")
    assert str(error.value) == (f"r.yaml: featcal.data.e.generate.start: {token!r} is token {len(tokenizer) - 1}, past the "
                                f"expert's {len(tokenizer) - 1} embedding rows (its tokenizer adds it on loading); name a "
                                "token the expert was trained with")
    assert start_token(tokenizer, SimpleNamespace(vocab_size=len(tokenizer)), token) == len(tokenizer) - 1  # a padded embedding has it


def test_a_tokenizer_block_that_pads_the_vocabulary_is_refused_before_the_merge(scenario, tmp_path):
    """`tokenizer: {source: base, pad_to_multiple_of: 64}`: the merge's vocabulary is the base's padded (100 -> 128 rows),
    known without merging (mergekit's own tokenizer builder). Validate had passed it; run merged, then refused every
    expert's 100 rows."""
    recipe = recipe_of(scenario, tmp_path)
    recipe["tokenizer"] = {"source": "base", "pad_to_multiple_of": 64}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    ran = CliRunner().invoke(main, ["run", str(path)])
    assert validated.exit_code == ran.exit_code == 2 and error_lines(ran) == error_lines(validated), (validated.output, ran.output)
    assert len(error_lines(ran)) == 3 and "Building tokenizer" not in ran.stderr  # one line per expert; mergekit's bar unshown
    for line in error_lines(ran):
        assert ("vocabulary of 100 rows, the merge mergekit makes (its tokenizer's vocabulary from tokenizer source base, "
                "padded to a multiple of 64) has 128") in line
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.merging").exists()


def test_a_tokenizer_config_that_is_not_json_is_refused_alike(scenario, tmp_path):
    """The base's tokenizer_config.json cut short (`{oops`): validate reads that file (its chat template, its tokens) and
    had passed the recipe, swallowing the JSON error; run refused it in one line ("cannot load a tokenizer")."""
    recipe = recipe_of(scenario, tmp_path)
    base = tmp_path / "base"
    shutil.copytree(recipe["base_model"], base, copy_function=os.symlink)
    (base / "tokenizer_config.json").unlink()
    (base / "tokenizer_config.json").write_text("{oops")
    recipe["base_model"] = str(base)
    refused_alike(recipe, tmp_path)
    assert not (tmp_path / "merged").exists()


def test_a_tokenizer_chat_template_that_does_not_parse_is_refused_alike(scenario, tmp_path):
    """Chat records and a base whose chat_template.jinja does not parse (an unclosed for): validate, which parsed only
    a mergekit `chat_template:` with transformers' Jinja environment, had passed it; run refused record 0 ("the
    tokenizer's chat template refused it (Unexpected end of template ...)"). Now one line for the entry, from both."""
    recipe = recipe_of(scenario, tmp_path)
    base = tmp_path / "base"
    shutil.copytree(recipe["base_model"], base, copy_function=os.symlink)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    (base / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    recipe["base_model"] = str(base)
    turns = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo, fine"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(8)))
    recipe["featcal"]["data"][expert_of(recipe, 0)] = {"path": str(tmp_path / "chat.jsonl"), "format": "chat", "messages": "messages"}
    [line] = refused_alike(recipe, tmp_path)
    assert line.endswith(f"featcal.data.{expert_of(recipe, 0)}.format: chat: the tokenizer's chat template does not parse "
                         "(line 1: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'. "
                         "The innermost block that needs to be closed is 'for'.)"), line
    assert not (tmp_path / "merged").exists()
    (base / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert CliRunner().invoke(main, ["validate", str(tmp_path / "r.yaml")]).exit_code == 0  # transformers' own tag parses


CHAT_TEMPLATES = [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{% for m in messages %}\n{% generation %}\n{{ m.content }}\n{% endfor %}",
    "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}\n{{ 'x' }",
    "{% for m in messages %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "line one\nline two\n{% for m in messages %}{{ m.content }}",
    "{% set x = namespace(a=1) %}{% do x %}",
]


@pytest.mark.parametrize("template", CHAT_TEMPLATES)
def test_a_chat_template_parses_exactly_where_transformers_compiles_it(template):
    """transformers' own chat-template compiler (its sandbox, loop controls and `{% generation %}` tag) against
    chat_template_syntax_error: None where it compiles, else its line and words."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from featcal_llm.io.model_files import chat_template_syntax_error

    try:
        _compile_jinja_template(template)
        expected = None
    except jinja2.TemplateSyntaxError as error:
        expected = f"line {error.lineno}: {error.message}"
    assert chat_template_syntax_error(template) == expected


def test_an_expert_tokenizer_of_other_ids_is_refused_by_validate_as_run_refuses_it(scenario, tmp_path):
    """An expert whose tokenizer.json gives its tokens other ids (the same tokens, class and special tokens, in another
    order): validate read it from the files as run reads it from the loaded tokenizers, and names the same token: the
    calibration token of lowest id that the expert's tokenizer gives another id. Before, validate said ok and run
    refused it, naming whichever token the loaded vocabulary listed first."""
    from transformers import AutoTokenizer

    from agreement import expert_of_other_token_ids

    recipe = recipe_of(scenario, tmp_path)
    alien = expert_of_other_token_ids(recipe, 0, tmp_path / "alien")
    calibrating = Path(recipe["base_model"])
    ours, theirs = AutoTokenizer.from_pretrained(calibrating).get_vocab(), AutoTokenizer.from_pretrained(alien).get_vocab()
    token, index = min(((t, i) for t, i in ours.items() if theirs.get(t, i) != i), key=lambda pair: pair[1])
    assert refused_alike(recipe, tmp_path) == [
        f"{tmp_path / 'r.yaml'}: expert {alien}: tokenizer maps {token!r} to {theirs[token]}, the calibration tokenizer to "
        f"{index} (read from {calibrating}): every model reads the calibration tokenizer's ids, so each expert's tokenizer "
        "must give its tokens the same ids (the base's tokenizer, as fine-tuning keeps it)"]


@pytest.mark.parametrize("special, expected", [
    ({"eos_token": "<unk>"}, "eos_token_id = 3 differs from the calibration tokenizer's 2"),
    ({"unk_token": "</s>"}, "unk_token_id = 2 differs from the calibration tokenizer's 3"),
    (["<pad>", "<s>", "<unk>", "</s>"], "eos_token_id = 3 differs from the calibration tokenizer's 2"),  # the same names, other ids
], ids=["another eos named", "another unk named", "specials at other ids"])
def test_an_expert_of_other_special_ids_is_left_to_runs_special_id_line(scenario, tmp_path, monkeypatch, special, expected):
    """An expert whose tokenizer gives its characters other ids and whose special tokens differ (another token named
    in tokenizer_config.json, or the same names at other ids): run refuses it by the special id it checks first;
    validate, which reads only where the files decide what loading gives, names no token clash that contradicts it."""
    import featcal_llm.tiny as tiny
    from agreement import expert_of_other_token_ids
    from featcal_llm.family.compat import SAME_IDS

    recipe = recipe_of(scenario, tmp_path)
    if isinstance(special, list):
        monkeypatch.setattr(tiny, "SPECIAL_TOKENS", special)
    alien = expert_of_other_token_ids(recipe, 0, tmp_path / "alien")
    if isinstance(special, dict):
        config = json.loads((alien / "tokenizer_config.json").read_text())
        (alien / "tokenizer_config.json").write_text(json.dumps({**config, **special}))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    validated = CliRunner().invoke(main, ["validate", str(path)])
    assert not any("tokenizer maps" in line for line in error_lines(validated)), validated.output
    assert error_lines(CliRunner().invoke(main, ["run", str(path)])) == [
        f"{path}: expert {alien}: tokenizer {expected} (read from {recipe['base_model']}): {SAME_IDS}"]
