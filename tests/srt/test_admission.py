"""Requests that can never run end at once with a message (checked from the scheduler's
limits alone, before anything is queued)."""

from __future__ import annotations

from genserve.srt.messages import ImageItem, MultimodalInputs
from genserve.srt.sampling import SamplingParams
from genserve.srt.scheduler.admission import AdmissionLimits, admission_error
from genserve.srt.scheduler.req import Req
from genserve.srt.tokenizer_manager import make_tokenized_req

LIMITS = AdmissionLimits(context_length=64, max_total_tokens=48, vocab_size=100,
                         constrained_decoding=False, images=False)


def req(ids: list[int], max_new_tokens: int = 8, **kwargs) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens, **kwargs)
    return Req(make_tokenized_req(ids, params), None, "cpu")


def test_a_request_that_fits_is_admitted():
    assert admission_error(LIMITS, req([1, 2, 3])) is None


def test_each_limit_names_itself():
    assert "prompt is empty" in admission_error(LIMITS, req([]))
    assert "exceeds the context length (64)" in admission_error(LIMITS, req([1] * 60))
    assert "KV pool (48 tokens)" in admission_error(LIMITS, req([1] * 40, max_new_tokens=10))
    assert "[0, 100)" in admission_error(LIMITS, req([1, 100]))
    assert "--grammar-backend none" in admission_error(LIMITS, req([1], regex="a+"))
    image = ImageItem("ab12", None, None, 0, 1)
    with_image = Req(make_tokenized_req([1, 2], SamplingParams(max_new_tokens=4),
                                        mm_inputs=MultimodalInputs([image])), None, "cpu")
    assert admission_error(LIMITS, with_image) == "this model does not take image inputs"
