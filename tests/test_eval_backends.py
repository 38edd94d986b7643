"""Backend choice and argument plumbing: what reaches lm-eval's hf / vllm classes and vllm.LLM.

No GPU here, so vLLM itself cannot run: a stand-in `vllm` package (same module layout and entry
points lm-eval's VLLM class imports) records what lm-eval passes to `vllm.LLM` and
`SamplingParams` when our worker drives it through a real `eval` run.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import backends
from featcal_llm.evaluation.backends import plan_backend, resolve_backend_name
from featcal_llm.evaluation.config import BackendSettings

FIXTURES = Path(__file__).resolve().parents[1] / "eval" / "fixtures" / "mergebench"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_vllm_model_args():
    settings = BackendSettings(name="vllm", tensor_parallel_size=2, gpu_memory_utilization=0.8, dtype="bfloat16")
    plan = plan_backend("vllm", settings, Path("/m"), context_length=4096, model_max_positions=131072)
    assert plan.model_args == {"pretrained": "/m", "dtype": "bfloat16", "tensor_parallel_size": 2,
                               "gpu_memory_utilization": 0.8, "max_model_len": 4096, "seed": 1234}
    assert plan.batch_size == "auto"
    assert plan.identity() == {"name": "vllm", "batch_size": "auto", "model_args": {
        "dtype": "bfloat16", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "max_model_len": 4096, "seed": 1234}}
    # auto asks each backend for the dtype the checkpoint names: vLLM's own auto serves a float32 one in bfloat16
    for backend in ("vllm", "hf"):
        args = plan_backend(backend, BackendSettings(device="cpu" if backend == "hf" else None), Path("/m"), 4096, None,
                            model_dtype="float32").model_args
        assert args["dtype"] == "float32", backend
    assert plan_backend("vllm", BackendSettings(dtype="float16"), Path("/m"), 4096, None, model_dtype="float32").model_args["dtype"] == "float16"
    assert plan_backend("vllm", BackendSettings(), Path("/m"), 4096, None).model_args["dtype"] == "auto"  # the config names none
    # capped at the model's positions unless the user sets it
    assert plan_backend("vllm", BackendSettings(), Path("/m"), 4096, 2048).model_args["max_model_len"] == 2048
    assert plan_backend("vllm", BackendSettings(max_model_len=8192), Path("/m"), 4096, 2048).model_args["max_model_len"] == 8192
    with pytest.raises(FeatCalError, match="backend.device: not used by vllm"):
        plan_backend("vllm", BackendSettings(device="cuda:1"), Path("/m"), 4096, None)


def test_vllm_data_parallel_engine_args_and_chat_args():
    settings = BackendSettings(name="vllm", data_parallel_size=2, engine_args={"enforce_eager": True, "max_num_seqs": 64})
    plan = plan_backend("vllm", settings, Path("/m"), 4096, None, {"date_string": "26 Jul 2024"})
    assert plan.model_args["data_parallel_size"] == 2
    assert (plan.model_args["enforce_eager"], plan.model_args["max_num_seqs"]) == (True, 64)
    assert plan.model_args["chat_template_args"] == {"date_string": "26 Jul 2024"}
    assert plan.identity()["model_args"]["data_parallel_size"] == 2  # part of the cache key
    assert "data_parallel_size" not in plan_backend("vllm", BackendSettings(), Path("/m"), 4096, None).model_args
    with pytest.raises(FeatCalError, match="backend.engine_args.dtype: set by its own option"):
        plan_backend("vllm", BackendSettings(engine_args={"dtype": "float16"}), Path("/m"), 4096, None)
    with pytest.raises(FeatCalError, match="backend.data_parallel_size: only the vllm backend"):
        plan_backend("hf", BackendSettings(data_parallel_size=2, device="cpu"), Path("/m"), 4096, None)


def test_every_model_arg_a_backend_sets_itself_is_one_engine_args_may_not_repeat(monkeypatch):
    """`check_settings` (what validate asks before the calibration) knows every key plan_backend writes."""
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    for name, settings in (("vllm", BackendSettings(data_parallel_size=2)), ("hf", BackendSettings())):
        args = plan_backend(name, settings, Path("/m"), 4096, 1024, {"date_string": "26 Jul 2024"}).model_args
        assert set(args) <= set(backends.OWN_ARGS[name]), (name, args)
        for key in args:
            with pytest.raises(FeatCalError, match=f"backend.engine_args.{key}: set by its own option"):
                backends.check_settings(name, BackendSettings(engine_args={key: 1}))


def test_engine_arg_option_parses_yaml_scalars():
    from featcal_llm.evaluation.cli import _engine_args

    assert _engine_args(("enforce_eager=true", "swap_space=4", "kv_cache_dtype=fp8")) == {
        "enforce_eager": True, "swap_space": 4, "kv_cache_dtype": "fp8"}
    with pytest.raises(FeatCalError, match="--engine-arg enforce-eager: expected KEY=VALUE"):
        _engine_args(("enforce-eager",))


def test_hf_model_args(monkeypatch):
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    plan = plan_backend("hf", BackendSettings(), Path("/m"), 4096, 1024)
    assert plan.model_args == {"pretrained": "/m", "dtype": "auto", "device": "cpu", "max_length": 1024}
    assert plan.batch_size == 1
    # how it decodes is part of what the cache is keyed by: answers cached under a checkpoint's own generation settings
    # (before the worker set them aside) are scored again
    assert plan.identity()["decoding"] == backends.HF_DECODING and "decoding" not in plan_backend(
        "vllm", BackendSettings(), Path("/m"), 4096, None).identity()
    with pytest.raises(FeatCalError, match="only the vllm backend shards"):
        plan_backend("hf", BackendSettings(tensor_parallel_size=2), Path("/m"), 4096, None)


def test_backend_resolution_and_missing_extras(monkeypatch):
    installed = {"lm_eval": True, "vllm": False, "torch": True, "transformers": True}
    monkeypatch.setattr(backends, "_installed", lambda name: installed[name])
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert resolve_backend_name(BackendSettings()) == "hf"
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    with pytest.raises(FeatCalError, match=r"auto picked vllm \(CUDA is present\) but vLLM is not installed; install the extra: pip install 'featcal-llm\[vllm\]'"):
        resolve_backend_name(BackendSettings())
    with pytest.raises(FeatCalError, match=r"--backend: vllm is not installed; install the extra"):
        resolve_backend_name(BackendSettings(name="vllm"))
    installed["vllm"] = True
    assert resolve_backend_name(BackendSettings()) == "vllm"
    installed["lm_eval"] = False
    with pytest.raises(FeatCalError, match=r"lm-eval is not installed; install the extra: pip install 'featcal-llm\[eval\]'"):
        resolve_backend_name(BackendSettings(name="hf"))


FAKE_VLLM = {
    "vllm/__init__.py": '''
        import json, os
        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
        class TokensPrompt(dict):
            pass
        class _Completion:
            def __init__(self, text):
                self.text = text
        class _Request:
            def __init__(self, text):
                self.outputs = [_Completion(text)]
        class _Engine:
            model_config = None
        def _log(entry):
            with open(os.environ["FAKE_VLLM_LOG"], "a") as handle:
                handle.write(json.dumps(entry) + "\\n")
        class LLM:
            def __init__(self, **kwargs):
                self.llm_engine = _Engine()
                _log({"LLM": kwargs})
            def generate(self, prompts, sampling_params=None, **kwargs):
                _log({"SamplingParams": [p.kwargs for p in sampling_params], "n": len(prompts)})
                return [_Request(" B") for _ in prompts]
    ''',
    "vllm/lora/__init__.py": "",
    "vllm/lora/request.py": "class LoRARequest:\n    pass\n",
    "vllm/tokenizers.py": '''
        def get_tokenizer(name, **kwargs):
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(name)
    ''',
    "vllm/renderers/__init__.py": "",
    "vllm/renderers/hf.py": "def resolve_chat_template(**kwargs):\n    return None\n",
    "vllm-0.12.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.12.0\n",
}


@pytest.mark.slow
def test_vllm_backend_plumbing_through_a_real_eval_run(tmp_path, monkeypatch, tiny_instruct_model):
    pytest.importorskip("lm_eval")
    from featcal_llm.cli import main

    fake = tmp_path / "fake_vllm"
    for name, text in FAKE_VLLM.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(textwrap.dedent(text))
    log = tmp_path / "vllm.log"
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    result = CliRunner().invoke(main, [
        "eval", str(tiny_instruct_model), "--backend", "vllm", "--tasks", "arc_challenge",
        "--gpu-memory-utilization", "0.5", "--output", str(tmp_path / "out"),
        "--data", f"arc_challenge={FIXTURES / 'arc_challenge.jsonl'}",
    ])
    assert result.exit_code == 0, result.output
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["LLM"] == {
        # "float32": the config's dtype, asked for by name (vLLM's own auto would serve this float32 model in bfloat16)
        "model": str(tiny_instruct_model), "revision": None, "dtype": "float32", "tokenizer": None,
        "tokenizer_mode": "auto", "tokenizer_revision": None, "trust_remote_code": False,
        "tensor_parallel_size": 1, "max_model_len": 1024, "max_num_seqs": None, "quantization": None,
        "seed": 1234, "enable_lora": False, "max_lora_rank": 16, "gpu_memory_utilization": 0.5,
    }
    sampling = calls[1]["SamplingParams"]
    assert calls[1]["n"] == 3 and len(sampling) == 3
    assert sampling[0]["max_tokens"] == 100 and sampling[0]["temperature"] == 0.0
    assert {"\n\n", "."} <= set(sampling[0]["stop"])
    summary = json.loads((tmp_path / "out" / "tiny-Instruct.json").read_text())
    assert summary["backend"]["name"] == "vllm"
    assert summary["tasks"]["arc_challenge"]["value"] == pytest.approx(1 / 3)  # " B" is right for item 1 only


def _fake_vllm(root: Path, engine_fields: list[str]) -> None:
    """A vllm package laid out as vLLM's: LLM's own keywords, then **kwargs for the EngineArgs dataclass."""
    (root / "vllm" / "entrypoints").mkdir(parents=True)
    (root / "vllm" / "engine").mkdir()
    (root / "vllm" / "__init__.py").write_text("raise ImportError('vllm is read, never imported, for its arguments')\n")
    (root / "vllm" / "entrypoints" / "llm.py").write_text(
        "class LLM:\n    def __init__(self, model, *, enforce_eager=False, swap_space=4, **kwargs):\n"
        "        self.worker = kwargs.get('worker_cls')\n"
        "        if 'disable_log_stats' not in kwargs:\n            kwargs['disable_log_stats'] = True\n"
        "        del kwargs['legacy_flag']\n")
    fields = "".join(f"    {name}: int = 0\n" for name in engine_fields)
    (root / "vllm" / "engine" / "arg_utils.py").write_text(f"import dataclasses\n\n@dataclasses.dataclass\nclass EngineArgs:\n{fields}")


def test_vllm_engine_args_are_checked_against_the_installed_sources(tmp_path, monkeypatch):
    """A misspelt key fails when vLLM builds its engine, after the calibration: check_settings (validate's and the
    run's check before any model loads) refuses it from lm-eval's, LLM's and EngineArgs' sources, never importing vllm."""
    from featcal_llm.evaluation import vllm_arguments

    _fake_vllm(tmp_path, ["model", "max_num_seqs", "kv_cache_dtype"])
    monkeypatch.syspath_prepend(str(tmp_path))
    vllm_arguments.vllm_argument_names.cache_clear()
    try:
        for key in ("enforce_eager", "max_num_seqs", "kv_cache_dtype", "worker_cls", "max_gen_toks", "swap_space",
                    "disable_log_stats", "legacy_flag"):  # read from **kwargs by .get, `in`, subscript, del
            backends.check_settings("vllm", BackendSettings(engine_args={key: 1}))  # LLM's, EngineArgs', lm-eval's own
        with pytest.raises(FeatCalError, match=r"^backend\.engine_args\.max_num_seq: not an argument of lm-eval's vllm "
                                               r"model, vllm\.LLM or vllm's EngineArgs \(did you mean max_num_seqs\?\)$"):
            plan_backend("vllm", BackendSettings(engine_args={"max_num_seq": 64}), Path("/m"), 4096, None)
        backends.check_settings("hf", BackendSettings(engine_args={"max_num_seq": 64}))  # hf passes model kwargs on
        (tmp_path / "vllm" / "engine" / "arg_utils.py").write_text("class Other:\n    pass\n")  # another layout: no check
        vllm_arguments.vllm_argument_names.cache_clear()
        backends.check_settings("vllm", BackendSettings(engine_args={"max_num_seq": 64}))
    finally:
        vllm_arguments.vllm_argument_names.cache_clear()


def test_engine_args_may_not_set_the_batch_size_vllms_max_length_or_its_model():
    """lm-eval passes batch_size beside model_args (a repeated keyword), refuses max_length with max_model_len, and
    hands vllm.LLM a `model` from engine_args in place of its own."""
    for name in ("vllm", "hf"):
        with pytest.raises(FeatCalError, match="backend.engine_args.batch_size: set by its own option"):
            backends.check_settings(name, BackendSettings(engine_args={"batch_size": 8}))
    with pytest.raises(FeatCalError, match="backend.engine_args.max_length: set by its own option"):
        backends.check_settings("vllm", BackendSettings(engine_args={"max_length": 8}))
    with pytest.raises(FeatCalError, match="backend.engine_args.model: set by its own option"):  # vllm.LLM's model: another one
        backends.check_settings("vllm", BackendSettings(engine_args={"model": "/another/model"}))


@pytest.mark.parametrize("config, dtype", [({"dtype": "float32"}, "float32"), ({"torch_dtype": "bfloat16"}, "bfloat16"),
                                           ({"text_config": {"dtype": "float16"}}, "float16"), ({}, None),
                                           ({"dtype": "auto"}, None), ({"dtype": "float32", "text_config": {}}, "float32"),
                                           ({"dtype": "float32", "text_config": None}, "float32")])
def test_the_config_dtype_is_read_from_either_configs_key(tmp_path, config, dtype):
    from featcal_llm.evaluation.modelinfo import config_dtype

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config_dtype(tmp_path) == dtype


def test_a_generation_budget_is_refused_where_it_leaves_the_prompt_no_room():
    """lm-eval's hf model asserts `max_length − max_gen_toks > 0` after loading the model (and its vLLM model would keep
    a nonsense slice of the prompt): a budget one below the context runs, the context itself is refused; the context
    is --max-model-len, else the suite's capped at the model's positions; a task that does not set a budget is not asked."""
    from featcal_llm.evaluation.backends import check_generation_room, context_tokens
    from featcal_llm.evaluation.suite import load_suite

    suite = load_suite("mergebench")
    assert suite.tasks["gsm8k"].generation_kwargs["max_gen_toks"] == 1024 and suite.context_length == 4096
    assert context_tokens(BackendSettings(), 4096, 1024) == 1024
    assert context_tokens(BackendSettings(), 4096, None) == context_tokens(BackendSettings(), 4096, 8192) == 4096
    assert context_tokens(BackendSettings(max_model_len=2048), 4096, 1024) == 2048
    check_generation_room(suite, ["gsm8k"], None, 1025)
    with pytest.raises(FeatCalError, match=r"^gsm8k: generates up to 1024 tokens .* a context of 1024 tokens"):
        check_generation_room(suite, ["gsm8k"], None, 1024)
    check_generation_room(suite, ["gsm8k"], 1023, 1024)  # --max-gen-toks replaces the suite's
    with pytest.raises(FeatCalError, match=r"^arc_challenge: .*--max-gen-toks \(eval.max_gen_toks\)"):
        check_generation_room(suite, ["arc_challenge", "gsm8k"], 4096, 1024)
    scored = suite.model_copy(update={"tasks": {"loglikelihood": suite.tasks["gsm8k"].model_copy(update={"generation_kwargs": {}})}})
    check_generation_room(scored, ["loglikelihood"], 4096, 1024)  # lm-eval's default budget (256) is not ours to check


# ------------------------------------------------------------------ mutation round 8: tests a surviving mutation showed missing

def test_hf_on_a_cuda_device_is_refused_where_this_machine_cannot_run_cuda(monkeypatch):
    from featcal_llm import hardware
    from featcal_llm.errors import FeatCalError
    from featcal_llm.evaluation.backends import check_settings
    from featcal_llm.evaluation.config import BackendSettings

    monkeypatch.setattr(hardware, "cuda_refusal", lambda: "CUDA is not available (torch is a CPU-only build)")
    with pytest.raises(FeatCalError, match=r"^backend\.device: cuda:1, but CUDA is not available \(torch is a CPU-only build\); use cpu$"):
        check_settings("hf", BackendSettings(device="cuda:1"))
    check_settings("hf", BackendSettings(device="cpu"))  # the CPU needs no CUDA
    monkeypatch.setattr(hardware, "cuda_refusal", lambda: None)
    check_settings("hf", BackendSettings(device="cuda:1"))


def test_hf_without_a_device_runs_on_cuda_where_it_is_present_with_lm_evals_auto_batch(monkeypatch):
    from featcal_llm.evaluation import backends
    from featcal_llm.evaluation.config import BackendSettings

    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    plan = backends.plan_backend("hf", BackendSettings(), Path("/m"), 4096, None)
    assert (plan.model_args["device"], plan.batch_size) == ("cuda", "auto")
    plan = backends.plan_backend("hf", BackendSettings(device="cpu"), Path("/m"), 4096, None)
    assert (plan.model_args["device"], plan.batch_size) == ("cpu", 1)
    assert backends.plan_backend("hf", BackendSettings(batch_size=4), Path("/m"), 4096, None).batch_size == 4
