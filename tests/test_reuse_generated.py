"""What a rerun reuses of generated sets and evaluations, judged by content: a generated set is drawn again when the
stop tokens, the tokenizer or the dtype change and survives a touch or a moved expert; the evaluation cache key
follows content and a saved chat template, not mtimes or places; a full disk while storing samples leaves nothing
behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from featcal_llm.errors import FeatCalError
from featcal_llm.io.recipe import load_recipe
from test_reuse import _perturb, _touch


def test_the_evaluation_cache_key_follows_content_not_mtime_or_place(reuse_scenario, tmp_path):
    from featcal_llm.evaluation.modelinfo import model_fingerprint

    model = tmp_path / "model"
    shutil.copytree(reuse_scenario.experts["expert1"], model)
    first = model_fingerprint(model)
    _touch(model)
    assert model_fingerprint(model) == first
    moved = tmp_path / "moved"
    shutil.move(model, moved)
    assert model_fingerprint(moved) == first
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_fingerprint(moved) != first
    (moved / "config.json").write_text(json.dumps(config))
    _perturb(moved)
    assert model_fingerprint(moved) != first


def test_the_evaluation_cache_key_follows_a_saved_chat_template_file(reuse_scenario, tmp_path):
    """transformers saves a tokenizer's template as chat_template.jinja: a new template there is another model to
    score (the key records only whether a template was applied), a README beside the weights is not."""
    from featcal_llm.evaluation.modelinfo import model_fingerprint

    model = tmp_path / "model"
    shutil.copytree(reuse_scenario.experts["expert1"], model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    first = model_fingerprint(model)
    (model / "README.md").write_text("notes")
    assert model_fingerprint(model) == first
    (model / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert model_fingerprint(model) != first


def _generation(reuse_scenario, root: Path, expert_dir: Path, dtype=torch.float32):
    """Generate expert0's set from `expert_dir` into `root`; True when a sampler ran (the set was not reused)."""
    from transformers import AutoConfig

    from featcal_llm.generation import run as generation_run
    from featcal_llm.io.references import resolve_source

    recipe_data = yaml.safe_load(reuse_scenario.recipe.read_text())
    recipe_data["models"][0]["model"] = str(expert_dir)
    recipe_data["featcal"]["data"].pop(str(reuse_scenario.experts["expert0"]))
    recipe_data["featcal"]["data"][str(expert_dir)] = {"generate": {"samples": 3, "max_new_tokens": 6, "chat_template": "off"}}
    recipe_data["featcal"]["output"] = str(root / "out")
    root.mkdir(parents=True, exist_ok=True)
    (root / "r.yaml").write_text(yaml.safe_dump(recipe_data, sort_keys=False))
    recipe = load_recipe(root / "r.yaml")
    base = resolve_source(recipe.base, "base_model")
    sources = {e.name: resolve_source(e.reference, e.name, base) for e in recipe.experts}
    configs = {name: AutoConfig.from_pretrained(source.directory) for name, source in sources.items()}
    opened = []
    real = generation_run.open_sampler
    generation_run.open_sampler = lambda *a, **k: opened.append(1) or real(*a, **k)
    try:
        generation_run.generated_sequences(recipe, sources, configs, torch.device("cpu"), dict.fromkeys(sources, dtype), False)
    finally:
        generation_run.open_sampler = real
    return bool(opened)


def test_generated_sets_are_redone_when_stop_tokens_tokenizer_or_dtype_change(reuse_scenario, tmp_path, capsys):
    expert = tmp_path / "m" / "expert0"
    shutil.copytree(reuse_scenario.experts["expert0"], expert)
    work = tmp_path / "work"
    assert _generation(reuse_scenario, work, expert) is True
    assert _generation(reuse_scenario, work, expert) is False
    assert "reused: same weights, generation config, tokenizer files" in capsys.readouterr().err
    generation = expert / "generation_config.json"
    before = generation.read_text() if generation.is_file() else None
    config = json.loads(before) if before else {}
    generation.write_text(json.dumps({**config, "eos_token_id": [2, 5]}))  # a missing stop token added
    assert _generation(reuse_scenario, work, expert) is True
    tokenizer_config = expert / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**settings, "model_max_length": 77}))
    assert _generation(reuse_scenario, work, expert) is True
    assert _generation(reuse_scenario, work, expert, dtype=torch.float64) is True
    assert _generation(reuse_scenario, work, expert, dtype=torch.float64) is False


def test_generated_sets_survive_a_touch_and_a_moved_expert(reuse_scenario, tmp_path):
    expert = tmp_path / "m" / "expert0"
    shutil.copytree(reuse_scenario.experts["expert0"], expert)
    work = tmp_path / "work"
    assert _generation(reuse_scenario, work, expert) is True
    _touch(expert)
    assert _generation(reuse_scenario, work, expert) is False
    moved = tmp_path / "n" / "expert0"
    moved.parent.mkdir()
    shutil.move(expert, moved)
    assert _generation(reuse_scenario, work, moved) is False
    _perturb(moved)
    assert _generation(reuse_scenario, work, moved) is True


def test_generating_expert_without_tokenizer_files_is_one_line(reuse_scenario, tmp_path):
    expert = tmp_path / "m" / "expert0"
    shutil.copytree(reuse_scenario.experts["expert0"], expert)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt"):
        (expert / name).unlink(missing_ok=True)
    with pytest.raises(FeatCalError) as refused:
        _generation(reuse_scenario, tmp_path / "work", expert)
    message = str(refused.value)
    assert "\n" not in message and "expert " + str(expert) in message and "no tokenizer files" in message


@pytest.mark.parametrize("stop", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), KeyboardInterrupt()])
def test_a_full_disk_while_storing_samples_leaves_no_set_and_no_temporary_file(reuse_scenario, tmp_path, monkeypatch, stop):
    """A full disk, and Ctrl-C or SIGTERM (a KeyboardInterrupt in the CLI) at the same point, alike."""
    from featcal_llm.generation import store

    real = Path.replace

    def full(self, target):
        raise stop

    monkeypatch.setattr(Path, "replace", full)
    samples, record = tmp_path / "g" / "e.jsonl", tmp_path / "g" / "e.json"
    with pytest.raises(type(stop)):
        store.store_samples(samples, record, [{"token_ids": [1, 2]}], {"key": "k"})
    monkeypatch.setattr(Path, "replace", real)
    assert list((tmp_path / "g").iterdir()) == []
    assert store.cached_samples(samples, record, "k") is None
