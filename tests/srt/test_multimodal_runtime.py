"""The scheduler's image-embedding cache is keyed by the image and the request's cache_salt:
tenants with different salts never share an encoded image (a hit would tell one tenant, by
its speed, what another sent); requests with the same salt, or none, share it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from genserve.srt.messages import ImageItem, MultimodalInputs
from genserve.srt.multimodal.runtime import MultimodalRuntime

TOKENS = 4  # placeholder tokens of the image


class RecordingEncoder:
    """A model's `encode_images`: one [TOKENS, 8] embedding per image, each call recorded."""

    uses_mrope = False

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode_images(self, items: list[ImageItem]) -> list[torch.Tensor]:
        out = []
        for item in items:  # each embedding tells which encoding made it
            self.encoded.append(item.content_hash)
            out.append(torch.full((item.num_tokens, 8), float(len(self.encoded))))
        return out


class PassThroughPreprocessor:
    images_preprocessed = 0

    def with_pixels(self, item: ImageItem) -> ImageItem:
        return item


def request(salt: str | None, content_hash: str = "cafe") -> SimpleNamespace:
    """A scheduler request (the fields the runtime reads) whose prompt is one image's
    placeholder tokens; `salt` is its cache_salt (the tokenizer manager's namespace)."""
    image = ImageItem(content_hash, b"", None, offset=0, num_tokens=TOKENS)
    return SimpleNamespace(namespace=salt or "", mm_inputs=MultimodalInputs([image]),
                           mm_refs=set())


def prefill(runtime: MultimodalRuntime, reqs: list[SimpleNamespace]) -> list[torch.Tensor]:
    """One extend batch of whole prompts; the image embedding each request got."""
    rows = [SimpleNamespace(req=r, prefix_len=0, extend_len=TOKENS) for r in reqs]
    embeds = [emb for _, emb in runtime.prepare_extend(rows)["image_embeds"]]
    runtime.check_integrity(reqs)
    for r in reqs:
        runtime.release(r)
    runtime.check_integrity([])
    return embeds


def make_runtime() -> tuple[MultimodalRuntime, RecordingEncoder]:
    encoder = RecordingEncoder()
    return MultimodalRuntime(encoder, PassThroughPreprocessor(), torch.device("cpu"),
                             budget_bytes=1 << 20), encoder


def test_two_salts_two_entries_one_salt_one():
    runtime, encoder = make_runtime()
    a1 = prefill(runtime, [request("tenant-a")])[0]
    b = prefill(runtime, [request("tenant-b")])[0]
    a2 = prefill(runtime, [request("tenant-a")])[0]
    assert len(encoder.encoded) == 2 and len(runtime.cache) == 2
    assert runtime.cache.hits == 1  # tenant-a's second request, from its own entry
    assert torch.equal(a1, a2) and not torch.equal(a1, b)
    # Unsalted requests share one more entry among themselves.
    prefill(runtime, [request(None)])
    prefill(runtime, [request(None)])
    assert len(encoder.encoded) == 3 and len(runtime.cache) == 3


def test_one_batch_encodes_once_per_salt():
    runtime, encoder = make_runtime()
    embeds = prefill(runtime, [request("a"), request("b"), request("a"), request("b")])
    assert len(encoder.encoded) == 2 and len(runtime.cache) == 2
    assert torch.equal(embeds[0], embeds[2]) and torch.equal(embeds[1], embeds[3])
    assert not torch.equal(embeds[0], embeds[1])
    # Another image under a salt already seen is its own entry too.
    prefill(runtime, [request("a", "beef")])
    assert len(runtime.cache) == 3
