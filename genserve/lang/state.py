"""A running program's state: its text so far, named results, chat turns, and forks.

Each state runs the expressions appended to it (`s += gen(...)`) in order on its own worker
thread, so `s += ...` returns at once and the branches of a `fork` generate concurrently (their
requests batch on the server and share the prefix through the radix cache). Reading a result
(`s["name"]`, `s.text()`) waits for the work before it.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from genserve.lang.backends import Backend, ProgramError
from genserve.lang.ir import Gen, Image, RoleBegin, RoleEnd, Select

_END = object()  # closes a text stream


class ProgramState:
    def __init__(self, backend: Backend, defaults: dict[str, Any] | None = None,
                 stream: bool = False) -> None:
        self.backend = backend
        self.defaults = dict(defaults or {})
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, str]] = []
        self._images: list[str] = []
        self._role: tuple[str, int] | None = None  # open role and where its content starts
        self._started = False  # a role marker or text has been written
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genserve-lang")
        self._last: Future | None = None
        self._stream: queue.Queue | None = queue.Queue() if stream else None

    # ---- appending ---------------------------------------------------------------------------

    def __iadd__(self, expr: Any) -> ProgramState:
        self._last = self._pool.submit(self._run_guarded, expr)
        return self

    def _run_guarded(self, expr: Any) -> None:
        if self._error is not None:
            return  # an earlier call failed: the rest of this program does not run
        try:
            self._run(expr)
        except BaseException as exc:
            self._error = exc

    def _run(self, expr: Any) -> None:
        if isinstance(expr, (list, tuple)):
            for e in expr:
                self._run(e)
        elif isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Image):
            self._image(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        else:
            raise ProgramError(f"cannot append {type(expr).__name__} to a program state")

    def _append(self, text: str) -> None:
        self._text += text
        self._started = True
        if self._stream is not None and text:
            self._stream.put(text)

    def _gen(self, expr: Gen) -> None:
        params = {**self.defaults, **expr.params}
        params.setdefault("max_new_tokens", 128)
        on_delta = self._append if self._stream is not None else None
        call = f"gen({expr.name!r})"
        try:
            text, meta = self.backend.generate(self._text, params, self._images, on_delta)
        except ProgramError as exc:
            raise ProgramError(f"{call}: {str(exc).removeprefix('gen: ')}") from None
        if on_delta is None:
            self._append(text)
        if expr.name:
            self._vars[expr.name], self._meta[expr.name] = text, meta

    def _select(self, expr: Select) -> None:
        call = f"select({expr.name!r})"
        try:
            choice, meta = _pick(self.backend, self._text, list(expr.choices), self._images)
        except ProgramError as exc:
            raise ProgramError(f"{call}: {str(exc).removeprefix('select: ')}") from None
        self._append(choice)
        if expr.name:
            self._vars[expr.name], self._meta[expr.name] = choice, meta

    def _image(self, expr: Image) -> None:
        modalities = self.backend.model_info.get("modalities", ["text"])
        if "image" not in modalities:
            raise ProgramError(
                f"image(): the served model {self.backend.model_info.get('model_name')!r} "
                "takes no images")
        self._images.append(expr.data)
        self._append(self.backend.model_info.get("image_token", ""))

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ProgramError(f"{role}(): the {self._role[0]} turn is still open")
        roles = self.backend.roles
        if roles is None:
            raise ProgramError(f"{role}(): the model has no chat template to render roles with")
        if not self._started and role != "system":
            self._append(roles["default_head"])
        self._append(roles[role][0])
        self._role = (role, len(self._text))

    def _role_end(self, role: str) -> None:
        if self._role is None or self._role[0] != role:
            raise ProgramError(f"{role}_end(): no {role} turn is open")
        content = self._text[self._role[1]:]
        self._messages.append({"role": role, "content": content})
        self._role = None
        self._append(self.backend.roles[role][1])  # type: ignore[index]

    # ---- reading -----------------------------------------------------------------------------

    def sync(self) -> ProgramState:
        """Wait for everything appended so far; raise the first error of the program."""
        if self._last is not None:
            self._last.result()
        if self._error is not None:
            raise self._error
        return self

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no gen or select named {name!r} in this program")
        return self._vars[name]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.sync()
        return self._meta[name]

    def text(self) -> str:
        return self.sync()._text

    def messages(self) -> list[dict[str, str]]:
        return list(self.sync()._messages)

    def variables(self) -> dict[str, Any]:
        return dict(self.sync()._vars)

    def text_iter(self) -> Iterator[str]:
        """The program's text as it is appended (run with stream=True), constants included."""
        if self._stream is None:
            raise ProgramError("text_iter() needs the program to run with stream=True")
        while True:
            item = self._stream.get()
            if item is _END:
                break
            yield item
        self.sync()

    def close_stream(self) -> None:
        if self._stream is not None:
            self._pool.submit(self._stream.put, _END)

    # ---- branching ---------------------------------------------------------------------------

    def fork(self, n: int) -> ForkGroup:
        """n copies of this state that continue independently (and concurrently). The text so
        far is prefilled into the runtime's prefix cache first, so every branch reuses it."""
        if n < 1:
            raise ValueError(f"fork(n): n must be >= 1, got {n}")
        self.sync()
        if self._text and n > 1:
            try:
                self.backend.cache_prefix(self._text, self._images)
            except ProgramError as exc:
                raise ProgramError(f"fork({n}): {exc}") from None
        children = []
        for _ in range(n):
            child = ProgramState(self.backend, self.defaults)
            child._text, child._vars = self._text, dict(self._vars)
            child._meta, child._messages = dict(self._meta), list(self._messages)
            child._images, child._role, child._started = list(self._images), self._role, True
            children.append(child)
        return ForkGroup(children)

    # ---- roles as context managers -----------------------------------------------------------

    @contextmanager
    def _turn(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self):  # noqa: D102 - `with s.system(): ...`
        return self._turn("system")

    def user(self):  # noqa: D102
        return self._turn("user")

    def assistant(self):  # noqa: D102
        return self._turn("assistant")

    def __del__(self) -> None:
        self._pool.shutdown(wait=False)


class ForkGroup(list):
    """The branches of a fork; `join()` waits for all and raises the first error."""

    def join(self) -> list[ProgramState]:
        errors = []
        for s in self:
            try:
                s.sync()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return list(self)

    def __getitem__(self, index):  # type: ignore[override]
        return super().__getitem__(index)


def _pick(backend: Backend, prefix: str, choices: list[str], images: list[str]
          ) -> tuple[str, dict[str, Any]]:
    """The choice with the highest mean token log-probability after `prefix`.

    The prefix is prefilled once (and cached); the choices are then scored in one batched
    request from two tokens before the prefix's end, so a choice that merges with the prefix's
    last token is still scored whole. Which scored tokens belong to a choice is read off their
    text: the shortest run of final tokens that spells at least the choice.
    """
    prompt_tokens = backend.cache_prefix(prefix, images)
    start = max(prompt_tokens - 2, 0)
    metas = backend.score([prefix + c for c in choices], start, images)
    scores = []
    for choice, meta in zip(choices, metas):
        entries = meta["input_token_logprobs"]
        picked, covered = [], 0
        for lp, _tid, text in reversed(entries):
            picked.append(lp)
            covered += len(text or "")
            if covered >= len(choice):
                break
        values = [v for v in picked if v is not None]
        scores.append(sum(values) / len(values) if values else float("-inf"))
    best = max(range(len(choices)), key=lambda i: scores[i])
    return choices[best], {"scores": scores, "choices": choices,
                           "prompt_tokens": prompt_tokens}
