"""The expressions a program appends to its state: text, gen, select, image and role markers."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")


class Exprs(list):
    """A sequence of expressions appended in order; `+` with text or another expression
    builds a longer one (`"The answer is " + gen("a")`)."""

    def __add__(self, other):  # type: ignore[override]
        return Exprs([*self, *_as_list(other)])

    def __radd__(self, other):
        return Exprs([*_as_list(other), *self])


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class _Concat:
    def __add__(self, other):
        return Exprs([self, *_as_list(other)])

    def __radd__(self, other):
        return Exprs([*_as_list(other), self])


@dataclass(frozen=True)
class Gen(_Concat):
    """Generate text at the end of the state; stored under `name` when it has one."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # SGLang sampling_params keys


@dataclass(frozen=True)
class Select(_Concat):
    """Append the choice the model finds likeliest (length-normalized log-probability)."""

    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True)
class Image(_Concat):
    """An image for a vision-language model: a data URL, an http(s) URL or raw base64."""

    data: str


@dataclass(frozen=True)
class RoleBegin(_Concat):
    role: str


@dataclass(frozen=True)
class RoleEnd(_Concat):
    role: str


Expr = str | Gen | Select | Image | RoleBegin | RoleEnd | list


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    choices: list[str] | None = None,
) -> Gen | Select:
    """A generation call; with `choices` it is a `select`. Unset fields take the run's
    defaults, then the server's."""
    if choices is not None:
        return select(name, choices)
    if json_schema is not None and not isinstance(json_schema, str):
        import json

        json_schema = json.dumps(json_schema)
    params = {
        "max_new_tokens": max_tokens,
        "stop": stop,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        "stop_token_ids": stop_token_ids,
        "seed": seed,
        "regex": regex,
        "json_schema": json_schema,
    }
    return Gen(name, {k: v for k, v in params.items() if v is not None})


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    if not choices:
        raise ValueError(f"select({name!r}): choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select({name!r}): every choice must be a non-empty string")
    return Select(name, tuple(choices))


def image(source: str | bytes | Path) -> Image:
    """A file path, bytes, a data URL, an http(s) URL or base64 text."""
    if isinstance(source, bytes):
        return Image(base64.b64encode(source).decode())
    if isinstance(source, Path) or (
        isinstance(source, str)
        and not source.startswith(("data:", "http://", "https://"))
        and len(source) < 4096
        and Path(source).is_file()
    ):
        return Image(base64.b64encode(Path(source).read_bytes()).decode())
    return Image(str(source))


def _role(role: str, content: Expr | None) -> Exprs:
    if content is None:
        return Exprs([RoleBegin(role), RoleEnd(role)])
    return Exprs([RoleBegin(role), content, RoleEnd(role)])


def system(content: Expr | None = None) -> Exprs:
    return _role("system", content)


def user(content: Expr | None = None) -> Exprs:
    return _role("user", content)


def assistant(content: Expr | None = None) -> Exprs:
    return _role("assistant", content)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
