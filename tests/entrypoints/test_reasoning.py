"""--reasoning-parser: <think>...</think> goes to reasoning_content, whole and streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import openai
import pytest

from genserve.entrypoints.openai_api.reasoning import ReasoningParser, ReasoningStreamer
from genserve.srt.messages import GenerateOutput, GenerateRequest
from tests.entrypoints.gateway_fakes import FakeEngine

THOUGHT = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"


def test_split_whole_outputs():
    r1, qwen = ReasoningParser("deepseek-r1"), ReasoningParser("qwen3")
    assert r1.split(THOUGHT) == ("The user greets me. I greet back.", "Hello there!")
    assert r1.split("thinking without the opener</think>Answer") == (
        "thinking without the opener", "Answer")
    assert r1.split("cut off while thin") == ("cut off while thin", "")
    assert qwen.split(THOUGHT) == ("The user greets me. I greet back.", "Hello there!")
    assert qwen.split("No thinking here.") == (None, "No thinking here.")
    with pytest.raises(ValueError):
        ReasoningParser("o1")


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3"])
def test_stream_char_by_char_equals_split(name):
    streamer = ReasoningStreamer(ReasoningParser(name))
    reasoning, answer = "", ""
    for end in range(1, len(THOUGHT) + 1):
        delta, answer = streamer.update(THOUGHT[:end], end == len(THOUGHT))
        assert "<" not in delta  # no piece of a marker leaks into the reasoning
        reasoning += delta
    assert (reasoning, answer) == ReasoningParser(name).split(THOUGHT)
    plain = ReasoningStreamer(ReasoningParser("qwen3"))
    assert plain.update("<th", False) == ("", "")
    assert plain.update("<tho", False) == ("", "<tho")  # cannot become <think> any more


class ScriptedEngine(FakeEngine):
    """Answers every request with THOUGHT, one character per step."""

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        start = time.perf_counter()
        for k in range(1, len(THOUGHT) + 1):
            await asyncio.sleep(0)
            done = k == len(THOUGHT)
            if req.stream or done:
                yield GenerateOutput(
                    rid=req.rid, text=THOUGHT[:k], output_ids=list(range(k)), finished=done,
                    finish_reason={"type": "stop", "matched": None} if done else None,
                    prompt_tokens=3, completion_tokens=k, cached_tokens=0,
                    e2e_latency=time.perf_counter() - start)


def test_chat_reasoning_content_stream_and_not(make_server):
    server = make_server(ScriptedEngine(context_length=2048), reasoning_parser="deepseek-r1")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="fake-llm", messages=msgs)
    message = out.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra["reasoning_content"] == "The user greets me. I greet back."
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="fake-llm", messages=msgs, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert reasoning == "The user greets me. I greet back." and content == "Hello there!"
