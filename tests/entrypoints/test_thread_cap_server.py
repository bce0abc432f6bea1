"""An LLM-only `genserve serve` (the session's SmolLM2 server) splits only the cores
OMP_NUM_THREADS allows: under `pytest -n 2` each worker and its servers get one core, and a
server that took both would run two OpenMP threads on a core the other worker keeps busy."""

from __future__ import annotations

import os

import httpx
import pytest

from genserve.thread_split import available_cores, split_threads
from tests.needs import smollm2_folder

smollm2_folder(module_level=True)
pytestmark = pytest.mark.slow


def test_an_llm_only_server_runs_the_threads_its_environment_allows(server_url):
    info = httpx.get(server_url + "/get_server_info", timeout=30).json()
    # The server inherited this process's environment (tests/conftest.py sets the variable
    # under -n), so it sees the same cores.
    assert info["thread_split"] == split_threads(available_cores(), 1, False).as_dict()
    assert info["num_threads"] == info["thread_split"]["llm_threads"]
    cap = os.environ.get("OMP_NUM_THREADS", "")
    if cap.isdigit() and int(cap) > 0:
        assert info["num_threads"] <= int(cap)
