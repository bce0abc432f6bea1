"""The LLM benchmarks that can measure a running server (`--url`) run `--smoke` against the
session's SmolLM2 server (`server_url`) instead of starting their own: the same toy-size run
and the same check of the summary's shape (never a speed) as tests/test_bench_smoke_llm.py,
one server start fewer each. (bench_lang's toy run on SmolLM2 costs more than its tiny-model
server starts: it stays in tests/test_bench_smoke_llm.py.)"""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import has_keys, last_json, run_smoke
from tests.needs import smollm2_folder

smollm2_folder(module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_client_apis(server_url):
    s = last_json(run_smoke("bench_client_apis", "--url", server_url))
    assert (s["requests"], s["rounds"], s["max_tokens"]) == (2, 1, 4)
    assert set(s["paths"]) == {"chat_completions", "responses", "messages", "ollama_chat"}
    for row in s["paths"].values():
        has_keys(row, "requests_per_s", "output_tokens_per_s", "ratio_to_chat_completions")
        assert re.fullmatch(r"[0-2]/2", row["answers_equal_chat"])
    assert s["paths"]["chat_completions"]["answers_equal_chat"] == "2/2"
