"""Prompt scoring (SGLang's `logprob_start_len`, `token_ids_logprob`, max_new_tokens 0) through
the offline Engine, checked against Hugging Face's own log-softmax on the same weights."""

from __future__ import annotations

import pytest
import torch

from genserve import Engine
from tests.srt.test_engine import prompt


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def hf_logprobs(tiny):
    """log_softmax of HF's logits at every position of a prompt: [len, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return run


def _check_against_hf(meta: dict, ids: list[int], start: int, ref: torch.Tensor) -> None:
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(ids) - start
    assert entries[0] == [None, ids[start]]
    for k, (lp, tok) in enumerate(entries[1:], start=start + 1):
        assert tok == ids[k]
        assert abs(lp - ref[k - 1, tok].item()) < 1e-4, (k, lp, ref[k - 1, tok].item())


@pytest.mark.parametrize("start", [0, 7, 39])
def test_input_logprobs_match_hf(tiny, hf_logprobs, start):
    ids = prompt(1, 40)
    ref = hf_logprobs(ids)
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0},
                          return_logprob=True, logprob_start_len=start, top_logprobs_num=2)
    meta = out["meta_info"]
    _check_against_hf(meta, ids, start, ref)
    # Top logprobs per scored position: None first, then HF's top-2 at the previous position.
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(ids) - start and tops[0] is None
    for k, row in enumerate(tops[1:], start=start + 1):
        values, idx = torch.topk(ref[k - 1], 2)
        assert [t for _, t in row] == idx.tolist()
        assert abs(row[0][0] - values[0].item()) < 1e-4
    # The output token after the prompt is scored too (output_token_logprobs, unchanged).
    assert len(meta["output_token_logprobs"]) == 3
    engine.check_integrity()


def test_scoring_is_never_served_from_the_cache_and_survives_chunking(tiny, hf_logprobs):
    ids = prompt(2, 70)
    ref = hf_logprobs(ids)
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    # Warm the cache with the whole prompt (max_new_tokens 0 prefills and caches it).
    warm = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert warm["output_ids"] == [] and warm["meta_info"]["finish_reason"]["type"] == "length"
    again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == 69  # the cached prompt is hit
    # Scoring from position 20 may reuse [0, 20) only, and is chunked over 16-token prefills.
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=20)
    assert out["meta_info"]["cached_tokens"] == 20
    _check_against_hf(out["meta_info"], ids, 20, ref)
    assert out["meta_info"]["output_token_logprobs"] == []
    engine.check_integrity()


def test_token_ids_logprob_at_input_and_output_positions(tiny, hf_logprobs):
    ids = prompt(3, 12)
    ref = hf_logprobs(ids)
    watch = [5, 77, 200]
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0},
                          return_logprob=True, logprob_start_len=4, token_ids_logprob=watch)
    meta = out["meta_info"]
    rows = meta["input_token_ids_logprobs"]
    assert len(rows) == len(ids) - 4 and rows[0] is None
    for k, row in enumerate(rows[1:], start=5):
        assert [t for _, t in row] == watch
        for lp, t in row:
            assert abs(lp - ref[k - 1, t].item()) < 1e-4
    outs = meta["output_token_ids_logprobs"]
    assert len(outs) == 4
    # The first output position is the prompt's last: HF scores it too.
    for lp, t in outs[0]:
        assert abs(lp - ref[len(ids) - 1, t].item()) < 1e-4
    engine.check_integrity()


def test_batched_scoring_shares_the_prefix_and_matches_alone(tiny):
    """A frontend's select: one batch of prefix + choice, scored from the prefix's end."""
    prefix = prompt(4, 48)
    choices = [prompt(10 + i, 3 + i) for i in range(4)]
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    alone = [
        engine.generate(input_ids=prefix + c, sampling_params={"max_new_tokens": 0},
                        return_logprob=True, logprob_start_len=47)["meta_info"]
        for c in choices
    ]
    engine.flush_cache()
    batch = engine.generate(input_ids=[prefix + c for c in choices],
                            sampling_params={"max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=47)
    for a, b in zip(alone, batch):
        assert [t for _, t in a["input_token_logprobs"]] == [
            t for _, t in b["meta_info"]["input_token_logprobs"]]
        for (x, _), (y, _) in zip(a["input_token_logprobs"][1:],
                                  b["meta_info"]["input_token_logprobs"][1:]):
            assert abs(x - y) < 1e-4
    # Requests after the first reuse the 47 shared prefix tokens.
    assert sum(b["meta_info"]["cached_tokens"] >= 47 for b in batch) >= 3
    engine.check_integrity()


def test_bad_scoring_requests(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    ids = prompt(5, 10)
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=10)
    with pytest.raises(ValueError, match="needs return_logprob"):
        engine.generate(input_ids=ids, logprob_start_len=2)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        engine.generate(input_ids=ids, return_logprob=True, token_ids_logprob=[999999])
    engine.check_integrity()
