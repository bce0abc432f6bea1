"""`genserve serve --speculative-algorithm ngram|draft|eagle` end to end: the official openai client
gets the same greedy answer whether the request speculates or decodes plainly (a zero logit
bias makes it decode plainly on the same server), drafts are accepted (on an answer that
copies its prompt for n-gram; from the served model itself as its own draft), and the pool is
whole afterwards. The n-gram server is the session's default one (SmolLM2); the draft and EAGLE
servers run a tiny random model in SmolLM2's vocabulary, the EAGLE one with a random head
written in the EAGLE-1/2 layout: its drafts are verified (and mostly rejected) without changing
an answer, stop strings included."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve_process import serve_process

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# A logit bias, even of zero, makes a request decode plainly (verify.can_speculate).
PLAIN = {"0": 0}
IGNORE_EOS = {"ignore_eos": True}

CODE = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n")


@pytest.fixture(scope="module")
def tiny_model() -> str:
    """The draft and EAGLE servers' model: a tiny random Llama in SmolLM2's vocabulary and chat
    template, peaky enough that speculation and plain decoding cannot part on a near-tie."""
    from genserve.bench.tiny import tiny_chat_model

    return str(tiny_chat_model(init_std=0.2))


@pytest.fixture(scope="module")
def url(default_models_server):
    # The session's default server (tests/entrypoints/conftest.py): `--speculative-algorithm
    # ngram` and no model named, so the default vision model serves beside SmolLM2, decoding
    # plainly.
    return default_models_server



def test_speculation_keeps_greedy_answers_and_accepts_drafts(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "user", "content": "Rename the variable `total` to `acc` in this "
                 f"function and return the whole function:\n```python\n{CODE}```"}]
    spec = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64,
                                          temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64,
                                           temperature=0, logit_bias=PLAIN)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    info = httpx.get(f"{url}/get_server_info?model={MODEL}", timeout=30).json()
    stats = info["stats"]
    assert stats["spec_accepted_tokens"] > 0, stats
    assert stats["decode_steps"] < stats["generated_tokens"]

    streamed = client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=64, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == spec.choices[0].message.content
    # Idle: every KV slot is free or in the prefix cache; rejected drafts' slots came back.
    info = httpx.get(f"{url}/get_server_info?model={MODEL}", timeout=30).json()
    assert info["available_tokens"] + info["cache"]["total_tokens"] == info["max_total_tokens"]


def _engine_from_serve_flags(*flags: str):
    """(the engine arguments `genserve serve <flags>` gives its first LLM, a function starting
    that engine in this process): a start-up refusal is raised here without a server start.
    How `genserve serve` reports an engine's start-up refusal (its message on stderr and a
    non-zero exit) is test_serve_start_failure.py's
    `test_a_later_llm_failing_to_start_exits_and_stops_the_earlier_one`."""
    import dataclasses

    from genserve import Engine
    from genserve.entrypoints.cli import build_parser
    from genserve.entrypoints.serve import llm_engine_args, llm_paths

    args = build_parser().parse_args(["serve", *flags])
    engine_args = llm_engine_args(args, llm_paths(args)[0])
    return engine_args, lambda: Engine(**dataclasses.asdict(engine_args))


def test_a_vision_model_refuses_speculation_at_start():
    """`genserve serve`'s engine arguments for a named vision model keep the flag (only a
    default one drops it) and the engine refuses them at start."""
    engine_args, start = _engine_from_serve_flags("--model-path", "shapes-vl",
                                                  "--speculative-algorithm", "ngram")
    assert engine_args.speculative_algorithm == "ngram"
    # The default one decodes plainly beside the text model (the n-gram server above serves
    # both; the draft and EAGLE servers name their one model).
    from genserve.entrypoints.cli import build_parser
    from genserve.entrypoints.serve import llm_engine_args

    args = build_parser().parse_args(["serve", "--speculative-algorithm", "draft",
                                      "--speculative-draft-model-path", MODEL])
    assert llm_engine_args(args, None).speculative_algorithm == "draft"
    plain = llm_engine_args(args, "shapes-vl")
    assert plain.speculative_algorithm is None and plain.speculative_draft_model_path is None
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        start()


def test_a_draft_model_server_keeps_greedy_answers(tiny_model):
    # The one model named, drafting for itself: not the default vision model beside it (the
    # n-gram server's).
    with serve_process("--model-path", tiny_model, "--speculative-algorithm", "draft",
                       "--speculative-draft-model-path", tiny_model,
                       "--speculative-num-steps", "3", "--max-total-tokens", "4096") as u:
        client = openai.OpenAI(base_url=f"{u}/v1", api_key="none")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        spec = client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                              temperature=0, extra_body=IGNORE_EOS)
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                               temperature=0, logit_bias=PLAIN,
                                               extra_body=IGNORE_EOS)
        assert spec.choices[0].message.content == plain.choices[0].message.content
        info = httpx.get(f"{u}/get_server_info?model={model}", timeout=30).json()
        assert info["stats"]["spec_accepted_tokens"] > 0, info["stats"]
        assert info["available_tokens"] + info["cache"]["total_tokens"] == info["max_total_tokens"]


def test_a_missing_draft_model_is_refused_at_start():
    engine_args, start = _engine_from_serve_flags(
        "--speculative-algorithm", "draft", "--speculative-draft-model-path", "/no/such/draft")
    assert engine_args.speculative_draft_model_path == "/no/such/draft"
    with pytest.raises(ValueError, match="--speculative-draft-model-path '/no/such/draft'"):
        start()


def test_an_eagle_server_keeps_greedy_answers_and_stop_strings(tiny_model, tmp_path):
    from pathlib import Path

    from tests.srt.test_speculative_eagle import write_eagle_head

    head = write_eagle_head(tmp_path / "eagle", Path(tiny_model))
    with serve_process("--model-path", tiny_model, "--speculative-algorithm", "eagle",
                       "--speculative-draft-model-path", str(head),
                       "--speculative-num-steps", "3", "--max-total-tokens", "4096") as u:
        client = openai.OpenAI(base_url=f"{u}/v1", api_key="none")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        spec = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                              temperature=0, extra_body=IGNORE_EOS)
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                               temperature=0, logit_bias=PLAIN,
                                               extra_body=IGNORE_EOS)
        answer = spec.choices[0].message.content
        assert answer == plain.choices[0].message.content
        stop = answer.split()[3]
        cut = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                             temperature=0, stop=[stop], extra_body=IGNORE_EOS)
        assert answer.index(stop) > 0, (answer, stop)  # the cut keeps some text
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == answer[: answer.index(stop)]
        info = httpx.get(f"{u}/get_server_info?model={model}", timeout=30).json()
        assert info["stats"]["spec_verify_steps"] > 0, info["stats"]
        assert info["available_tokens"] + info["cache"]["total_tokens"] == info["max_total_tokens"]
