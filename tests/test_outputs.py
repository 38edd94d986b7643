"""What a run leaves for others: a model card fit to publish (no local paths, what was calibrated, the evaluation
table after an `eval:` block) and `--push-to-hub` (tested against a stand-in of huggingface_hub's HfApi)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.io.run_record import read_run_record

TABLE = "| model | ARC-C |\n|---|---|\n| merged | 21.0 |\n| calibrated | 23.5 |\n"


def test_card_has_no_local_paths_lists_the_calibrated_projections_and_the_evaluation(small, tmp_path, monkeypatch, capfd):
    import featcal_llm
    import featcal_llm.evaluation

    seen = []

    def evaluated(section, merged_dir, calibrated_dir, recipe_dir, echo=None):  # the table, and the calibrated model's summary
        import json

        from featcal_llm.evaluation.compare import AfterCalibration

        def summary(model, score):
            return {"model": {"path": str(model)}, "suite": {"name": "mergebench", "version": "2"},
                    "tasks": {"arc_challenge": {"label": "ARC-C", "metric": "exact_match,remove_whitespace", "score": score}}}

        results = Path(section.resolve(recipe_dir).output)
        results.mkdir(parents=True, exist_ok=True)  # another summary of the same directory, sorted first: not this run's
        (results / "aaa.json").write_text(json.dumps({**summary(calibrated_dir, 99.0), "limit": 1}))
        seen.append(section)
        return AfterCalibration(TABLE, summary(calibrated_dir, 23.5))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(featcal_llm.evaluation, "run_after_calibration", evaluated)
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"), modules=["q_proj", "down_proj"],
                                eval={"tasks": ["arc_challenge"], "backend": {"name": "hf"}})
    result = featcal_llm.calibrate(recipe, progress=False)
    assert len(seen) == 1 and result.evaluation == TABLE
    assert "featcal-llm: evaluating" not in capfd.readouterr().err  # progress=False: no stage lines either
    card = (tmp_path / "out" / "README.md").read_text()
    absolute = re.findall(r"(?<![\w.:/])/(?:tmp|home|work|root|Users|var)\b[^\s`'\"]*", card)
    assert absolute == [] and str(small.root) not in card and str(tmp_path) not in card
    front = yaml.safe_load(card.split("---")[1])
    assert "base_model" not in front  # a local base is not a hub id
    [result_] = front["model-index"][0]["results"]  # this run's score of the calibrated model, not another summary's
    assert result_["dataset"]["type"] == "arc_challenge" and result_["metrics"][0]["value"] == 23.5
    run = read_run_record(tmp_path / "out")  # the run's record, beside the card
    assert run["base_model"] == "base" and run["merged_model"] == "merged"
    assert run["experts"] == ["expert0", "expert1"]
    assert run["calibration_tokens"].keys() == {"expert0", "expert1"}
    assert run["settings"]["projections"] == ["mlp.down_proj", "self_attn.q_proj"]
    record = (tmp_path / "out" / "featcal_weights.json").read_text()
    assert str(small.root) not in record and str(tmp_path) not in record
    assert "In every decoder layer the projections `mlp.down_proj`, `self_attn.q_proj` were re-fitted; the other projections keep" in card
    assert "every linear projection" not in card
    evaluation = card.index("## Evaluation")
    assert card.index(TABLE.rstrip(), evaluation) < card.index("## Recipe")
    recipe_block = card[card.index("```yaml"):]
    assert "base_model: base" in recipe_block and "- q_proj" in recipe_block
    assert str(small.base) in (tmp_path / "out" / "featcal_recipe.yml").read_text()  # the replayable recipe keeps its paths
    # as mergekit's own record of the merge does, and the drift report, keyed by the recipe's expert names (the API's
    # result reads it); no other file names a path on this machine
    for written in sorted((tmp_path / "out").iterdir()):
        if written.name not in ("featcal_recipe.yml", "mergekit_config.yml", "featcal_drift.json") and written.suffix in (".json", ".md", ".yml", ".yaml", ".txt", ".jinja"):
            text = written.read_text(encoding="utf-8")
            assert str(tmp_path) not in text and str(small.root) not in text, written.name


def test_card_keeps_hub_ids_and_says_every_projection():
    from featcal_llm.io.card import _calibrated_text
    from featcal_llm.io.names import is_local, public_names

    names = public_names(["meta-llama/Llama-3.2-3B", "/data/runs/a/math", "/data/runs/b/math", "./experts/code+/lora/x"])
    assert names == {"meta-llama/Llama-3.2-3B": "meta-llama/Llama-3.2-3B", "/data/runs/a/math": "a/math",
                     "/data/runs/b/math": "b/math", "./experts/code+/lora/x": "code+x"}
    assert not is_local("org/model@v2") and is_local("~/models/x")
    every = {"projections": ["mlp.up_proj"], "every_projection": True, "norms": True, "biases": False}
    assert _calibrated_text(every, regmean=False, biases=False) == ("Every linear projection of every decoder layer was re-fitted. "
                                                                   "The RMSNorm scales were updated too.")
    assert _calibrated_text(every, regmean=False, biases=True).endswith("The projections' biases keep the merged model's values.")
    # after a refinement that changed the weights, the closed form's account is followed by what the refinement trained
    some = {**every, "every_projection": False, "norms": False}
    adapter = {"chosen_step": 3, "params": "adapter", "rank": 8, "tied_head": True}
    assert _calibrated_text(some, regmean=False, biases=False, refined=adapter) == (
        "In every decoder layer the projections `mlp.up_proj` were re-fitted; the other projections kept the merged model's "
        "weights. The norms kept the merged model's scales. That is the closed form; the refinement after it (see "
        "Refinement) then trained a rank-8 LoRA on the calibrated projections, merged back into the weights, with the norms "
        "and LM head in full (the LM head is tied to the input embeddings: they trained as one), so those too now differ from the "
        "merged model.")
    assert "with the norms, biases and LM head in full, so" in _calibrated_text(
        some, regmean=False, biases=True, refined={**adapter, "tied_head": False})
    assert "That is the closed form" not in _calibrated_text(some, regmean=False, biases=True, refined={**adapter, "chosen_step": 0})
    from featcal_llm.io.card_settings import adapter_trained

    # no check kept: nothing was merged back, and the Refinement section says what trained without it
    assert adapter_trained(8, False, False, kept=False) == "a rank-8 LoRA on the calibrated projections with the norms and LM head in full"


class FakeHub:
    """Stands in for huggingface_hub.HfApi: records what would be created and uploaded."""

    calls: list = []
    fail = False

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, repo_id, *, repo_type=None, private=None, exist_ok=False, **kwargs):
        FakeHub.calls.append(("create_repo", repo_id, repo_type, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def whoami(self, *args, **kwargs):
        return {"name": "me"}

    def upload_folder(self, *, folder_path, repo_id, repo_type=None, **kwargs):
        if FakeHub.fail:
            raise RuntimeError("401 Client Error: Unauthorized\nInvalid token")
        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        FakeHub.calls.append(("upload_folder", repo_id, repo_type, files))


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    FakeHub.calls, FakeHub.fail = [], False
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_stand_in")  # logged in (checked before the run)
    return FakeHub


def test_push_to_hub_uploads_the_calibrated_model_privately(small, tmp_path, hub):
    recipe = small.write_recipe(tmp_path / "r.yaml", output=str(tmp_path / "out"))
    result = CliRunner().invoke(main, ["run", str(recipe), "--quiet", "--push-to-hub", "me/merged-featcal"])
    assert result.exit_code == 0, result.output
    assert hub.calls[0] == ("create_repo", "me/merged-featcal", "model", True, True)
    name, repo, kind, files = hub.calls[1]
    assert (name, repo, kind) == ("upload_folder", "me/merged-featcal", "model")
    assert {"README.md", "config.json", "featcal_drift.json", "featcal_recipe.yml"} <= set(files)
    assert any(f.endswith(".safetensors") for f in files) and len(hub.calls) == 2


def test_public_repository_and_upload_errors(tmp_path, hub):
    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.hub import push_folder

    (tmp_path / "README.md").write_text("card")
    assert push_folder(tmp_path, "me/x", private=False) == "https://huggingface.co/me/x"
    assert hub.calls[0] == ("create_repo", "me/x", "model", False, True)
    hub.fail = True
    with pytest.raises(FeatCalError, match=rf"^--push-to-hub me/x: upload failed \(401 Client Error: Unauthorized\); "
                                           rf"the calibrated model is kept in {re.escape(str(tmp_path))}$"):
        push_folder(tmp_path, "me/x")


def test_nothing_is_pushed_when_the_run_fails_or_the_repo_id_is_bad(small, tmp_path, hub):
    recipe = yaml.safe_load(small.recipe.read_text())
    recipe["featcal"]["data"][str(small.experts["expert0"])]["path"] = str(tmp_path / "missing.jsonl")
    recipe["featcal"]["output"] = str(tmp_path / "out")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    failed = CliRunner().invoke(main, ["run", str(tmp_path / "bad.yaml"), "--push-to-hub", "me/model"])
    assert failed.exit_code == 2 and "missing.jsonl" in failed.stderr
    bad_id = CliRunner().invoke(main, ["run", str(small.recipe), "--push-to-hub", "me/bad name"])
    assert bad_id.exit_code == 2 and bad_id.stderr.startswith("featcal-llm: error: --push-to-hub me/bad name: not a Hub repository id")
    alone = CliRunner().invoke(main, ["run", str(small.recipe), "--public"])
    assert alone.exit_code == 2 and "--public applies to --push-to-hub REPO_ID" in alone.output
    assert hub.calls == [] and not (tmp_path / "out").exists()


def test_side_files_are_the_merges_not_an_earlier_runs_report(tmp_path):
    """A merge that is an earlier run's output hands on its config, tokenizer and chat template, never its card or
    its `featcal_*` report of a run this one did not make (a refine or a search it did not do)."""
    from featcal_llm.io.checkpoint import copy_side_files

    source, output = tmp_path / "earlier", tmp_path / "out"
    source.mkdir(), output.mkdir()
    names = ["config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", "mergekit_config.yml",
             "README.md", "featcal_merge.json", "featcal_refine.json", "featcal_tuning.json", "featcal_drift.png",
             "featcal_recipe.yml", "model.safetensors", "model.safetensors.index.json"]
    for name in names:
        (source / name).write_text(name)
    copy_side_files(source, output)
    assert sorted(path.name for path in output.iterdir()) == sorted(names[:5])
    assert (output / "tokenizer.json").read_text() == "tokenizer.json"


def test_the_saved_recipe_names_data_found_beside_the_recipe_as_found_and_replays(small, tmp_path, monkeypatch):
    """Calibration files given relative to a recipe in another folder (found beside it, not in the current directory):
    featcal_recipe.yml, which lives in the output, names them as the run found them, keeping the rest of the text as
    written, and replays to the same bytes from where the run ran."""
    import shutil

    import featcal_llm

    monkeypatch.chdir(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    raw = yaml.safe_load(small.recipe.read_text())
    for index, (name, spec) in enumerate(raw["featcal"]["data"].items()):
        shutil.copy(spec["path"], project / f"d{index}.jsonl")
        spec["path"] = f"d{index}.jsonl"  # beside the recipe only
    raw["featcal"].update(output=str(tmp_path / "out"), merged=str(small.root / "merged"), modules=["q_proj"])
    (project / "recipe.yaml").write_text("# my calibration\n" + yaml.safe_dump(raw, sort_keys=False))
    first = featcal_llm.calibrate("project/recipe.yaml", progress=False).output
    saved = (first / "featcal_recipe.yml").read_text()
    assert saved.startswith("# my calibration\n")
    assert sorted(spec["path"] for spec in yaml.safe_load(saved)["featcal"]["data"].values()) == ["project/d0.jsonl", "project/d1.jsonl"]
    again = featcal_llm.calibrate(first / "featcal_recipe.yml", output=tmp_path / "again", progress=False).output
    assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()


def test_found_paths_cover_prompts_and_the_eval_blocks_files_and_nothing_else(tmp_path, monkeypatch):
    from featcal_llm.io.saved_recipe import with_found_paths

    monkeypatch.chdir(tmp_path)
    project = tmp_path / "project"
    (project / "nltk").mkdir(parents=True)
    for name in ("d.jsonl", "p.txt", "suite.yaml", "gsm.jsonl", "here.jsonl"):
        (project / name).write_text("x")
    (tmp_path / "here.jsonl").write_text("x")  # in the current directory: the run reads this one, and it stays
    text = ("base_model: base  # the base\nfeatcal:\n  output: out\n  data:\n    a: {path: d.jsonl, format: text}\n"
            "    b: {path: here.jsonl}\n    c:\n      generate: {prompts: 'p.txt'}\n"
            "  eval: {suite: suite.yaml, data: {gsm8k: gsm.jsonl}, nltk_data: nltk, output: results}\n")
    assert with_found_paths(text, Path("project")) == text.replace("d.jsonl", "project/d.jsonl").replace("'p.txt'", "project/p.txt") \
        .replace("suite: suite.yaml", "suite: project/suite.yaml").replace("gsm.jsonl", "project/gsm.jsonl") \
        .replace("nltk_data: nltk", "nltk_data: project/nltk")


def test_found_paths_keep_anchors_and_follow_merge_keys(tmp_path, monkeypatch):
    """An anchored path keeps its anchor (its aliases still name it), a merge key's path is found through it, and the
    result parses to what the run read; `run RECIPE OUTPUT` keeps an anchor on `output` the same way."""
    from featcal_llm.io.recipe_yaml import with_output
    from featcal_llm.io.saved_recipe import with_found_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "project").mkdir()
    for name in ("d.jsonl", "p.txt"):
        (tmp_path / "project" / name).write_text("x")
    text = ("featcal:\n  output: &out out\n  data:\n    a: &entry {path: &d !!str d.jsonl, format: text}\n    b: {<<: *entry, samples: 4}\n"
            "    c: {path: *d}\n    e: {generate: {prompts: &p p.txt}}\n    f: {generate: {prompts: *p}}\n  eval: {output: *out}\n")
    found = with_found_paths(text, Path("project"))
    data = yaml.safe_load(found)["featcal"]["data"]
    assert {name: data[name].get("path") for name in "abc"} == dict.fromkeys("abc", "project/d.jsonl")
    assert data["e"]["generate"]["prompts"] == data["f"]["generate"]["prompts"] == "project/p.txt"
    assert "&d !!str project/d.jsonl" in found and "&p project/p.txt" in found
    moved = yaml.safe_load(with_output(text, "elsewhere"))["featcal"]
    assert moved["output"] == moved["eval"]["output"] == "elsewhere"


def test_models_without_a_tokenizer_give_an_output_with_featcal_tokenizers(small, tmp_path):
    """Base and experts shipped without tokenizer files, so the recipe names featcal.tokenizer (as the refusal of a
    missing tokenizer says to): the merge has none either, and the output carries the one the records were read with."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import featcal_llm
    from featcal_llm.io.model_files import TOKENIZER_FILES, has_tokenizer_files

    bare = lambda source, name: shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns(  # noqa: E731
        *TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja"))
    raw = yaml.safe_load(small.recipe.read_text())
    raw["base_model"] = str(bare(small.base, "base"))
    for index, entry in enumerate(raw["models"]):
        old = entry["model"]
        entry["model"] = str(bare(old, f"expert{index}"))
        raw["featcal"]["data"][entry["model"]] = raw["featcal"]["data"].pop(old)
    raw["featcal"].update(output=str(tmp_path / "out"), merged=str(tmp_path / "merged"), tokenizer=str(small.base), modules=["q_proj"])
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    output = featcal_llm.calibrate(tmp_path / "r.yaml", progress=False).output
    assert not has_tokenizer_files(tmp_path / "merged") and has_tokenizer_files(output)
    ids = AutoTokenizer.from_pretrained(output)("a b c")["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(small.base)("a b c")["input_ids"]
    AutoModelForCausalLM.from_pretrained(output)(input_ids=__import__("torch").tensor([ids]))


def test_a_merge_with_its_own_tokenizer_keeps_it_beside_featcal_tokenizer(small, tmp_path):
    """featcal.tokenizer reads the records; where the merge has tokenizer files (mergekit copied the base's), the output
    keeps the merge's, not the recipe's (told apart here by model_max_length)."""
    from transformers import AutoTokenizer

    import featcal_llm

    AutoTokenizer.from_pretrained(small.base, model_max_length=777).save_pretrained(tmp_path / "tokenizer")
    raw = yaml.safe_load(small.recipe.read_text())
    raw["featcal"].update(output=str(tmp_path / "out"), merged=str(tmp_path / "merged"), tokenizer=str(tmp_path / "tokenizer"),
                          modules=["q_proj"])
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    output = featcal_llm.calibrate(tmp_path / "r.yaml", progress=False).output
    merged = AutoTokenizer.from_pretrained(tmp_path / "merged").model_max_length
    assert merged != 777 and AutoTokenizer.from_pretrained(output).model_max_length == merged
