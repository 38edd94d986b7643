"""Edges of io/mergekit_architecture.py that a mutation round found unpinned, each against mergekit's own API
(arch_info_for_config, all_weights): what it does with a config, the check reads alike or leaves to it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from featcal_llm.io.mergekit_architecture import definition_for


def test_a_config_naming_several_architectures_is_left_to_mergekit_which_refuses_it():
    """mergekit merges by one architecture name and refuses a config with several (`More than one architecture in
    config?`): no definition is chosen for it here (the first name's would check tensors mergekit never plans)."""
    from mergekit.architecture import arch_info_for_config

    for names in (["LlamaForCausalLM", "MistralForCausalLM"], ["LlamaForCausalLM", "LlamaForCausalLM"]):
        config = {"architectures": names, "model_type": "llama", "num_hidden_layers": 2}
        with pytest.raises(RuntimeError, match="More than one architecture"):
            arch_info_for_config(SimpleNamespace(**config))
        assert definition_for(config) is None
    single = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
    assert definition_for(single) is not None and arch_info_for_config(SimpleNamespace(**single)) is not None


def test_a_required_weight_s_tied_names_are_read_as_mergekit_reads_them():
    """No definition the installed mergekit ships gives a required weight tied names (its tied heads are optional), so
    the check against every shipped definition cannot tell whether they are read: phi3's definition with its head
    tied to the embedding, as a later mergekit could ship it, parsed by mergekit's own loader, is compared here."""
    import json

    from mergekit.architecture.json_definitions import _load_architecture_json

    from featcal_llm.io.mergekit_architecture import definitions, first_missing, required_weights

    [phi3] = [definition for definition in definitions()["Phi3ForCausalLM"] if definition.get("model_type") == "phi3"]
    tied = json.loads(json.dumps(phi3))
    [head] = [weight for weight in tied["post_weights"] if weight["name"] == "lm_head.weight"]
    assert not head.get("optional") and not head.get("tied_names")  # what makes a tied Phi-3 refused today
    head["tied_names"] = ["model.embed_tokens.weight"]
    config = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_hidden_layers": 2}
    theirs = _load_architecture_json(json.dumps(tied)).all_weights(SimpleNamespace(**config))
    expected = [(w.name, (w.name, *(w.aliases or ()), *(w.tied_names or ()))) for w in theirs if not w.optional]
    ours = required_weights(tied, config)
    assert ours == expected and ("lm_head.weight", ("lm_head.weight", "model.embed_tokens.weight")) in ours
    stored = {name for name, _ in ours if name != "lm_head.weight"}  # a tied checkpoint: no head stored
    assert first_missing(ours, stored) is None and first_missing(required_weights(phi3, config), stored)[0] == "lm_head.weight"


def test_a_tied_model_missing_another_weight_than_its_head_is_not_told_to_untie_it(tmp_path):
    """The untie advice is for the head a tied checkpoint does not store; any other missing weight of a tied model is
    a damaged or converted checkpoint, as for an untied one."""
    from featcal_llm.io.mergekit_architecture import missing_weight_refusal

    config = {"architectures": ["Phi3ForCausalLM"], "tie_word_embeddings": True}
    norm = missing_weight_refusal(tmp_path, config, ("model.norm.weight", ("model.norm.weight",)))
    assert norm == (f"{tmp_path}: stores no model.norm.weight, which mergekit's architecture for Phi3ForCausalLM requires "
                    "of every model it merges; a damaged or converted checkpoint? save it again with transformers")
    head = missing_weight_refusal(tmp_path, config, ("lm_head.weight", ("lm_head.weight",)))
    assert "tie_word_embeddings: false" in head and "damaged" not in head


def test_weight_names_with_layer_arithmetic_are_mergekit_s():
    """mergekit's templates allow ${layer_index+1}, ${layer_index-1}, ${num_layers+1} and ${num_layers-1}; the few
    shipped definitions that use any do so on optional weights, so a definition using each on required ones, parsed by
    mergekit's own loader, is compared here."""
    import json

    from mergekit.architecture.json_definitions import _load_architecture_json

    from featcal_llm.io.mergekit_architecture import required_weights

    weight = lambda name: {"name": name, "aliases": [name.replace("w.", "alias.")]}  # noqa: E731
    definition = {"model_type": "arith", "architectures": ["ArithForCausalLM"], "num_layers_config_key": "num_hidden_layers",
                  "pre_weights": [weight("w.first.${num_layers+1}")], "post_weights": [weight("w.last.${num_layers-1}")],
                  "layer_templates": {"weights": [weight("w.${layer_index}.next.${layer_index+1}"),
                                                  weight("w.${layer_index}.prev.${layer_index-1}")]}}
    config = {"architectures": ["ArithForCausalLM"], "model_type": "arith", "num_hidden_layers": 3}
    theirs = _load_architecture_json(json.dumps(definition)).all_weights(SimpleNamespace(**config))
    expected = [(w.name, (w.name, *(w.aliases or ()), *(w.tied_names or ()))) for w in theirs if not w.optional]
    assert required_weights(definition, config) == expected
    assert [name for name, _ in expected] == ["w.first.4", "w.0.next.1", "w.0.prev.-1", "w.1.next.2", "w.1.prev.0",
                                              "w.2.next.3", "w.2.prev.1", "w.last.2"]


def test_each_required_weight_a_checkpoint_lacks_is_refused_the_first_included(tmp_path):
    """A Llama checkpoint (mergekit's own list of the weights it plans, its optional ones left out) lacking any one of
    them is refused naming that one, the first of the list (the embedding) too; lacking none, it passes."""
    import numpy as np
    from mergekit.architecture import arch_info_for_config
    from safetensors.numpy import save_file

    from featcal_llm.errors import FeatCalError
    from featcal_llm.io.mergekit_architecture import check_mergekit_weights

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
    planned = [w.name for w in arch_info_for_config(SimpleNamespace(**config)).all_weights(SimpleNamespace(**config))
               if not w.optional]
    assert planned[0] == "model.embed_tokens.weight"
    save_file({name: np.zeros(1, dtype=np.float32) for name in planned}, str(tmp_path / "model.safetensors"))
    check_mergekit_weights(tmp_path, config, "m")
    for lacking in (planned[0], planned[1], planned[-1]):
        save_file({name: np.zeros(1, dtype=np.float32) for name in planned if name != lacking}, str(tmp_path / "model.safetensors"))
        with pytest.raises(FeatCalError, match=f"^m: {tmp_path}: stores no {lacking}, which mergekit's architecture"):
            check_mergekit_weights(tmp_path, config, "m")
