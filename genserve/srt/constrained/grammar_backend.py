"""xgrammar behind a small interface: compile off the scheduler's step, cache by key, and one
matcher per request."""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger(__name__)

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; the user needs the rest.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")

GrammarKey = tuple[str, str]  # ("json_schema" | "regex" | "ebnf", source)


class GrammarError(ValueError):
    """A grammar that does not compile (bad schema / regex / EBNF, or a compile timeout)."""


def _clean_message(exc: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class RequestGrammar:
    """The grammar state of one request: which tokens may come next, and what is forced."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        # xgrammar keeps the whole history: rollback works any number of tokens back.
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed next tokens into bitmask[row] ([*, ceil(V/32)] int32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (state unchanged)."""
        return bool(self._matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        """The text the grammar forces next (empty when more than one continuation is allowed)."""
        return str(self._matcher.find_jump_forward_string())

    def accept_string(self, text: str) -> bool:
        return bool(self._matcher.accept_string(text))

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may be generated."""
        return bool(self._matcher.is_terminated())


class GrammarBackend:
    """Compiles grammars in one worker thread, cached by key (a repeated schema compiles once).

    `submit` never blocks; the scheduler polls the future while other requests run.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: dict[GrammarKey, Future] = {}
        self._lock = threading.Lock()
        self.stats = {"compiles": 0, "cache_hits": 0, "compile_errors": 0, "compile_seconds": 0.0}

    def submit(self, key: GrammarKey) -> Future:
        """A future of the compiled grammar (raises GrammarError on a bad grammar)."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self.stats["cache_hits"] += 1
                return fut
            fut = self._executor.submit(self._compile, key)
            self._cache[key] = fut
            return fut

    def _compile(self, key: GrammarKey) -> Any:
        kind, source = key
        start = time.perf_counter()
        try:
            if kind == "json_schema":
                # Compact JSON (no free whitespace): small models cannot pad it with endless
                # newlines, and more of each object is forced (jump-forward).
                compiled = self._compiler.compile_json_schema(source, any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(source)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(source)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar reports bad input as RuntimeError / ValueError
            with self._lock:
                self.stats["compile_errors"] += 1
                self._cache.pop(key, None)  # do not keep failures: the message is per request
            raise GrammarError(f"invalid {kind}: {_clean_message(exc)}") from None
        with self._lock:
            self.stats["compiles"] += 1
            self.stats["compile_seconds"] += time.perf_counter() - start
        return compiled

    def matcher(self, compiled: Any) -> RequestGrammar:
        return RequestGrammar(compiled, self.stop_token_ids)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V/32)] int32, all tokens allowed."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {"backend": "xgrammar", "cached_grammars": len(self._cache), **self.stats}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], compile_timeout_s: float
) -> GrammarBackend | None:
    """The backend for `--grammar-backend` (None for "none" or a model without tokenizer)."""
    if name == "none" or tokenizer is None:
        return None
    if name != "xgrammar":
        raise ValueError(f"unknown grammar backend {name!r}")
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        logger.warning("xgrammar is not installed: constrained decoding is disabled")
        return None
    return GrammarBackend(tokenizer, vocab_size, stop_token_ids, compile_timeout_s)
