"""`python tests/without_test_extras.py ARGS...` runs `python -m featcal_llm ARGS...` as if the test extras (pytest,
hypothesis, lm-eval, evalplus) were not installed: importing any of them raises ModuleNotFoundError."""

import importlib.abc
import importlib.machinery
import runpy
import sys

TEST_EXTRAS = ("pytest", "_pytest", "hypothesis", "lm_eval", "evalplus")


class _Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (a test extra, hidden)", name=spec.name)

    def exec_module(self, module):
        pass


class _HideTestExtras(importlib.abc.MetaPathFinder):
    """Found (libraries that only probe for a module see it) but not importable."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in TEST_EXTRAS:
            return importlib.machinery.ModuleSpec(name, _Missing())
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, _HideTestExtras())
    sys.argv = ["featcal_llm", *sys.argv[1:]]
    runpy.run_module("featcal_llm", run_name="__main__")
