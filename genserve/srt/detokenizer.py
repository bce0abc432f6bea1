"""Incremental detokenization of streamed output tokens, and stop-string matching.

`IncrementalDetokenizer` keeps two offsets into the output ids (the technique of vLLM / TGI):
[prefix_offset, read_offset) are tokens already turned into text, kept only as left context so
that tokenizers whose text depends on the neighbour (SentencePiece's leading "▁", byte-level BPE
pieces of one character) decode the same as in the full sequence; [read_offset, len) are new.
Each `add` decodes only that window, so its cost is O(new tokens), not O(all tokens).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into cumulative text.

    The text never ends with U+FFFD from a multi-byte character whose bytes are split over
    tokens: those bytes are held back until the character is complete (`flush` emits them
    anyway, for the end of a generation). Each returned text is a prefix of the next.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # cumulative text of token_ids[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the cumulative text of all output tokens so far."""
        self.token_ids.extend(int(t) for t in token_ids)
        return self._advance(allow_incomplete=False)

    def flush(self) -> str:
        """Cumulative text including held-back bytes (as U+FFFD): call when generation ends."""
        return self._advance(allow_incomplete=True)

    def _advance(self, allow_incomplete: bool) -> str:
        if len(self.token_ids) == self.read_offset:
            return self.text
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset :])
        if window_text.endswith(REPLACEMENT_CHAR) and not allow_incomplete:
            # A multi-byte character is still incomplete: keep the offsets so the next call
            # decodes its bytes together, and show only the complete text before it.
            if window_text.startswith(prefix_text):
                return self.text + window_text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)
            return self.text
        if window_text.startswith(prefix_text):
            self.text += window_text[len(prefix_text) :]
        else:
            # The new tokens changed how the context decodes (rare cleanup rules): fall back to
            # decoding everything, which is correct by definition.
            self.text = self._decode(self.token_ids)
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self.text


class StopStringMatcher:
    """Finds stop strings in cumulative output text.

    The caller cuts the text at the match (stop strings are not part of the output) and, while
    streaming, sends only `safe_prefix_len(text)` characters: a tail that could still grow into
    a stop string is held back until the next token decides.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """(index where the earliest stop string starts, that string), or None.

        `start` lets a streaming caller search only the region a new token can affect: text
        from `max(0, previous_len - max_len + 1)` on. When two stops start at the same index
        the shorter wins: it is the one that completed first while streaming.
        """
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = text.find(stop, start)
            if idx < 0:
                continue
            if best is None or idx < best[0] or (idx == best[0] and len(stop) < len(best[1])):
                best = (idx, stop)
        return best

    def safe_prefix_len(self, text: str) -> int:
        """How many leading characters of `text` cannot be part of a (future) stop string.

        That is the match index when a stop string is already in the text, otherwise
        len(text) minus the longest tail that is a proper prefix of some stop string.
        """
        if not self.stops:
            return len(text)
        match = self.find(text)
        if match is not None:
            return match[0]
        for tail in range(min(len(text), self.max_len - 1), 0, -1):
            suffix = text[-tail:]
            if any(len(s) > tail and s.startswith(suffix) for s in self.stops):
                return len(text) - tail
        return len(text)
