"""Cache keys, summaries and chat templating: a changed grader, environment, task or dataset is a
miss; a partial `--tasks` run adds to a model's summary; same-named models keep their own
summaries; chat prompts do not depend on today's date or lose the code prefix's newline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import cache, provenance, runner
from featcal_llm.evaluation.config import EvalSection
from featcal_llm.evaluation.modelinfo import ChatDecision
from featcal_llm.evaluation.suite import load_suite

CHAT = ChatDecision(True, "forced on", "0" * 64)
BACKEND = {"name": "hf", "model_args": {"dtype": "auto"}, "batch_size": 1}


@pytest.fixture()
def section():
    return EvalSection.model_validate({"allow_code_execution": True})


def _key(suite, task_id, section, **changes):
    fields = runner.key_fields(suite, task_id, section, changes.get("model", "f" * 64),
                               changes.get("backend", BACKEND), changes.get("chat", CHAT))
    return cache.cache_key(fields)


def test_every_key_component_changes_the_key(tmp_path, monkeypatch, section):
    monkeypatch.setattr(provenance, "resolve_hub_revision", lambda path, revision: "a" * 40)
    suite = load_suite("mergebench")
    base = {task: _key(suite, task, section) for task in ("gsm8k", "mbpp_plus")}
    assert base == {task: _key(suite, task, section) for task in base}  # deterministic

    def changed(task, **kwargs) -> bool:
        return _key(suite, task, section, **kwargs) != base[task]

    assert changed("gsm8k", model="e" * 64)
    assert changed("gsm8k", backend={**BACKEND, "batch_size": 2})
    assert changed("gsm8k", chat=ChatDecision(False, "forced off", None))
    # the grader's code (each of its modules), for the code tasks only
    copy = tmp_path / "grader"
    shutil.copytree(provenance._HERE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(provenance, "_HERE", copy)
    assert not changed("mbpp_plus") and not changed("gsm8k")
    for module in provenance.GRADER_MODULES:
        original = (copy / module).read_text()
        (copy / module).write_text(original + "\n# changed\n")
        assert changed("mbpp_plus"), module
        assert not changed("gsm8k")
        (copy / module).write_text(original)
    # library versions
    real_version = provenance.version
    for package in ("vllm", "transformers", "torch", "lm_eval"):
        monkeypatch.setattr(provenance, "version", lambda name, p=package: "9.9.9" if name == p else real_version(name))
        assert changed("gsm8k"), package
    monkeypatch.setattr(provenance, "version", real_version)
    # the dataset's revision: what the hub's revision resolves to, or a pinned one
    monkeypatch.setattr(provenance, "resolve_hub_revision", lambda path, revision: "b" * 40)
    assert changed("gsm8k")
    monkeypatch.setattr(provenance, "resolve_hub_revision", lambda path, revision: "a" * 40)
    pinned = suite.model_copy(deep=True)
    pinned.tasks["gsm8k"].dataset_revision = "c" * 40
    assert _key(pinned, "gsm8k", section) != base["gsm8k"]
    # lm-eval's task source: its YAML and the Python next to it
    tasks = tmp_path / "tasks"
    shutil.copytree(provenance.lm_eval_tasks_root() / "gsm8k", tasks / "gsm8k")
    monkeypatch.setattr(provenance, "lm_eval_tasks_root", lambda: tasks)
    provenance.find_task_yaml.cache_clear()
    assert not changed("gsm8k")
    yaml_file = tasks / "gsm8k" / "gsm8k-cot-llama.yaml"
    yaml_file.write_text(yaml_file.read_text() + "\n# changed\n")
    assert changed("gsm8k")
    provenance.find_task_yaml.cache_clear()


def test_dataset_identity_records_path_and_revision(monkeypatch, section):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    provenance.resolve_hub_revision.cache_clear()
    suite = load_suite("mergebench")
    fields = runner.key_fields(suite, "mbpp_plus", section, "f" * 64, BACKEND, CHAT)
    assert fields["dataset"] == {"path": "evalplus/mbppplus", "name": None, "pinned": None, "revision": "unresolved"}
    assert fields["grader"] == provenance.grader_source_sha256() and fields["task_source"]
    assert set(fields["versions"]) >= {"lm_eval", "vllm", "transformers", "torch"}
    local = EvalSection.model_validate({"allow_code_execution": True, "data": {"gsm8k": str(Path(__file__).resolve().parents[1] / "eval" / "fixtures/mergebench/gsm8k.jsonl")}})
    assert runner.key_fields(suite, "gsm8k", local, "f" * 64, BACKEND, CHAT)["dataset"]["local"]


# ------------------------------------------------------------------ summaries


def _fake_model(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def _section(tmp_path, tasks):
    return EvalSection.model_validate({"tasks": tasks, "backend": {"name": "hf", "device": "cpu"},
                                       "chat_template": "off", "output": str(tmp_path / "out")})


def test_partial_runs_add_to_the_summary(tmp_path, fake_worker, capsys):
    model = _fake_model(tmp_path / "m", b"w1")
    runner.evaluate_model(model, "m", _section(tmp_path, ["gsm8k", "ifeval"]), echo=lambda line: None)
    summary = runner.evaluate_model(model, "m", _section(tmp_path, ["gsm8k"]), echo=lambda line: None)
    assert fake_worker == [["gsm8k", "ifeval"]]  # the second run was all cache hits
    assert list(summary["tasks"]) == ["gsm8k", "ifeval"]
    summary = runner.evaluate_model(model, "m", _section(tmp_path, ["arc_challenge"]), echo=lambda line: None)
    assert list(summary["tasks"]) == ["gsm8k", "ifeval", "arc_challenge"] and not summary["complete"]
    assert json.loads((tmp_path / "out" / "m.json").read_text())["tasks"].keys() == summary["tasks"].keys()
    # other weights under the same path: the old scores are not kept
    (model / "model.safetensors").write_bytes(b"w2")
    capsys.readouterr()
    summary = runner.evaluate_model(model, "m", _section(tmp_path, ["gsm8k"]), echo=lambda line: None)  # as --quiet
    assert list(summary["tasks"]) == ["gsm8k"]
    assert "featcal-llm: warning: m: dropping ifeval, arc_challenge from its summary in" in capsys.readouterr().err


def test_models_with_the_same_directory_name_keep_their_own_summaries(tmp_path, fake_worker):
    first = _fake_model(tmp_path / "a" / "merged", b"w1")
    second = _fake_model(tmp_path / "b" / "merged", b"w2")
    one = runner.evaluate_model(first, "merged", _section(tmp_path, ["gsm8k"]), echo=lambda line: None)
    two = runner.evaluate_model(second, "merged", _section(tmp_path, ["gsm8k"]), echo=lambda line: None)
    assert one["label"] == "merged" and two["label"].startswith("merged-") and two["label"] != "merged"
    assert json.loads((tmp_path / "out" / "merged.json").read_text())["model"]["path"] == str(first.resolve())
    assert json.loads((tmp_path / "out" / f"{two['label']}.json").read_text())["model"]["path"] == str(second.resolve())
    again = runner.evaluate_model(first, "merged", _section(tmp_path, ["gsm8k"]), echo=lambda line: None)
    assert again["label"] == "merged"


# ------------------------------------------------------------------ chat templating

LLAMA3_LIKE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}<|eot_id|>"
    "{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}{% if not loop.last or add_generation_prompt %}<|eot_id|>{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


def test_chat_prompts_have_a_fixed_date_and_keep_the_code_prefix_newline():
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from featcal_llm.evaluation.backends import plan_backend
    from featcal_llm.evaluation.config import BackendSettings
    from featcal_llm.evaluation.worker import keep_prefix_whitespace
    from featcal_llm.tiny import build_char_tokenizer

    suite = load_suite("mergebench")
    plan = plan_backend("hf", BackendSettings(device="cpu"), Path("/m"), 4096, None, suite.chat_template_args)
    assert plan.model_args["chat_template_args"] == {"date_string": "26 Jul 2024"}

    class Lm:  # what HFLM.apply_chat_template uses of the model
        tokenizer = build_char_tokenizer()
        chat_template_args = plan.model_args["chat_template_args"]

    Lm.tokenizer.chat_template = LLAMA3_LIKE
    lm = Lm()
    prefix = "Below is a Python script:\n```python\n"
    history = [{"role": "user", "content": "Solve it."}, {"role": "assistant", "content": prefix}]
    raw = HFLM.apply_chat_template(lm, history, add_generation_prompt=False)
    assert "Today Date: 26 Jul 2024" in raw
    assert raw.endswith("```python")  # the template's trim ate the newline
    fixed = keep_prefix_whitespace(lambda h, g=True: HFLM.apply_chat_template(lm, h, g))
    assert fixed(history, False) == raw + "\n"
    assert fixed(history[:1], True) == HFLM.apply_chat_template(lm, history[:1], True)  # nothing to restore


def test_the_run_reads_the_revision_the_key_names():
    pytest.importorskip("lm_eval")
    from featcal_llm.evaluation.tasks import resolve_task_config

    suite = load_suite("mergebench")
    config = resolve_task_config(suite, "mbpp_plus", data=None, max_gen_toks=None, revision="d" * 40)
    assert config["dataset_kwargs"]["revision"] == "d" * 40
    assert "revision" not in (resolve_task_config(suite, "mbpp_plus", data=None, max_gen_toks=None,
                                                  revision="unresolved").get("dataset_kwargs") or {})


@pytest.mark.parametrize("edit", ["value", "empty", "list", "text value", "key fields"])
def test_an_entry_this_cache_did_not_write_is_scored_again(tmp_path, fake_worker, edit):
    """A hand-edited score (0.5 → 0.75) had been summarised as it stood, and a malformed result.json had been a
    traceback: an entry whose key fields hash elsewhere or whose score is not lm-eval's metric is a miss."""
    import json

    section = _section(tmp_path, ["gsm8k"])
    model = _fake_model(tmp_path / "m", b"w1")
    runner.evaluate_model(model, "m", section, echo=lambda line: None)
    [entry] = (tmp_path / "out" / "cache").iterdir()
    result = entry / cache.RESULT_FILE
    record = json.loads(result.read_text())
    if edit == "value":
        record["task"]["value"] = 0.75
    elif edit == "text value":
        record["task"]["value"] = "abc"
    elif edit == "key fields":
        record["key_fields"]["limit"] = 3
    result.write_text({"empty": "{}", "list": "[]"}.get(edit) or json.dumps(record))
    assert cache.read_entry(entry) is None
    summary = runner.evaluate_model(model, "m", section, echo=lambda line: None)
    assert fake_worker == [["gsm8k"], ["gsm8k"]] and summary["tasks"]["gsm8k"]["value"] == 0.5


