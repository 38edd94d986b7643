"""The command line's habits: -h everywhere, examples in every --help, `run RECIPE [OUTPUT]`, documented exit codes,
and the first thing to fix said first (a missing model, a zero count, a local path with a typo)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main
from featcal_llm.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE, FeatCalError, QuietExit, RunFailure, Terminated

COMMANDS = ["run", "validate", "eval", "leaderboard", "bench", "demo", "recipes"]
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)], ids=lambda c: " ".join(c) or "featcal-llm")
def test_dash_h_is_help_with_examples(command):
    short, long = (CliRunner().invoke(main, [*command, flag]) for flag in ("-h", "--help"))
    assert short.exit_code == 0 and short.output == long.output, short.output
    assert re.search(r"Examples:\n +featcal-llm ", short.output), short.output


def test_run_help_names_the_output_argument_and_the_exit_codes():
    text = CliRunner().invoke(main, ["run", "-h"]).output
    assert "RECIPE [OUTPUT]" in text and "replaces the recipe's featcal.output" in text
    assert "Exit codes: 0 done; 1 the run started and failed" in text and "2 bad command line or input" in " ".join(text.split())


def test_the_readme_documents_the_exit_codes_the_code_uses():
    section = README.read_text(encoding="utf-8").split("### Exit codes", 1)[1].split("\n#", 1)[0]
    codes = dict(re.findall(r"^\| `(\d+)` \| (.+?) \|$", section, flags=re.M))
    assert set(codes) == {"0", str(EXIT_FAILED), str(EXIT_USAGE), str(EXIT_INTERRUPTED), str(EXIT_TERMINATED)}, codes


@pytest.mark.parametrize("raised, code", [(FeatCalError("r.yaml: featcal.samples: expected an integer"), EXIT_USAGE),
                                          (RunFailure("layer 3: calibrated layer produced NaN/Inf hidden states"), EXIT_FAILED),
                                          (KeyboardInterrupt(), EXIT_INTERRUPTED), (Terminated(), 143)])
def test_exit_codes_tell_bad_input_from_a_failed_run(tmp_path, monkeypatch, raised, code):
    import featcal_llm.api

    def calibrate(*args, **kwargs):
        raise raised

    monkeypatch.setattr(featcal_llm.api, "calibrate", calibrate)
    (tmp_path / "r.yaml").write_text("x: 1\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")])
    assert result.exit_code == code, (result.output, result.exception)
    if str(raised):
        assert result.stderr.strip().splitlines()[0] == f"featcal-llm: error: {raised}"
    else:  # interrupted: what happens to the work, and how to go on
        how = "terminated (SIGTERM)" if isinstance(raised, Terminated) else "interrupted"
        assert result.stderr.strip() == (f"featcal-llm: {how}; what the run finished (a merge, generated records, "
                                         "calibrated layers, refinement steps) is kept, and the same command resumes from there")


def test_sigterm_raises_terminated_only_inside_a_command_under_torchrun_too(monkeypatch):
    """Inside a command SIGTERM raises Terminated (the handler that makes exit 143); after it, the handler that was
    there is back (a caller of `main` keeps its own); under torchrun (LOCAL_RANK set) too, as its agent stops the ranks
    left with SIGTERM."""
    import os
    import signal

    from featcal_llm.cli import stopping_on_sigterm

    def before(signum, frame):
        raise AssertionError("the caller's handler ran inside the command")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        with pytest.raises(Terminated), stopping_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is before
        monkeypatch.setenv("LOCAL_RANK", "0")
        with pytest.raises(Terminated), stopping_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("leaving, code, line", [(FeatCalError("r.yaml: featcal.alpha: expected at most 1"), EXIT_USAGE,
                                                   "featcal-llm: error: r.yaml: featcal.alpha: expected at most 1"),
                                                  (QuietExit(), EXIT_USAGE, None)])
def test_a_stop_on_the_way_out_of_an_error_reports_the_error(tmp_path, monkeypatch, leaving, code, line):
    """torchrun's agent SIGTERMs the ranks left once one has exited: a rank still cleaning up after its error (leaving
    the world) reports that error, not a stop that would say the run was merely interrupted."""
    import featcal_llm.api

    def calibrate(*args, **kwargs):
        try:
            raise leaving
        finally:
            raise Terminated()

    monkeypatch.setattr(featcal_llm.api, "calibrate", calibrate)
    (tmp_path / "r.yaml").write_text("x: 1\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")])
    assert result.exit_code == code, (result.output, result.exception)
    assert result.stderr.strip().splitlines() == ([line] if line else [])


def test_out_of_memory_is_one_line_and_exit_1_and_other_errors_are_not_hidden(tmp_path, monkeypatch):
    import featcal_llm.api

    raised = {"error": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB")}

    def calibrate(*args, **kwargs):
        raise raised["error"]

    monkeypatch.setattr(featcal_llm.api, "calibrate", calibrate)
    (tmp_path / "r.yaml").write_text("x: 1\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")])
    assert result.exit_code == EXIT_FAILED, (result.output, result.exception)
    assert result.stderr.splitlines() == [
        "featcal-llm: error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB); `featcal-llm validate RECIPE` prints what the run needs: lower featcal.batch_tokens, or run on a larger "
        "device, then rerun the same command to resume"]
    raised["error"] = RuntimeError("an internal bug")  # not turned into a tidy line: its traceback is what a report needs
    assert isinstance(CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")]).exception, RuntimeError)


def test_a_bad_recipe_and_a_bad_option_exit_2(tmp_path):
    (tmp_path / "r.yaml").write_text("merge_method: linear\n")
    assert CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")]).exit_code == EXIT_USAGE
    assert CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml"), "--nope"]).exit_code == EXIT_USAGE


def test_run_writes_to_the_output_argument_without_transformers_deprecations(merged_scenario, tmp_path):
    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    recipe["featcal"].update(merged=str(tmp_path / "merged"), samples=4)  # a fresh merge: mergekit sets torch_dtype in it
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    result = subprocess.run([sys.executable, "-m", "featcal_llm", "run", str(path), str(tmp_path / "here")], capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"calibrated checkpoint written to {tmp_path / 'here'}"
    assert (tmp_path / "here" / "model.safetensors").is_file() or (tmp_path / "here" / "model.safetensors.index.json").is_file()
    assert not Path(recipe["featcal"]["output"]).exists()
    assert "torch_dtype" not in result.stderr, result.stderr
    saved = yaml.safe_load((tmp_path / "here" / "featcal_recipe.yml").read_text())
    assert saved["featcal"]["output"] == str(tmp_path / "here")  # rerunning the saved recipe writes where this run did
    card = (tmp_path / "here" / "README.md").read_text()
    assert 'model_id = "here"' in card  # the usage snippet loads the output it describes
    snippet = re.search(r"## Usage\n```python\n(.*?)```", card, re.S).group(1).replace('model_id = "here"', f'model_id = "{tmp_path / "here"}"')
    used = subprocess.run([sys.executable, "-c", snippet.replace("max_new_tokens=64", "max_new_tokens=4")], capture_output=True, text=True)
    assert used.returncode == 0, used.stderr[-3000:]


def test_eval_says_the_model_is_missing_first(tmp_path):
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "no-such-model")])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.strip() == f"featcal-llm: error: eval: {tmp_path / 'no-such-model'}: model directory does not exist"


@pytest.mark.parametrize("option", ["--layers", "--experts", "--sequences", "--seq-len", "--hidden"])
def test_bench_refuses_a_zero_count_before_any_work(option):
    result = CliRunner().invoke(main, ["bench", option, "0"])
    assert result.exit_code == EXIT_USAGE and f"Invalid value for '{option}': 0 is not in the range x>=1." in result.output


def test_validate_flags_a_local_path_typo_with_did_you_mean(merged_scenario, tmp_path, monkeypatch):
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "code").symlink_to(next(iter(merged_scenario.experts.values())))
    recipe = yaml.safe_load(merged_scenario.recipe.read_text())
    old = recipe["models"][0]["model"]
    recipe["models"][0]["model"] = "experts/cod"
    recipe["featcal"]["data"]["experts/cod"] = recipe["featcal"]["data"].pop(old)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["validate", "r.yaml"])
    assert result.exit_code == EXIT_USAGE
    assert ("featcal-llm: error: r.yaml: models: experts/cod: model directory does not exist (experts/ is a local directory, "
            "so it is no hub id); did you mean 'experts/code'?") in result.stderr.splitlines(), result.stderr
    recipe["models"][0]["model"] = "someone/cod"  # no local directory `someone/`: a hub id, looked up only --online
    recipe["featcal"]["data"]["someone/cod"] = recipe["featcal"]["data"].pop("experts/cod")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert "someone/cod" in CliRunner().invoke(main, ["validate", "r.yaml"]).stderr.split("hub ids not looked up")[1]


def test_recipes_lists_and_prints_the_shipped_ones():
    listing = CliRunner().invoke(main, ["recipes"])
    assert listing.exit_code == 0
    names = [line.split()[0] for line in listing.output.splitlines()]
    assert {"demo", "demo-auto", "mergebench-llama-3.2-3b-ta-featcal", "mergebench-llama-3.1-8b-ta-featcal",
            "mergebench-llama-3.2-3b-ta-paper", "mergebench-llama-3.1-8b-ta-paper"} <= set(names), names
    assert "mergebench-llama-3.2-3b-ta-paper         The paper's setting, FeatCal on MergeBench, Llama-3.2-3B-Instruct (the FeatCal paper, Table 4)" in listing.output.splitlines()
    paper = yaml.safe_load(CliRunner().invoke(main, ["recipes", "mergebench-llama-3.2-3b-ta-paper"]).output)["featcal"]
    assert (paper["expert_weights"], paper["token_weights"], paper["head"]) == ("equal", "equal", False)
    text = CliRunner().invoke(main, ["recipes", "mergebench-llama-3.2-3b-ta-featcal"]).output
    assert yaml.safe_load(text)["merge_method"] == "task_arithmetic"
    from featcal_llm.io.block import FeatCalConfig

    for size in ("3.2-3b", "3.1-8b"):  # the -featcal recipes write featcal-llm's defaults out: they must be today's
        block = yaml.safe_load(CliRunner().invoke(main, ["recipes", f"mergebench-llama-{size}-ta-featcal"]).output)["featcal"]
        block.pop("eval")
        written = FeatCalConfig.model_validate(block)
        defaults = FeatCalConfig.model_validate({k: v for k, v in block.items() if k not in (
            "expert_weights", "token_weights", "trailing_experts", "trailing_records", "head")})
        said = lambda c: (c.balancing, c.token_weighting, c.trailing, c.trailing_records, c.head)  # noqa: E731
        assert {"expert_weights", "token_weights", "trailing_experts", "trailing_records", "head"} <= set(block)
        assert said(written) == said(defaults), size
    wrong = CliRunner().invoke(main, ["recipes", "mergebench-llama-3.2-3b-ta-featcl"])
    assert wrong.exit_code == EXIT_USAGE and "did you mean 'mergebench-llama-3.2-3b-ta-featcal'?" in wrong.stderr


def test_dash_h_survives_a_sub_command_used_on_its_own_first():
    """click caches a command's help option at its first use: a command run alone (as tests and scripts do) keeps -h."""
    from featcal_llm.cli import LAZY_COMMANDS

    for name, target in LAZY_COMMANDS.items():
        module, attribute = target.split(":")
        command = getattr(__import__(module, fromlist=[attribute]), attribute)
        assert CliRunner().invoke(command, ["-h"]).exit_code == 0, name
        assert CliRunner().invoke(main, [name, "-h"]).exit_code == 0, name


