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


@pytest.fixture(scope="module")
def tiny_instruct_model(tmp_path_factory):
    """A random tiny Llama with a chat template, named like an -Instruct model."""
    from featcal_llm.tiny import (
        build_char_tokenizer,
        new_tiny_llama,
        save_model,
        tiny_llama_config,
    )

    tokenizer = build_char_tokenizer()
    model = new_tiny_llama(tiny_llama_config(len(tokenizer), max_position_embeddings=1024), seed=0)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny-Instruct")


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


# what a Llama checkpoint's config.json says (the tiny model's keys, as save_pretrained writes them)
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "vocab_size": 100,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "use_cache": True}
# keys that load a Llama through lm-eval's HFLM: its own, the loaders' (parameters, popped from **kwargs, in a loop over
# a list of names), attributes of the config (fields, settable properties, the base config's)
HF_KEYS = {"attn_implementation": "eager", "low_cpu_mem_usage": True, "device_map": "cpu", "use_cache": False,
           "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "max_memory": {"cpu": "1GiB"},
           "parallelize": False, "add_bos_token": True, "output_hidden_states": False, "revision": "main",
           "variant": None, "use_safetensors": True, "tie_word_embeddings": False, "num_labels": 2,
           "experts_implementation": None, "max_batch_size": 4}
FOO = ("backend.engine_args.foo: not an argument of lm-eval's hf model, transformers' from_pretrained or the model's "
       "config")


def test_hf_engine_args_are_checked_against_the_installed_sources(tmp_path, monkeypatch):
    """A key the hf model does not take fails in the evaluation worker, after the calibration, with the model's
    TypeError: check_settings refuses it from lm-eval's, transformers' and the model config's sources (one line, the
    nearest key), and plan_backend from the scored model's config.json, never importing transformers."""
    import sys

    from featcal_llm.evaluation import hf_arguments

    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    heavy = {name for name in ("torch", "transformers", "lm_eval") if name in sys.modules}
    for key, value in {**HF_KEYS, "peft": "/adapter", "delta": "/delta", "rope_parameters": None, "hidden_size": 64,
                       "id2label": None, "code_revision": None, "key_mapping": None, "trust_remote_code": False}.items():
        backends.check_settings("hf", BackendSettings(engine_args={key: value}), LLAMA_CONFIG)
    backends.check_settings("hf", BackendSettings(engine_args=HF_KEYS), LLAMA_CONFIG)
    with pytest.raises(FeatCalError) as refused:
        backends.check_settings("hf", BackendSettings(engine_args={"foo": 1}), LLAMA_CONFIG)
    assert str(refused.value) == FOO
    with pytest.raises(FeatCalError) as refused:
        backends.check_settings("hf", BackendSettings(engine_args={"attn_implementaton": "eager"}), LLAMA_CONFIG)
    assert str(refused.value) == ("backend.engine_args.attn_implementaton: not an argument of lm-eval's hf model, "
                                  "transformers' from_pretrained or the model's config (did you mean attn_implementation?)")
    for key in ("lora_rnak", "rope_theta", "load_in_4bit", "use_return_dict"):  # a TypeError (a read-only property's
        with pytest.raises(FeatCalError, match=rf"^backend\.engine_args\.{key}: not an argument of lm-eval's hf model"):
            backends.check_settings("hf", BackendSettings(engine_args={key: 1}), LLAMA_CONFIG)  # AttributeError) there
    with pytest.raises(FeatCalError) as refused:  # HFLM hands _create_model its own: "got multiple values"
        backends.check_settings("hf", BackendSettings(engine_args={"quantization_config": None}), LLAMA_CONFIG)
    assert str(refused.value) == ("backend.engine_args.quantization_config: lm-eval's hf model passes quantization_config "
                                  "to its loader itself; it cannot be given in engine_args")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    with pytest.raises(FeatCalError) as refused:  # the eval command's check, before the worker starts
        plan_backend("hf", BackendSettings(engine_args={"foo": 1}), model, 4096, None)
    assert str(refused.value) == FOO
    assert plan_backend("hf", BackendSettings(engine_args={"use_cache": False}), model, 4096, None).model_args["use_cache"] is False
    # nothing is refused where the model's config cannot be read, or its model type's config class is not transformers'
    backends.check_settings("hf", BackendSettings(engine_args={"foo": 1}))
    plan_backend("hf", BackendSettings(engine_args={"foo": 1}), tmp_path / "none", 4096, None)
    backends.check_settings("hf", BackendSettings(engine_args={"foo": 1}), {**LLAMA_CONFIG, "model_type": "remote_code_model"})
    backends.check_settings("hf", BackendSettings(engine_args={"foo": 1}), {**LLAMA_CONFIG, "foo": 1})  # config.json's own key
    assert {name for name in ("torch", "transformers", "lm_eval") if name in sys.modules} == heavy

    # a source laid out otherwise: no check
    monkeypatch.setattr(hf_arguments, "source_file", lambda module: tmp_path / "other.py")
    (tmp_path / "other.py").write_text("class Other:\n    pass\n")
    hf_arguments.hf_loader_names.cache_clear()
    try:
        backends.check_settings("hf", BackendSettings(engine_args={"foo": 1}), LLAMA_CONFIG)
    finally:
        monkeypatch.undo()
        hf_arguments.hf_loader_names.cache_clear()


