"""Per-request sampling parameters (SGLang's `sampling_params` dict), validated once on arrival.

This module must not import torch: the tokenizer manager validates requests in the gateway.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

MAX_STOP_STRINGS = 16
MAX_N = 64
MAX_SEED = 2**63 - 1
# Keys of SGLang's sampling_params that ask for grammar-constrained decoding.
CONSTRAINED_KEYS = ("json_schema", "regex", "ebnf")


def _check_int(name: str, value: Any) -> int:
    # bool is a subclass of int; `max_new_tokens: true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _normalize_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    for s in value:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
    return tuple(value)


def _normalize_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {value!r}")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids must contain only integers >= 0, got {t!r}")
    return tuple(value)


def _normalize_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (keys may be strings) -> sorted ((id, bias), ...)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):  # to_dict round trip and pickled pairs
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias must be an object of token id -> bias, got {value!r}"
            ) from None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        bias = _check_float(f"logit_bias[{key}]", bias)
        if not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        out[token] = bias
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request. Invalid values raise ValueError on creation."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0 on input) disables top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Grammar-constrained decoding (at most one): a JSON schema (as a JSON string), a regular
    # expression or an EBNF grammar (xgrammar's dialect, root rule `root`).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        # Frozen: normalised values are written through object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        max_new = _check_int("max_new_tokens", self.max_new_tokens)
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")
        min_new = _check_int("min_new_tokens", self.min_new_tokens)
        if not 0 <= min_new <= max_new:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={max_new}], got {min_new}"
            )
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        put("temperature", temperature)
        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        put("top_p", top_p)
        top_k = _check_int("top_k", self.top_k)
        if top_k == 0:
            top_k = -1
        if top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {top_k}")
        put("top_k", top_k)
        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        put("min_p", min_p)
        for name in ("frequency_penalty", "presence_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        rep = _check_float("repetition_penalty", self.repetition_penalty)
        if not 0 < rep <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {rep}")
        put("repetition_penalty", rep)
        put("stop", _normalize_stop(self.stop))
        put("stop_token_ids", _normalize_stop_token_ids(self.stop_token_ids))
        put("logit_bias", _normalize_logit_bias(self.logit_bias))
        self._check_grammar()
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            _check_bool(name, getattr(self, name))
        n = _check_int("n", self.n)
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not 0 <= seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")

    def _check_grammar(self) -> None:
        given = [k for k in CONSTRAINED_KEYS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {given}")
        for key in given:
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (a JSON schema)")

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, source) of the request's grammar, or None when it is unconstrained."""
        for key in CONSTRAINED_KEYS:
            value = getattr(self, key)
            if value is not None:
                return key, value
        return None

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Build from a request's `sampling_params` dict; None or a null value means default:
        the model's own (`defaults`, from its generation_config.json) where it has one."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in known}
        for key, value in d.items():
            if key not in known:
                raise ValueError(f"unknown sampling parameter '{key}'")
            # JSON clients send null for "not set" (e.g. max_new_tokens: null).
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; `from_dict(p.to_dict()) == p`."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