def test_a_config_of_another_shape_is_no_traceback(tmp_path):
    """A config.json holding a list is refused in one line (it had been an AttributeError)."""
    from featcal_llm.evaluation.modelinfo import max_positions

    model = _fake_model(tmp_path / "m", b"w1")
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(FeatCalError, match=r"config.json: expected a JSON object \(a model config\)$"):
        max_positions(model)


def test_a_model_folder_named_with_an_equals_sign_is_a_folder(tmp_path, monkeypatch):
    """`eval alpha=0.3` had been read as LABEL=PATH ('0.3: model directory does not exist'); LABEL=PATH stays for the rest."""
    from featcal_llm.evaluation.cli import _models

    monkeypatch.chdir(tmp_path)
    (tmp_path / "alpha=0.3").mkdir()
    assert _models(("alpha=0.3", "merged=out/merged")) == [("alpha=0.3", Path("alpha=0.3")), ("merged", Path("out/merged"))]


def _one_line_refusal(result, *names: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal-llm: error: "), result.output
    assert all(name in lines[0] for name in names), lines[0]


def test_an_eval_output_under_a_file_is_refused_in_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from featcal_llm.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _fake_model(tmp_path / "m", b"w1")
    (tmp_path / "afile").write_text("")
    gsm8k = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench" / "gsm8k.jsonl"
    result = CliRunner().invoke(main, ["eval", str(model), "--tasks", "gsm8k", "--backend", "hf", "--device", "cpu",
                                       "--chat-template", "off", "--data", f"gsm8k={gsm8k}", "--max-gen-toks", "4",
                                       "--output", str(tmp_path / "afile" / "sub")])
    _one_line_refusal(result, "afile")


@pytest.mark.parametrize("config", ["{trunc", '{"max_position_embeddings": 1024}'])
def test_an_unreadable_config_json_is_refused_before_the_worker(tmp_path, fake_worker, config):
    model = _fake_model(tmp_path / "m", b"w1")
    (model / "config.json").write_text(config)
    with pytest.raises(FeatCalError, match="config.json"):
        runner.evaluate_model(model, "m", _section(tmp_path, ["gsm8k"]), echo=lambda line: None)
    assert fake_worker == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", r"config.json: expected a JSON object \(a model config\)$"),
    ('"llama"', r"config.json: expected a JSON object \(a model config\)$"),
    ("{}", r"config.json: no model_type, so no runtime knows which model family to load$"),
    ('{"model_type": null}', r"config.json: no model_type, so no runtime knows which model family to load$"),
    ('{"model_type": 7}', r"config.json: no model_type, so no runtime knows which model family to load$"),
])
def test_a_model_directory_whose_config_is_no_model_config_is_refused_in_one_line(tmp_path, text, message):
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.modelinfo import check_model_dir

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(FeatCalError, match=message):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert check_model_dir(tmp_path) == tmp_path.resolve()


