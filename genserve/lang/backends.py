"""Where a program's calls run: a genserve (or SGLang) server over HTTP, or an in-process Engine.

Both speak the native `/generate` contract: text in, `{text, output_ids, meta_info}` out, with
`max_new_tokens: 0` to prefill (and cache) a prefix and `logprob_start_len` to score prompt
tokens, which is all `select` needs.
"""

from __future__ import annotations

import json
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ProgramError(RuntimeError):
    """A call inside a program failed; the message names the call and the server's reason."""


class Backend(ABC):
    """What a program state needs from a runtime."""

    #: Role markers of the model's chat template (`genserve.srt.chat_roles`), or None.
    roles: dict[str, Any] | None = None
    model_info: dict[str, Any]

    @abstractmethod
    def generate(
        self,
        text: str,
        sampling_params: dict[str, Any],
        images: list[str],
        on_delta: Callable[[str], None] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Generate after `text`; returns (generated text, meta_info). `on_delta` streams."""

    @abstractmethod
    def score(self, texts: list[str], logprob_start_len: int, images: list[str]
              ) -> list[dict[str, Any]]:
        """One batched request scoring each text's tokens from `logprob_start_len` on (no
        generation); meta_info of each, with `[logprob, token_id, token_text]` entries."""

    def cache_prefix(self, text: str, images: list[str]) -> int:
        """Prefill `text` into the server's prefix cache; returns its length in tokens."""
        _, meta = self.generate(text, {"max_new_tokens": 0}, images)
        return int(meta["prompt_tokens"])


class RuntimeEndpoint(Backend):
    """A genserve server (`genserve serve`), or any server with SGLang's native API."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        params = {"model": model} if model else None
        self.model_info = self._request("connect", "GET", "/get_model_info", params=params)
        self.roles = self.model_info.get("chat_roles")

    def _request(self, call: str, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ProgramError(
                f"{call}: cannot reach the server at {self.base_url}: {exc}") from None
        if resp.status_code != 200:
            raise ProgramError(f"{call}: the server answered {resp.status_code}: "
                               f"{_error_message(resp.text)}")
        return resp.json()

    def _body(self, text: str | list[str], params: dict[str, Any], images: list[str]) -> dict:
        body: dict[str, Any] = {"text": text, "sampling_params": params}
        if images:
            body["image_data"] = images if isinstance(text, str) else [images] * len(text)
        if self.model:
            body["model"] = self.model
        return body

    def generate(self, text, sampling_params, images, on_delta=None):
        body = self._body(text, sampling_params, images)
        if on_delta is None:
            out = self._request("gen", "POST", "/generate", json=body)
            return out["text"], out["meta_info"]
        return self._stream(body, on_delta)

    def _stream(self, body: dict, on_delta: Callable[[str], None]) -> tuple[str, dict]:
        import httpx

        body["stream"] = True
        text, meta = "", {}
        try:
            with self._http.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    raise ProgramError(f"gen: the server answered {resp.status_code}: "
                                       f"{_error_message(resp.read().decode())}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ProgramError(f"gen: {_error_message(data)}")
                    on_delta(chunk["text"][len(text):])
                    text, meta = chunk["text"], chunk["meta_info"]
        except httpx.HTTPError as exc:
            raise ProgramError(f"gen: cannot reach the server at {self.base_url}: {exc}") from None
        return text, meta

    def score(self, texts, logprob_start_len, images):
        body = self._body(texts, {"max_new_tokens": 0, "temperature": 0}, images)
        body.update(return_logprob=True, return_text_in_logprobs=True,
                    logprob_start_len=logprob_start_len)
        out = self._request("select", "POST", "/generate", json=body)
        return [o["meta_info"] for o in out]

    def flush_cache(self) -> None:
        self._request("flush_cache", "POST", "/flush_cache")

    def close(self) -> None:
        self._http.close()


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err or data)[:500]


class EngineBackend(Backend):
    """An in-process `genserve.Engine`. Calls from concurrent program states (fork branches,
    run_batch) are fed to one scheduler loop, so they batch and share the prefix cache exactly
    as on a server. While a backend drives the engine, do not call the engine directly."""

    def __init__(self, engine: Any) -> None:
        from genserve.srt.chat_roles import chat_role_markers

        self.engine = engine
        self.model_info = engine.model_info()
        self.roles = chat_role_markers(engine.tokenizer)
        self._inbox: queue.Queue = queue.Queue()
        self._driver = threading.Thread(target=self._loop, name="genserve-lang-engine",
                                        daemon=True)
        self._driver.start()

    def _submit(self, call: str, text: str, params: dict[str, Any], images: list[str],
                on_delta: Callable[[str], None] | None = None, **logprob: Any) -> Future:
        if images:
            raise ProgramError(f"{call}: images need a vision-language model served over HTTP "
                               "(RuntimeEndpoint); the in-process backend takes text only")
        from genserve.srt.sampling.sampling_params import SamplingParams
        from genserve.srt.tokenizer_manager import make_tokenized_req, tokenize_prompt

        fut: Future = Future()
        try:
            ids = tokenize_prompt(self.engine.tokenizer, text)
            req = make_tokenized_req(ids, SamplingParams.from_dict(params), stream=True,
                                     **logprob)
        except ValueError as exc:
            raise ProgramError(f"{call}: {exc}") from None
        self._inbox.put((req, fut, on_delta, call))
        return fut

    def _loop(self) -> None:
        from genserve.srt.tokenizer_manager import RequestState

        sched = self.engine.scheduler
        live: dict[str, tuple[RequestState, Future, Any, str, int]] = {}
        while True:
            block = not sched.has_work()
            try:
                while True:
                    req, fut, on_delta, call = self._inbox.get(block=block)
                    block = False
                    state = RequestState(req)
                    early = sched.add_request(req)
                    live[req.rid] = (state, fut, on_delta, call, 0)
                    if early is not None:
                        self._deliver(live, early)
            except queue.Empty:
                pass
            try:
                outs = sched.step()
            except Exception as exc:  # a runtime bug: fail every live call, keep serving
                for _, fut, _, call, _ in live.values():
                    fut.set_exception(ProgramError(f"{call}: engine step failed: {exc}"))
                live.clear()
                continue
            for out in outs:
                self._deliver(live, out)

    @staticmethod
    def _deliver(live: dict, out: Any) -> None:
        state, fut, on_delta, call, sent = live[out.rid]
        res = state.update(out)
        if on_delta is not None and len(res.text) > sent:
            on_delta(res.text[sent:])
            live[out.rid] = (state, fut, on_delta, call, len(res.text))
        if res.finished:
            del live[out.rid]
            if res.error is not None:
                fut.set_exception(ProgramError(f"{call}: {res.error}"))
            else:
                fut.set_result(res)

    def generate(self, text, sampling_params, images, on_delta=None):
        res = self._submit("gen", text, sampling_params, images, on_delta).result()
        return res.text, res.meta_info()

    def score(self, texts, logprob_start_len, images):
        futs = [
            self._submit("select", t, {"max_new_tokens": 0, "temperature": 0}, images,
                         return_logprob=True, logprob_start_len=logprob_start_len)
            for t in texts
        ]
        decode = self.engine.tokenizer.decode
        metas = []
        for fut in futs:
            meta = fut.result().meta_info()
            meta["input_token_logprobs"] = [
                [lp, tid, decode([tid])] for lp, tid in meta["input_token_logprobs"]]
            metas.append(meta)
        return metas

    def flush_cache(self) -> None:
        self.engine.flush_cache()
