"""Offline engine: `genserve.Engine(...).generate(...)` runs requests in this process."""

from __future__ import annotations

from typing import Any

from genserve.srt.messages import GenerateOutput, ReqOutput, TokenizedGenerateReq
from genserve.srt.sampling.sampling_params import SamplingParams
from genserve.srt.server_args import EngineArgs
from genserve.srt.tokenizer_manager import (
    RequestState,
    expand_n,
    make_pooling_req,
    make_tokenized_req,
    tokenize_pair,
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
        from genserve.srt.multimodal.processor import VisionInputProcessor

        self.vision = VisionInputProcessor.from_folder(
            self.runtime.folder, self.args.max_images_per_request
        )
        from genserve.srt.pooling_config import read_pooling_spec

        # Embedders and rerankers (`encode`, `rerank`); None for a generative model.
        self.pooling = read_pooling_spec(self.runtime.folder, self.args.is_embedding)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        image_data: Any = None,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict]:
        """Returns one result dict ({text, output_ids, meta_info}) for a single prompt with
        n == 1, else a list (prompt-major, n results per prompt). Raises ValueError on bad
        input. With return_logprob and logprob_start_len >= 0, meta_info also scores the prompt
        tokens from that position on (`input_token_logprobs`, SGLang's shape). image_data
        (vision models): per prompt an image or a list of images, each encoded bytes, a data
        URL or base64; one per image placeholder of the prompt. lora_path: the name of a
        loaded LoRA adapter (SGLang's field), or one name (or None: the base model) per
        prompt."""
        if self.pooling is not None:
            raise ValueError("this is an embedding / rerank model: use encode() or rerank()")
        prompts, single = self._normalize(prompt, input_ids)
        mm_list = self._images(prompts, image_data, single)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
                )
            param_list = sampling_params
        else:
            param_list = [sampling_params] * len(prompts)
        if isinstance(lora_path, list):
            if len(lora_path) != len(prompts):
                raise ValueError(f"got {len(lora_path)} lora_path entries for {len(prompts)} "
                                 "prompts")
            lora_list = lora_path
        else:
            lora_list = [lora_path] * len(prompts)
        reqs: list[TokenizedGenerateReq] = []
        for ids, sp, mm, lora in zip(prompts, param_list, mm_list, lora_list):
            params = SamplingParams.from_dict(sp, self.runtime.config.generation_defaults)
            if params.n > 1:
                single = False
            for p in expand_n(params):
                reqs.append(
                    make_tokenized_req(
                        ids, p, None, False, return_logprob, top_logprobs_num, cache_salt,
                        logprob_start_len=logprob_start_len,
                        token_ids_logprob=token_ids_logprob, mm_inputs=mm, lora_name=lora,
                    )
                )
        outputs = self._run(reqs)
        results = [o.to_dict() for o in outputs]
        return results[0] if single else results

    def _images(self, prompts: list[list[int]], image_data: Any, single: bool) -> list[Any]:
        """Expands each prompt's image placeholders in place; its MultimodalInputs (or None)."""
        if image_data is None:
            for ids in prompts if self.vision is not None else ():
                self.vision.check_text_only(ids)
            return [None] * len(prompts)
        if self.vision is None:
            raise ValueError("this model does not take image inputs")
        from genserve.srt.multimodal.image_source import decode_inline

        per_prompt = [image_data] if single else list(image_data)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got image_data for {len(per_prompt)} of {len(prompts)} prompts")
        out: list[Any] = []
        for i, images in enumerate(per_prompt):
            if images is None:
                self.vision.check_text_only(prompts[i])
                out.append(None)
                continue
            items = images if isinstance(images, list) else [images]
            blobs = []
            for item in items:
                data = item if isinstance(item, bytes) else decode_inline(item)
                if data is None:
                    raise ValueError("the offline Engine takes image bytes, data URLs or base64")
                blobs.append(data)
            prompts[i], mm = self.vision.process(prompts[i], blobs)
            out.append(mm)
        return out

    def _normalize(
        self, prompt: str | list[str] | None, input_ids: Any
    ) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt (text) or input_ids")
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if self.vision is not None:
                texts = [self.vision.rules.expand_text(t, self.tokenizer) for t in texts]
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

    def encode(
        self,
        texts: str | list[str] | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        input_ids: list[list[int]] | None = None,
    ) -> list[list[float]]:
        """Embeddings of `texts` (or of token-id lists), one vector each, pooled as the model's
        sentence-transformers config says; the prompt rules are `SentenceTransformer.encode`'s.
        All inputs are queued at once and batch in the scheduler."""
        spec = self._pooling("embed")
        if (texts is None) == (input_ids is None):
            raise ValueError("pass exactly one of texts or input_ids")
        if texts is not None:
            prefix = spec.prompt_text(prompt_name, prompt)
            items = [texts] if isinstance(texts, str) else list(texts)
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass input_ids")
            # One batched call (the fast tokenizer's own threads), as sentence-transformers does.
            input_ids = [list(x) for x in self.tokenizer([prefix + t for t in items])["input_ids"]]
        hidden = int(self.model_info().get("hidden_size") or 0)
        spec.check_dimensions(dimensions, hidden)
        assert input_ids is not None
        return self._run_pooled([make_pooling_req(ids, dimensions=dimensions)
                                 for ids in input_ids])

    def rerank(self, query: str, documents: list[str]) -> list[float]:
        """The reranker's relevance score of each document for `query` (`CrossEncoder.predict`
        of the (query, document) pairs), in the documents' order."""
        self._pooling("rerank")
        reqs = []
        for doc in documents:
            ids, types = tokenize_pair(self.tokenizer, query, doc)
            reqs.append(make_pooling_req(ids, token_type_ids=types))
        return [v[0] for v in self._run_pooled(reqs)]

    def _pooling(self, task: str) -> Any:
        if self.pooling is None or self.pooling.task != task:
            what = "a generative model" if self.pooling is None else f"an {self.pooling.task} model"
            raise ValueError(f"this is {what}; {task} needs an "
                             f"{'embedding' if task == 'embed' else 'reranker'} model")
        return self.pooling

    def _run_pooled(self, reqs: list[TokenizedGenerateReq]) -> list[list[float]]:
        sched = self.scheduler
        results: dict[str, ReqOutput] = {}
        for r in reqs:
            early = sched.add_request(r)
            if early is not None:
                for other in reqs:
                    sched.abort(other.rid)
                while sched.has_work():
                    sched.step()
                raise ValueError(early.error or "the request was refused")
        while sched.has_work():
            for out in sched.step():
                results[out.rid] = out
        vectors = []
        for r in reqs:
            out = results[r.rid]
            if out.error is not None or out.embedding is None:
                raise ValueError(out.error or "a request ended without a result")
            vectors.append(out.embedding)
        return vectors

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Register the PEFT adapter folder `lora_path` as `lora_name` (ValueError names what
        does not fit the model)."""
        from genserve.srt.lora.scheduling import load_adapter_into

        load_adapter_into(self.scheduler, lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Forget an adapter; ValueError when it is unknown or in use."""
        from genserve.srt.lora.scheduling import unload_adapter

        sched = self.scheduler
        unload_adapter(sched.lora, sched.runner.lora_refusal, sched.reqs, lora_name)

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
        self.runtime.shutdown()  # stops the tensor-parallel ranks

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
