"""`genserve serve --tp 2` on CPU (gloo) with a tiny random Llama in SmolLM2's vocabulary (its
peaky logits leave no near-ties for the ranks' summation order to flip), through the official
openai client: the same greedy text as one rank, `tp_size` reported to the router, and a killed
rank turns the server to 503 instead of hanging it, and the gateway then restarts the group (a
new scheduler process, its restart counted) which answers as before."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from tests.needs import smollm2_folder
from tests.serve_process import serve_subprocess

pytestmark = pytest.mark.slow

smollm2_folder(module_level=True)  # the tiny model takes the embedded SmolLM2's tokenizer
MODEL = "tiny-chat"

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def model_path() -> str:
    from genserve.bench.tiny import tiny_chat_model

    return str(tiny_chat_model(init_std=0.2))


def test_serve_tp2_answers_like_one_rank_and_fails_503_when_a_rank_dies(model_path):
    import openai

    from genserve import Engine

    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with Engine(model_path, dtype="float32", max_total_tokens=1024) as engine:
        want = engine.generate(PROMPT, greedy)["text"]
    assert len(set(want.split())) >= 3, want  # a varied answer, not one token repeated
    flags = ("--no-diffusion", "--model-path", model_path, "--served-model-name", MODEL,
             "--tp", "2", "--device", "cpu", "--max-total-tokens", "2048")
    with serve_subprocess(*flags) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert info["tp_size"] == 2

        # Rank 1 is the scheduler process's child (rank 0 is the scheduler process).
        before = httpx.get(url + "/health", timeout=10).json()["runtimes"][info["model_name"]]
        assert before["pid"] == info["runtime"]["pid"] and before["restarts"] == 0
        scheduler = psutil.Process(info["runtime"]["pid"])
        worker = next(
            p for p in scheduler.children() if "resource_tracker" not in " ".join(p.cmdline())
        )
        worker.kill()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "the server never noticed the dead rank"
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 503
        assert proc.poll() is None  # the gateway lives on and restarts the group
        deadline = time.monotonic() + 300
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the group never came back"
            time.sleep(0.5)
        after = httpx.get(url + "/health", timeout=10).json()["runtimes"][info["model_name"]]
        assert after["restarts"] == 1 and after["pid"] != before["pid"], after
        assert not scheduler.is_running() or scheduler.status() == psutil.STATUS_ZOMBIE
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == want
