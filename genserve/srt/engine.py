"""Offline engine: `genserve.Engine(...).generate(...)` runs requests in this process."""

from __future__ import annotations

from typing import Any

from genserve.srt.messages import GenerateOutput, TokenizedGenerateReq
from genserve.srt.sampling.sampling_params import SamplingParams
from genserve.srt.server_args import EngineArgs
from genserve.srt.tokenizer_manager import (
    RequestState,
    expand_n,
    make_tokenized_req,
    tokenize_prompt,
)


def __getattr__(name: str) -> Any:
    # `from genserve.srt.engine import AsyncEngine` works without importing torch.
    if name == "AsyncEngine":
        from genserve.srt.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


class Engine:
    """In-process LLM engine with continuous batching and the radix prefix cache.

    >>> engine = Engine()  # the embedded SmolLM2-135M-Instruct
    >>> engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from genserve.srt.engine_core import build_runtime  # torch: only when an Engine is made

        self.args = EngineArgs(model_path=model_path, **kwargs)
        self.runtime = build_runtime(self.args)
        self.scheduler = self.runtime.scheduler
        self.tokenizer = self.runtime.tokenizer

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
    ) -> dict | list[dict]:
        """Returns one result dict ({text, output_ids, meta_info}) for a single prompt with
        n == 1, else a list (prompt-major, n results per prompt). Raises ValueError on bad
        input."""
        prompts, single = self._normalize(prompt, input_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
                )
            param_list = sampling_params
        else:
            param_list = [sampling_params] * len(prompts)
        reqs: list[TokenizedGenerateReq] = []
        for ids, sp in zip(prompts, param_list):
            params = SamplingParams.from_dict(sp, self.runtime.config.generation_defaults)
            if params.n > 1:
                single = False
            for p in expand_n(params):
                reqs.append(
                    make_tokenized_req(
                        ids, p, None, False, return_logprob, top_logprobs_num, cache_salt
                    )
                )
        outputs = self._run(reqs)
        results = [o.to_dict() for o in outputs]
        return results[0] if single else results

    def _normalize(
        self, prompt: str | list[str] | None, input_ids: Any
    ) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt (text) or input_ids")
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            return [tokenize_prompt(self.tokenizer, t) for t in texts], isinstance(prompt, str)
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of ints or of lists of ints")
        if isinstance(input_ids[0], list):
            return [list(x) for x in input_ids], False
        return [list(input_ids)], True

    def _run(self, reqs: list[TokenizedGenerateReq]) -> list[GenerateOutput]:
        sched = self.scheduler
        states = {r.rid: RequestState(r) for r in reqs}
        for r in reqs:
            early = sched.add_request(r)
            if early is not None:
                states[r.rid].update(early)
        if any(st.last is not None and st.last.error for st in states.values()):
            # One input is invalid: run none of the batch (and leave nothing queued).
            for r in reqs:
                sched.abort(r.rid)
        while sched.has_work():
            for out in sched.step():
                states[out.rid].update(out)
        outs = [states[r.rid].last for r in reqs]
        for out in outs:
            if out is not None and out.error is not None:
                raise ValueError(out.error)
        if any(out is None for out in outs):
            raise RuntimeError("a request ended without output")
        return outs  # type: ignore[return-value]

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def server_info(self) -> dict[str, Any]:
        return self.scheduler.info()

    def model_info(self) -> dict[str, Any]:
        return self.runtime.model_info()

    def shutdown(self) -> None:
        self.scheduler.waiting.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
