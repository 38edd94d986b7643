"""The hf backend's engine_args, checked before the calibration against the installed transformers and lm-eval sources
as lm-eval loads the model: the keys the loader consumes, the model class's own, and a model type of another module."""

from __future__ import annotations

import json

import pytest

from featcal_llm.errors import FeatCalError
from featcal_llm.evaluation import backends
from featcal_llm.evaluation.backends import plan_backend
from featcal_llm.evaluation.config import BackendSettings
from test_eval_backends import offline  # noqa: F401  (autouse: offline, one thread)


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