# an old Llama's config.json: rope_theta at the top (transformers 5 moves it into rope_parameters), a generation
# parameter (dropped on loading), and a key of its own (kept as an attribute)
OLD_LLAMA_CONFIG = {**{k: v for k, v in LLAMA_CONFIG.items() if k != "rope_parameters"}, "rope_theta": 500000.0,
                    "temperature": 0.6, "top_k": 20, "my_own_key": 1}


def test_hf_engine_args_config_keys_the_loader_consumes_are_refused(monkeypatch):
    """A key of the model's config.json is taken (the loaded config keeps it as an attribute that engine_args sets),
    except those the config's loader consumes: there the key reaches the model's constructor, a TypeError at load."""
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    backends.check_settings("hf", BackendSettings(engine_args={"my_own_key": 2, "use_cache": False}), OLD_LLAMA_CONFIG)
    for key in ("rope_theta", "temperature", "top_k"):
        with pytest.raises(FeatCalError, match=rf"^backend\.engine_args\.{key}: not an argument of lm-eval's hf model"):
            backends.check_settings("hf", BackendSettings(engine_args={key: 1}), OLD_LLAMA_CONFIG)


def test_hf_loader_keys_are_read_from_kwargs_as_transformers_reads_them(tmp_path, monkeypatch):
    """transformers 5 pops some keys in a loop over a list of names (`for name in [...]: kwargs.pop(name)`, and a
    comprehension over a list it named): those keys are taken, the others of the list too, and none beside them."""
    from featcal_llm.evaluation import hf_arguments

    sources = {
        "lm_eval.models.huggingface": "class HFLM:\n    def __init__(self, pretrained, peft=None, **kwargs):\n"
                                      "        self._create_model(pretrained=pretrained, peft=peft, gpus=0, **kwargs)\n"
                                      "    def _create_model(self, pretrained, peft=None, gpus=None, **kwargs):\n"
                                      "        kwargs.get('device_map')\n",
        "transformers.models.auto.auto_factory": "class _BaseAutoModelClass:\n"
                                                 "    def from_pretrained(cls, path, *model_args, **kwargs):\n"
                                                 "        hub = ['cache_dir', 'proxies']\n"
                                                 "        hub_kwargs = {name: kwargs.pop(name) for name in hub if name in kwargs}\n",
        "transformers.modeling_utils": "class PreTrainedModel:\n    def from_pretrained(cls, path, *, revision='main', **kwargs):\n"
                                       "        for name in ['mirror', 'low_cpu_mem_usage']:\n            kwargs.pop(name, None)\n",
        "transformers.configuration_utils": "class PreTrainedConfig:\n    def _get_config_dict(cls, path, **kwargs):\n"
                                            "        kwargs.pop('_configuration_file', None)\n"}
    for index, text in enumerate(sources.values()):
        (tmp_path / f"source{index}.py").write_text(text)
    files = {module: tmp_path / f"source{index}.py" for index, module in enumerate(sources)}
    monkeypatch.setattr(hf_arguments, "source_file", files.get)
    hf_arguments.hf_loader_names.cache_clear()
    try:
        taken, repeated = hf_arguments.hf_loader_names()
        assert taken == {"pretrained", "peft", "device_map", "cache_dir", "proxies", "revision", "mirror",
                         "low_cpu_mem_usage", "_configuration_file"}
        assert repeated == {"gpus"}
    finally:
        monkeypatch.undo()
        hf_arguments.hf_loader_names.cache_clear()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_hf_engine_args_the_check_takes_load_and_those_it_refuses_fail_in_lm_eval(tiny_instruct_model):
    """The check against what really happens: lm-eval's HFLM loads the tiny Llama with every key the check takes
    (and with `delta`, another model of its shape), and raises the TypeError the worker would for each it refuses."""
    from lm_eval.models.huggingface import HFLM

    config = json.loads((tiny_instruct_model / "config.json").read_text())
    accepted = {**HF_KEYS, "delta": str(tiny_instruct_model)}
    backends.check_settings("hf", BackendSettings(engine_args=accepted), config)
    model = HFLM(pretrained=str(tiny_instruct_model), device="cpu", batch_size=1, **accepted)
    assert model.model.config.use_cache is False and model.model.config.rope_parameters["rope_type"] == "linear"
    for key, value in (("foo", 1), ("lora_rnak", 8), ("rope_theta", 10000.0), ("quantization_config", None)):
        with pytest.raises(FeatCalError, match=rf"^backend\.engine_args\.{key}: "):
            backends.check_settings("hf", BackendSettings(engine_args={key: value}), config)
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{key}'|multiple values for keyword argument '{key}'"):
            HFLM(pretrained=str(tiny_instruct_model), device="cpu", batch_size=1, **{key: value})