@pytest.mark.parametrize("arguments, message", [
    (["demo", "--quick", "--device", "tpu"], "featcal-llm: error: --device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["demo", "--quick", "--device", "auto"], "featcal-llm: error: --device auto: the demo takes cpu, cuda or cuda:N"),
    (["bench", "--layers", "1", "--hidden", "66", "--heads", "4"], "featcal-llm: error: --hidden 66: expected a multiple of --heads 4"),
    (["bench", "--layers", "1", "--heads", "4", "--kv-heads", "3"], "featcal-llm: error: --kv-heads 3: expected a divisor of --heads 4"),
    (["bench", "--layers", "1", "--lam", "-1"], "featcal-llm: error: --lam -1: expected a ridge above 0, as featcal.lambda"),
    (["bench", "--layers", "1", "--device", "tpu"], "featcal-llm: error: --device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
])
def test_demo_and_bench_refuse_bad_options_before_building_anything(tmp_path, monkeypatch, arguments, message):
    """Each had built data or checkpoints first, then failed with a traceback (or, --lam -1, run)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [*arguments, *(["--workdir", str(tmp_path / "w")])])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [message], result.output
    assert not (tmp_path / "w").exists() and list(tmp_path.iterdir()) == []


def test_an_interrupt_after_the_output_was_written_says_so(tmp_path, monkeypatch):
    """Stopped in `eval:` or the push: the output is in place and a rerun would be refused, so the line says what is there."""
    import featcal_llm.api

    output = tmp_path / "out"
    output.mkdir()
    (output / "featcal_recipe.yml").write_text("x: 1\n")

    def calibrate(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(featcal_llm.api, "calibrate", calibrate)
    (tmp_path / "r.yaml").write_text(f"featcal:\n  output: {output}\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")])
    assert result.exit_code == EXIT_INTERRUPTED and result.stderr.strip() == (
        f"featcal-llm: interrupted; {output} was written whole before the stop: rerun with --eval-only to run the recipe's "
        "eval: on it, or with --force to make it again")
    (tmp_path / ".out.featcal-partial").mkdir()  # a --force rerun stopped half-way: its progress resumes
    assert "the same command resumes from there" in CliRunner().invoke(main, ["run", str(tmp_path / "r.yaml")]).stderr


# ------------------------------------------------------------------ audit: eval, bench and demo arguments

def _model_dir(path: Path) -> Path:
    """Enough of a model folder for eval's checks that run before any model loads."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 1024}')
    (path / "model.safetensors").write_bytes(b"w")
    return path


def _one_line(result, *names: str, code: int = EXIT_USAGE) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal-llm: error: "), result.output
    assert all(name in lines[0] for name in names), lines[0]


def test_eval_refuses_an_engine_arg_value_that_is_not_yaml_in_one_line(tmp_path):
    model = _model_dir(tmp_path / "m")
    result = CliRunner().invoke(main, ["eval", str(model), "--tasks", "gsm8k", "--engine-arg", "x=[1"])
    _one_line(result, "--engine-arg")


@pytest.mark.parametrize("arguments, option", [
    (["--suite", "nosuch", "--tasks", "gsm8k"], "--suite"),
    (["--tasks", "nosuch"], "--tasks"),
    ([], "--allow-code-execution"),
])
def test_eval_section_errors_name_the_option_without_dumping_every_option(tmp_path, arguments, option):
    model = _model_dir(tmp_path / "m")
    result = CliRunner().invoke(main, ["eval", str(model), *arguments])
    _one_line(result, option)
    assert "(got {" not in result.stderr


@pytest.mark.parametrize("arguments, option", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--engine-arg", "no_such_key=1"], "--engine-arg"),
])
def test_eval_backend_refusals_name_the_command_line_option(tmp_path, monkeypatch, arguments, option):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _model_dir(tmp_path / "m")
    gsm8k = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench" / "gsm8k.jsonl"
    result = CliRunner().invoke(main, ["eval", str(model), "--tasks", "gsm8k", "--backend", "hf", "--device", "cpu",
                                       "--chat-template", "off", "--data", f"gsm8k={gsm8k}", "--output",
                                       str(tmp_path / "out"), *arguments])
    _one_line(result, option)
    assert not (tmp_path / "out").exists()