def test_a_model_s_positions_are_its_text_model_s_and_an_integer():
    """A config with a text_config (a multimodal model's) gives the text model's positions there: those are the ones a
    prompt uses, whatever the outer config says. A boolean or a float is no count of positions."""
    from featcal_llm.evaluation.modelinfo import config_positions

    assert config_positions({"max_position_embeddings": 2048}) == 2048
    assert config_positions({"max_position_embeddings": 1024, "text_config": {"max_position_embeddings": 131072}}) == 131072
    assert config_positions({"max_position_embeddings": 1024, "text_config": {"hidden_size": 8}}) == 1024
    assert config_positions({"max_position_embeddings": True}) is None
    assert config_positions({"max_position_embeddings": 2048.0}) is None
    assert config_positions({}) is None


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_stopped_evaluation_stops_its_worker(tmp_path, monkeypatch, ignores_sigterm):
    """SIGTERM reaches the `eval`/`run` process alone (Ctrl-C reaches the terminal's whole group): the worker, which
    holds the model (on a GPU, its memory), is terminated with it, and killed where it does not exit in time."""
    import subprocess
    import sys

    started, real_popen = [], subprocess.Popen
    ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignores_sigterm else ""

    def worker(command, **kwargs):  # a worker that writes a line a second, for a minute
        started.append(real_popen([sys.executable, "-c", ignore + "import time\nfor i in range(60): print(i, flush=True); "
                                   "time.sleep(1)"], **kwargs))
        return started[-1]

    def stop(line):
        raise KeyboardInterrupt()

    monkeypatch.setattr(runner.subprocess, "Popen", worker)
    monkeypatch.setattr(runner, "stop_worker", lambda process, grace_s=30.0, stop=runner.stop_worker: stop(process, 1.0))
    with pytest.raises(KeyboardInterrupt):
        runner._run_worker({"model": {"path": "m"}}, tmp_path / "out", "m", stop)
    assert started[0].poll() == (-9 if ignores_sigterm else -15)
