"""`--reasoning-parser`: split a model's <think>...</think> out of its answer into
`reasoning_content`, whole or as it streams.

- `deepseek-r1`: the chat template opens the thinking block itself, so the output starts in
  reasoning (a leading `<think>` is accepted too) and the answer follows `</think>`;
- `qwen3`: the output is reasoning only when it starts with `<think>`.
"""

from __future__ import annotations

from genserve.entrypoints.config import REASONING_PARSERS

PARSERS = REASONING_PARSERS
_OPEN, _CLOSE = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {PARSERS}")
        self.starts_in_reasoning = name == "deepseek-r1"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a finished output."""
        body = text.lstrip()
        if body.startswith(_OPEN):
            body = body[len(_OPEN) :]
        elif not self.starts_in_reasoning:
            return None, text
        end = body.find(_CLOSE)
        if end == -1:
            return body.strip(), ""  # cut off while thinking
        return body[:end].strip(), body[end + len(_CLOSE) :].lstrip()


class ReasoningStreamer:
    """Per choice: the reasoning delta of each update and the answer text so far."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of reasoning already sent

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, cumulative answer text) for the cumulative output `text`."""
        body = text.lstrip()
        if not finished and _OPEN.startswith(body):
            return "", ""  # may still become "<think>"
        if body.startswith(_OPEN):
            body = body[len(_OPEN) :]
        elif not self.parser.starts_in_reasoning:
            return "", text
        end = body.find(_CLOSE)
        if end == -1:
            reasoning, answer = body, ""
            if not finished:
                reasoning = reasoning[: len(reasoning) - _held(reasoning, _CLOSE)]
        else:
            reasoning, answer = body[:end], body[end + len(_CLOSE) :].lstrip()
        # Whitespace is held back until text follows it: the final reasoning is stripped.
        reasoning = reasoning.strip()
        delta = reasoning[self.sent :] if len(reasoning) > self.sent else ""
        self.sent = max(self.sent, len(reasoning))
        return delta, answer