@pytest.mark.slow
def test_hf_engine_args_an_old_config_s_consumed_keys_fail_in_lm_eval_and_its_own_key_loads(tiny_instruct_model, tmp_path):
    """An old-style config.json (top-level rope_theta, generation parameters, a key of its own): HFLM loads it with its
    own key set, and raises the TypeError for each consumed key the check refuses."""
    import shutil

    from lm_eval.models.huggingface import HFLM

    model = shutil.copytree(tiny_instruct_model, tmp_path / "old")
    config = json.loads((model / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.update(rope_theta=theta, temperature=0.6, top_k=20, my_own_key=1)
    (model / "config.json").write_text(json.dumps(config))
    backends.check_settings("hf", BackendSettings(engine_args={"my_own_key": 2}), config)
    assert HFLM(pretrained=str(model), device="cpu", batch_size=1, my_own_key=2).model.config.my_own_key == 2
    for key, value in (("rope_theta", 10000.0), ("temperature", 0.7), ("top_k", 5)):
        with pytest.raises(FeatCalError, match=rf"^backend\.engine_args\.{key}: "):
            backends.check_settings("hf", BackendSettings(engine_args={key: value}), config)
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{key}'"):
            HFLM(pretrained=str(model), device="cpu", batch_size=1, **{key: value})


def test_hf_engine_args_module_names_are_transformers_own():
    """A model type whose folder under transformers/models/ is not its own name (gemma3_text lives in gemma3/, as every
    text half of a multimodal family does) is found through transformers' own table, read from its source without an
    import: the same table transformers' model_type_to_module_name looks up. Without it, such a type's engine_args were
    not checked at all."""
    from transformers.models.auto.configuration_auto import SPECIAL_MODEL_TYPE_TO_MODULE_NAME

    from featcal_llm.evaluation import hf_arguments

    assert hf_arguments._special_modules() == dict(SPECIAL_MODEL_TYPE_TO_MODULE_NAME)
    names = hf_arguments.config_attribute_names("gemma3_text")
    assert names is not None and {"query_pre_attn_scalar", "sliding_window", "final_logit_softcapping"} <= names


@pytest.mark.slow
def test_hf_engine_args_of_a_model_type_in_another_module_are_checked_as_lm_eval_loads_them(tmp_path):
    """A tiny Gemma-3 text model (model_type gemma3_text, in transformers' gemma3 module): HFLM loads it with a key of
    its config, and raises the TypeError for a key the check refuses."""
    from lm_eval.models.huggingface import HFLM
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from featcal_llm.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    model_dir = tmp_path / "gemma3"
    Gemma3ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["model_type"] == "gemma3_text"
    backends.check_settings("hf", BackendSettings(engine_args={"query_pre_attn_scalar": 8}), saved)
    assert HFLM(pretrained=str(model_dir), device="cpu", batch_size=1, query_pre_attn_scalar=8).model.config.query_pre_attn_scalar == 8
    with pytest.raises(FeatCalError, match=r"^backend\.engine_args\.foo: not an argument of lm-eval's hf model"):
        backends.check_settings("hf", BackendSettings(engine_args={"foo": 1}), saved)
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        HFLM(pretrained=str(model_dir), device="cpu", batch_size=1, foo=1)


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