def test_eval_check_graders_refuses_models_it_would_not_score(tmp_path):
    model = _model_dir(tmp_path / "m")
    fixtures = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "evalplus"
    result = CliRunner().invoke(main, ["eval", str(model), "--check-graders",
                                       "--data", f"humaneval_plus={fixtures / 'humaneval_plus.jsonl'}",
                                       "--data", f"mbpp_plus={fixtures / 'mbpp_plus.jsonl'}"])
    assert result.exit_code == EXIT_USAGE and "--check-graders" in result.stderr, result.output


@pytest.mark.parametrize("command", [
    ["demo", "--quick"],
    ["bench", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--tokens", "256",
     "--layers", "1", "--no-generation"],
])
def test_a_workdir_under_a_file_is_refused_in_one_line(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(main, [*command, "--workdir", str(tmp_path / "afile" / "sub")])
    _one_line(result, "--workdir")


@pytest.mark.parametrize("value", ["-1", "0"])
def test_bench_refuses_a_non_positive_host_memory_budget(tmp_path, monkeypatch, value):
    from featcal_llm.benchmark import driver

    def not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(driver, "run_benchmark", not_run)
    result = CliRunner().invoke(main, ["bench", "--layers", "1", "--host-memory-gb", value,
                                       "--workdir", str(tmp_path / "w")])
    assert result.exit_code == EXIT_USAGE and "--host-memory-gb" in result.output, result.output


def test_eval_labels_that_make_one_file_name_are_refused(tmp_path):
    """`a b` and `a_b` would both write a_b.json: the second model's summary would replace (or hide) the first's."""
    model = _model_dir(tmp_path / "m")
    result = CliRunner().invoke(main, ["eval", f"a b={model}", f"a_b={model}", "--tasks", "gsm8k"])
    _one_line(result, "a_b=", "used twice", "'a_b'")
# ------------------------------------------------------------------ mutation round 8: tests a surviving mutation showed missing

def test_batch_size_option_is_a_positive_integer_or_auto():
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.cli import _batch_size

    assert (_batch_size(None), _batch_size("auto"), _batch_size("8"), _batch_size("1")) == (None, "auto", 8, 1)
    assert isinstance(_batch_size("8"), int)
    for value in ("0", "-1", "x", "2.5", "auto:4"):
        with pytest.raises(FeatCalError, match=rf"^--batch-size {value}: expected a positive integer or auto$"):
            _batch_size(value)


def test_task_pairs_need_a_task_and_a_value():
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.cli import _parse_pairs

    assert _parse_pairs(("gsm8k=a.jsonl", "ifeval=b=c.jsonl"), "--data") == {"gsm8k": "a.jsonl", "ifeval": "b=c.jsonl"}
    for value in ("gsm8k=", "=a.jsonl", "gsm8k"):
        with pytest.raises(FeatCalError, match=rf"^--data {value}: expected TASK=PATH$"):
            _parse_pairs((value,), "--data")
    with pytest.raises(FeatCalError, match=r"^--expert gsm8k=: expected TASK=LABEL$"):
        _parse_pairs(("gsm8k=",), "--expert")


def test_an_engine_arg_key_must_be_a_python_keyword_name():
    """vllm.LLM and lm-eval's hf model take keyword arguments: `max-num-seqs=8` can name none of them."""
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.cli import _engine_args

    with pytest.raises(FeatCalError, match=r"^--engine-arg max-num-seqs=8: expected KEY=VALUE$"):
        _engine_args(("max-num-seqs=8",))
    assert _engine_args(("max_num_seqs=8", "revision=")) == {"max_num_seqs": 8, "revision": ""}


def test_only_backend_refusals_are_put_in_option_words():
    from featcal_llm.errors import FeatCalError, RunFailure
    from featcal_llm.evaluation.cli import _in_option_words

    said = lambda text, kind=FeatCalError: (type(e := _in_option_words(kind(text))).__name__, str(e))  # noqa: E731
    assert said("backend.tensor_parallel_size: only the vllm backend shards a model") == (
        "FeatCalError", "--tensor-parallel-size: only the vllm backend shards a model")
    assert said("backend.engine_args.dtype: set by its own option, not through engine_args") == (
        "FeatCalError", "--engine-arg dtype: set by its own option, not through --engine-arg")
    assert said("backend.device: x", RunFailure) == ("RunFailure", "--device: x")
    # the same words elsewhere (a recipe key, a task's) are not the backend's
    for text in ("device: cuda:3 is busy", "max_model_len: x", "backend.name: x"):
        assert said(text) == ("FeatCalError", text)
