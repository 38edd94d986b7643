"""`head: auto` and tied heads: the head is left merged where every expert kept the base's and re-fitted where one
trained its own; Gemma-2's stays tied as vLLM serves it; RegMean never reads the heads."""

from __future__ import annotations

import json

import pytest
import torch
from test_exactness import read_weights

from featcal_llm.pipeline import run_recipe


def set_tensor(directory, name: str, tensor: torch.Tensor) -> None:
    """Replace one tensor of a (sharded) safetensors checkpoint in place."""
    from safetensors.torch import load_file, save_file

    index = directory / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    tensors = load_file(directory / shard)
    tensors[name] = tensor.to(tensors[name].dtype).contiguous()
    save_file(tensors, directory / shard, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def head_scenarios(tmp_path_factory):
    """(family, experts that keep the base's head) → a scenario and its head tensor: Llama's is untied, a tied Llama's
    and Gemma-2's are the input embedding they are tied to; the other experts keep the perturbation every weight of
    theirs has."""
    from scenario import build_scenario
    from test_exactness import scenario_family

    built = {}

    def get(family, keep):
        if (family, keep) not in built:
            scenario = build_scenario(tmp_path_factory.mktemp(f"auto-{family}"), experts=2, layers=2, samples=8, words=(4, 10),
                                      dtype="float64", **scenario_family(family))
            tensor = "lm_head.weight" if family == "llama" else "model.embed_tokens.weight"
            for name in keep:
                set_tensor(scenario.experts[name], tensor, read_weights(scenario.base)[tensor])
            built[family, keep] = (scenario, tensor)
        return built[family, keep]

    return get


def auto_recipe(scenario, path, **keys):
    """The scenario's recipe with `head:` as a user leaves it (not written), plus `keys`."""
    import yaml

    raw = yaml.safe_load(scenario.recipe.read_text())
    raw["featcal"].pop("head", None)
    raw["featcal"].update(dtype="float64", **keys)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_auto_leaves_the_head_merged_where_every_expert_kept_the_base_s(head_scenarios, family, tmp_path, capsys):
    scenario, tensor = head_scenarios(family, ("expert0", "expert1"))
    auto = run_recipe(auto_recipe(scenario, tmp_path / "auto.yaml", output=str(tmp_path / "auto")), progress=False)
    assert "the LM head stays merged, since every expert kept the base's" in capsys.readouterr().err
    off = run_recipe(auto_recipe(scenario, tmp_path / "off.yaml", output=str(tmp_path / "off"), head=False), progress=False)
    ours, without = read_weights(auto), read_weights(off)
    assert ours.keys() == without.keys() and all(torch.equal(ours[name], without[name]) for name in ours)
    assert torch.equal(ours[tensor], read_weights(scenario.base)[tensor])  # the merge of equal heads: the base's
    assert "The LM head keeps the merged model's weights (`head: auto`: every expert kept the base's)." in (auto / "README.md").read_text()


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_auto_refits_the_head_as_head_true_does_where_an_expert_trained_its_own(head_scenarios, family, tmp_path, capsys):
    scenario, tensor = head_scenarios(family, ("expert0",))
    auto = run_recipe(auto_recipe(scenario, tmp_path / "auto.yaml", output=str(tmp_path / "auto")), progress=False)
    assert "head: auto: the LM head is re-fitted after the last layer, since expert1 changed it from the base's" in capsys.readouterr().err
    always = run_recipe(auto_recipe(scenario, tmp_path / "always.yaml", output=str(tmp_path / "always"), head=True), progress=False)
    off = run_recipe(auto_recipe(scenario, tmp_path / "off.yaml", output=str(tmp_path / "off"), head=False), progress=False)
    ours, expected, without = read_weights(auto), read_weights(always), read_weights(off)
    assert ours.keys() == expected.keys() and all(torch.equal(ours[name], expected[name]) for name in ours)
    assert not torch.equal(ours["lm_head.weight"], read_weights(scenario.root / "merged").get("lm_head.weight", without[tensor]))
    card = (auto / "README.md").read_text()
    assert "the LM head was re-fitted the same way on the final norm's outputs (`head: auto`: `expert1` changed its LM head from the base's)" in card
    if family == "llama-tied":
        assert json.loads((auto / "config.json").read_text())["tie_word_embeddings"] is False


def test_gemma2s_head_stays_tied_as_vllm_serves_it(head_scenarios, tmp_path, capsys):
    """vLLM's Gemma-2 class asserts `tie_word_embeddings`: `head: auto` keeps the head merged and tied even where an
    expert trained it (the output is `head: false`'s, bit for bit), and `head: true` is refused by validate and run."""
    import featcal_llm
    from click.testing import CliRunner

    from featcal_llm.cli import main

    scenario, _ = head_scenarios("gemma2", ("expert0",))
    auto = run_recipe(auto_recipe(scenario, tmp_path / "auto.yaml", output=str(tmp_path / "auto")), progress=False)
    assert ("head: auto: the LM head stays merged, tied to the input embeddings: vLLM serves Gemma2ForCausalLM only tied"
            in capsys.readouterr().err)
    off = run_recipe(auto_recipe(scenario, tmp_path / "off.yaml", output=str(tmp_path / "off"), head=False), progress=False)
    ours, without = read_weights(auto), read_weights(off)
    assert "lm_head.weight" not in ours and ours.keys() == without.keys() and all(torch.equal(ours[n], without[n]) for n in ours)
    assert json.loads((auto / "config.json").read_text())["tie_word_embeddings"] is True
    refused = auto_recipe(scenario, tmp_path / "true.yaml", output=str(tmp_path / "true"), head=True)
    message = (f"{refused}: featcal.head: a re-fitted LM head is a tensor of its own, untied from the input embeddings, and "
               "vLLM serves Gemma2ForCausalLM only tied; set head: false or auto (which keep it tied)")
    assert [str(problem) for problem in featcal_llm.validate(refused)] == [message]
    result = CliRunner().invoke(main, ["run", str(refused)])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [f"featcal-llm: error: {message}"]
    assert not (tmp_path / "true").exists()


def test_regmean_never_reads_the_heads(head_scenarios, tmp_path, capsys):
    scenario, _ = head_scenarios("llama", ("expert0",))
    import yaml

    raw = yaml.safe_load(auto_recipe(scenario, tmp_path / "r.yaml").read_text())
    for key in ("lambda", "alpha", "rho"):
        raw["featcal"].pop(key)
    raw["featcal"].update(method="regmean", output=str(tmp_path / "out"), token_weights=None, expert_weights=None)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    output = run_recipe(tmp_path / "r.yaml", progress=False)
    assert "head: auto" not in capsys.readouterr().err
    assert torch.equal(read_weights(output)["lm_head.weight"], read_weights(scenario.root / "merged")["lm_head.weight"])
