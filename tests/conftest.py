import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# one thread a worker when pytest-xdist runs several (PYTEST_XDIST_WORKER_COUNT), two otherwise; the processes a worker
# starts (the CLI, torchrun ranks, lm-eval's worker) inherit one thread too: two workers each starting a two-thread
# process on two cores spun OpenMP threads against each other (the suite took 950 s on two cores, 650 s with this)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

from scenario import build_scenario  # noqa: E402
from refine_scenario import closed_form, far_scenario, refined  # noqa: E402,F401  (refine's shared runs, once a session)

REPOSITORY = Path(__file__).resolve().parent.parent


def _working_tree_status() -> set[str] | None:
    """`git status` of the checkout, one line a path that differs from HEAD (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPOSITORY, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist), once
        session.config._tree_before = _working_tree_status()


def pytest_sessionfinish(session, exitstatus):
    """A test writes under its tmp_path, never into the checkout: test output once landed in eval/ and was committed."""
    before = getattr(session.config, "_tree_before", None)
    after = _working_tree_status() if before is not None else None
    if after is not None and after - before:
        session.config.get_terminal_writer().line(
            "tests left files in the checkout (write them under tmp_path): " + ", ".join(sorted(after - before)), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _digest_cache(tmp_path_factory):
    """Remembered file digests (io/identity.py) go to a temporary directory, not the user's cache."""
    import os

    os.environ["FEATCAL_CACHE_DIR"] = str(tmp_path_factory.mktemp("digests"))


@pytest.fixture(scope="session")
def scenario(tmp_path_factory):
    """Three experts, three layers, sharded checkpoints; merged by the first `run` that needs it."""
    return build_scenario(tmp_path_factory.mktemp("scenario"))


@pytest.fixture(scope="session")
def merged_scenario(scenario):
    """The scenario with its merged model built by mergekit."""
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    recipe = load_recipe(scenario.recipe)
    ensure_merged(recipe, scenario.root / "merged", "cpu")
    return scenario


@pytest.fixture(scope="session")
def family_scenarios(tmp_path_factory):
    """A tiny float64 scenario per family (test_exactness.FAMILIES: windows of 8, Gemma-2 at hidden 72), built once per session."""
    from test_exactness import scenario_family

    built = {}

    def get(family):
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            built[family] = build_scenario(root, experts=2, layers=2, samples=12, words=(4, 10), dtype="float64", **scenario_family(family))
        return built[family]

    return get


@pytest.fixture(scope="module")
def tiny_model():
    """A two-layer Llama in float64 with a 64-token vocabulary, for pure pieces that need a real forward."""
    from featcal_llm.tiny import new_tiny_llama, tiny_llama_config

    config = tiny_llama_config(64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8)
    return new_tiny_llama(config, seed=3).double().eval()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to open a weight file, or to reach the hub, fails the test (validate's promise: tests/test_validate*.py)."""
    import builtins

    import huggingface_hub
    import safetensors
    import safetensors.torch
    import torch
    from mergekit.common import ModelReference

    import featcal_llm.io.checkpoint
    import featcal_llm.io.lora

    def refuse(*args, **kwargs):
        raise AssertionError(f"weights opened: {args[:1]}")

    for module, name in [
        (safetensors, "safe_open"), (safetensors.torch, "safe_open"), (safetensors.torch, "load_file"), (torch, "load"),
        (featcal_llm.io.checkpoint, "safe_open"), (featcal_llm.io.lora, "safe_open"), (ModelReference, "local_path"),
        (huggingface_hub.HfApi, "model_info"), (huggingface_hub.HfApi, "dataset_info"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if str(file).endswith(WEIGHT_SUFFIXES):
            raise AssertionError(f"weight file opened: {file}")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two experts, two layers, merged once a module (tests/test_api*.py, test_run_display.py)."""
    from featcal_llm.io.merge import ensure_merged
    from featcal_llm.io.recipe import load_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("api"), experts=2, layers=2, samples=8)
    ensure_merged(load_recipe(scenario.recipe), scenario.root / "merged", "cpu")
    return scenario


@pytest.fixture(scope="module")
def tiny_instruct_model(tmp_path_factory):
    """A random tiny Llama with a chat template, named like an -Instruct model (the evaluation's tests)."""
    from featcal_llm.tiny import (
        build_char_tokenizer,
        new_tiny_llama,
        save_model,
        tiny_llama_config,
    )

    tokenizer = build_char_tokenizer()
    model = new_tiny_llama(tiny_llama_config(len(tokenizer), max_position_embeddings=1024), seed=0)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny-Instruct")


@pytest.fixture
def count_samplers(monkeypatch):
    """How many times an expert model was opened for sampling (0 on a cache hit): tests/test_generate*.py."""
    from featcal_llm.generation import run as generation_run

    opened = []
    original = generation_run.open_sampler
    monkeypatch.setattr(generation_run, "open_sampler", lambda *a, **k: opened.append(a[1].reference) or original(*a, **k))
    return opened


@pytest.fixture(scope="session")
def uneven(tmp_path_factory):
    """Three experts of 7, 7 and 1 records, float64, norms and biases calibrated; merged once, and the one-process run
    the ranks of tests/test_distributed*.py are compared with."""
    import yaml

    from featcal_llm.pipeline import run_recipe

    scenario = build_scenario(tmp_path_factory.mktemp("dist"), experts=3, layers=2, samples=7, words=(4, 10), dtype="float64")
    recipe = yaml.safe_load(scenario.recipe.read_text())
    recipe["featcal"]["data"][str(scenario.experts["expert2"])]["samples"] = 1
    recipe["featcal"].update(dtype="float64", norms=True, batch_tokens=150)
    scenario.recipe.write_text(yaml.safe_dump(recipe, sort_keys=False))
    single = run_recipe(scenario.write_recipe(scenario.root / "single.yaml", output=str(scenario.root / "single")), progress=False)
    return scenario, single


@pytest.fixture(scope="module")
def reuse_scenario(tmp_path_factory):
    """Two experts, two layers, short records, not merged yet (tests/test_reuse*.py: what a rerun reuses)."""
    return build_scenario(tmp_path_factory.mktemp("reuse"), experts=2, layers=2, samples=4, words=(2, 6))


@pytest.fixture()
def fake_worker(monkeypatch):
    """Writes a cache entry per pending task, as the worker would after lm-eval (tests/test_eval_cache.py, test_leaderboard_refusals.py)."""
    from featcal_llm.evaluation import cache, runner

    runs = []

    def run_worker(job, output, label, echo):
        runs.append([task["id"] for task in job["tasks"]])
        for task in job["tasks"]:
            metric = task["metric"].split(",")
            record = {"key_fields": task["key_fields"], "task": {"id": task["id"], "metric": task["metric"], "value": 0.5},
                      "metrics": {task["metric"]: 0.5, f"{metric[0]}_stderr,{metric[1]}": 0.1},
                      "lm_eval": {"n-samples": {"original": 4, "effective": 4}}}
            cache.write_entry(Path(task["dir"]), record, [])

    monkeypatch.setattr(runner, "_run_worker", run_worker)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return runs
