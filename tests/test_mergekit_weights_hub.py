"""A hub model lacking a tensor mergekit's architecture requires (Phi-4-mini itself is `microsoft/Phi-4-mini-instruct`:
Phi3ForCausalLM, tied, no `lm_head.weight`) is refused by `run` before the merge, in the line `validate` gives a local
copy of it, naming the snapshot folder. `validate` reads no hub checkpoint (offline it notes the id, with `--online`
it reads configs alone), so run checks the snapshot it resolved; it had handed it to mergekit, which stopped on
`Tensor lm_head.weight required but not present` (exit 1).

The hub is unreachable in tests: huggingface_hub's snapshot download is replaced by one that serves the local
scenario's folders, so the path through mergekit's own `ModelReference.local_path` is the real one.
"""

from __future__ import annotations

import huggingface_hub
import pytest
import yaml
from click.testing import CliRunner

from featcal_llm.cli import main

from agreement import error_lines
from scenario import build_scenario
from test_exactness import scenario_family


@pytest.fixture
def tied_phi3_on_the_hub(tmp_path, monkeypatch):
    """The tiny tied Phi-3 scenario, its base served as the hub's `org/phi3-tied`; the recipe naming it so."""
    scenario = build_scenario(tmp_path / "phi3", experts=2, layers=1, samples=4, **scenario_family("phi3-tied"))
    served = {"org/phi3-tied": str(scenario.base)}

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **_):
        return served[repo_id]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, repo_type="model", revision=None: ["config.json", "model.safetensors"])
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["base_model"] = "org/phi3-tied"
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return scenario, tmp_path / "hub.yaml"


def test_a_tied_phi3_from_the_hub_is_refused_by_run_before_the_merge_in_validate_s_words(tied_phi3_on_the_hub):
    scenario, recipe = tied_phi3_on_the_hub
    local = CliRunner().invoke(main, ["validate", str(scenario.recipe)])  # the same model as a local folder
    ran = CliRunner().invoke(main, ["run", str(recipe)])
    assert local.exit_code == 2 and ran.exit_code == 2, ran.output
    assert error_lines(ran) == [error_lines(local)[0].replace(str(scenario.recipe), str(recipe))], (ran.output, local.output)
    assert not (scenario.root / "merged").exists() and not (scenario.root / "featcal").exists()
