"""The scheduler's side of vision-language models: preprocesses and encodes each distinct image
once (through the image-embedding cache, keyed by the file's hash) and gives each forward pass
the embeddings to splice in and, for M-RoPE models, the 3-D positions of its tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from genserve.srt.multimodal.embedding_cache import ImageEmbeddingCache
from genserve.srt.multimodal.preprocess import ImagePreprocessor

if TYPE_CHECKING:
    from genserve.srt.scheduler.batch import ExtendBatch


class MultimodalRuntime:
    """`model` exposes `encode_images(items) -> list[Tensor [num_tokens, hidden]]` and
    `uses_mrope`; `preprocessor` makes the items' pixel arrays."""

    def __init__(
        self,
        model: Any,
        preprocessor: ImagePreprocessor,
        device: torch.device,
        budget_bytes: int,
    ) -> None:
        self.model = model
        self.preprocessor = preprocessor
        self.device = device
        self.cache = ImageEmbeddingCache(budget_bytes)
        self.images_encoded = 0
        self.encoder_calls = 0

    # ---- per forward pass -------------------------------------------------------------------

    def prepare_extend(self, batch: ExtendBatch) -> dict[str, Any]:
        """The new tokens of batch row i are the forward's token rows [sum of earlier
        extend_lens, + extend_len). Returns keyword arguments for
        `ModelRunner.build_forward_batch`."""
        spans = [(r.req, r.prefix_len, r.extend_len) for r in batch]
        needed = []  # (batch row of the first token, item, [a, b) rows of its embedding, req)
        row = 0
        for req, prefix, n in spans:
            mm = req.mm_inputs
            for item in mm.images if mm is not None else ():
                lo = max(prefix, item.offset)
                hi = min(prefix + n, item.offset + item.num_tokens)
                if lo < hi:
                    a, b = lo - item.offset, hi - item.offset
                    needed.append((row + lo - prefix, item, a, b, req))
            row += n
        # Hold what is cached first, so encoding the rest cannot evict it.
        missing: dict[str, Any] = {}
        for _, item, _, _, req in needed:
            key = _cache_key(req, item)
            if key not in missing and self.cache.get(key) is not None:
                self._hold(req, key)
            else:
                missing.setdefault(key, item)
        if missing:
            items = [self.preprocessor.with_pixels(item) for item in missing.values()]
            embeds = self.model.encode_images(items)
            self.encoder_calls += 1
            self.images_encoded += len(missing)
            for key, emb in zip(missing, embeds):
                self.cache.put(key, emb)
            for _, item, _, _, req in needed:
                if _cache_key(req, item) in missing:
                    self._hold(req, _cache_key(req, item))
        image_embeds = []
        for start, item, a, b, req in needed:
            emb = self.cache.peek(_cache_key(req, item))
            assert emb is not None  # held above
            image_embeds.append((start, emb[a:b]))
        extra: dict[str, Any] = {"image_embeds": image_embeds}
        if getattr(self.model, "bidirectional_images", False):
            extra["image_blocks"] = [
                [
                    (it.offset, it.offset + it.num_tokens)
                    for it in (req.mm_inputs.images if req.mm_inputs is not None else ())
                    if it.offset < prefix + n and it.offset + it.num_tokens > prefix
                ]
                for req, prefix, n in spans
            ]
        if self.model.uses_mrope:
            cols = [self._mrope(req, prefix, prefix + n) for req, prefix, n in spans]
            extra["mrope_positions"] = torch.from_numpy(np.concatenate(cols, axis=1)).to(
                self.device
            )
        return extra

    def chunk_length(self, req: Any, start: int, chunk: int) -> int:
        """The length of a prefill chunk of `req` from token `start` that wanted `chunk` tokens.
        A model whose image tokens attend both ways needs each image in one forward: a chunk
        that would end inside an image ends before it or, when the image starts the chunk,
        after it (over the token budget)."""
        mm = req.mm_inputs
        if not getattr(self.model, "bidirectional_images", False) or mm is None:
            return chunk
        end = start + chunk
        for item in mm.images:
            lo, hi = item.offset, item.offset + item.num_tokens
            if lo < end < hi:
                return lo - start if lo > start else hi - start
        return chunk

    def prepare_decode(self, reqs: list[Any]) -> dict[str, Any]:
        if not self.model.uses_mrope:
            return {}
        pos = [r.kv_len + (r.mm_inputs.mrope_delta if r.mm_inputs else 0) for r in reqs]
        t = torch.tensor(pos, dtype=torch.int64, device=self.device)
        return {"mrope_positions": t.unsqueeze(0).expand(3, -1).contiguous()}

    @staticmethod
    def _mrope(req: Any, start: int, end: int) -> np.ndarray:
        """[3, end - start] positions of tokens [start, end) of the request."""
        mm = req.mm_inputs
        n_in = len(req.origin_input_ids)
        if mm is None or mm.mrope_positions is None:
            return np.broadcast_to(np.arange(start, end, dtype=np.int64), (3, end - start))
        prompt = mm.mrope_positions[:, start : min(end, n_in)]
        if end <= n_in:
            return prompt
        after = np.arange(max(start, n_in), end, dtype=np.int64) + mm.mrope_delta
        return np.concatenate([prompt, np.broadcast_to(after, (3, after.size))], axis=1)

    # ---- references -------------------------------------------------------------------------

    def _hold(self, req: Any, key: str) -> None:
        if key not in req.mm_refs:
            self.cache.acquire(key)
            req.mm_refs.add(key)

    def release(self, req: Any) -> None:
        """The request reads none of its images any more (prefill done, or it ended)."""
        for key in req.mm_refs:
            self.cache.release(key)
        req.mm_refs.clear()

    def check_integrity(self, reqs: list[Any]) -> None:
        expected: dict[str, int] = {}
        for req in reqs:
            for key in req.mm_refs:
                expected[key] = expected.get(key, 0) + 1
        self.cache.check_integrity(expected)

    def clear(self) -> None:
        self.cache.clear()

    def info(self) -> dict[str, Any]:
        return {
            "images_preprocessed": self.preprocessor.images_preprocessed,
            "images_encoded": self.images_encoded,
            "encoder_calls": self.encoder_calls,
            "cached_images": len(self.cache),
            "cache_bytes": self.cache.num_bytes,
            "cache_budget_bytes": self.cache.budget_bytes,
            "cache_hits": self.cache.hits,
            "cache_evictions": self.cache.evictions,
        }


def _cache_key(req: Any, item: Any) -> str:
    """The embedding cache key of one image of one request: its content and the request's
    cache namespace (`cache_salt`), so tenants with different salts never share an encoded
    image (a cache hit would tell one tenant, by its speed, what another sent)."""
    return f"{req.namespace}\0{item.content_hash}" if req.namespace else item.content_hash


def create_multimodal_runtime(runner: Any, args: Any) -> MultimodalRuntime | None:
    """The runtime of a vision-language model's images; None for a text-only model."""
    if not hasattr(runner.model, "encode_images"):
        return None
    preprocessor = ImagePreprocessor.from_folder(runner.folder)
    return MultimodalRuntime(runner.model, preprocessor, runner.device, args.image_cache_bytes)
