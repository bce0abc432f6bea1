"""Scheduler behaviour through the offline Engine: identical greedy tokens cold, cached, batched,
chunked and retracted; nothing leaks after any mix of finish / abort / retract."""

from __future__ import annotations

import random

import pytest

from genserve import Engine
from genserve.srt.messages import TokenizedGenerateReq
from genserve.srt.sampling import SamplingParams

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_same_tokens_cold_cached_batched_chunked_retracted(tiny):
    target = prompt(0, 90)
    ref = Engine(tiny, dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    cold = ref.generate(input_ids=target, sampling_params=GREEDY)["output_ids"]
    ref.check_integrity()

    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    first = engine.generate(input_ids=target, sampling_params=GREEDY)
    again = engine.generate(input_ids=target, sampling_params=GREEDY)
    assert first["output_ids"] == cold
    assert again["output_ids"] == cold
    assert again["meta_info"]["cached_tokens"] >= 89  # all but the last prompt token
    engine.check_integrity()

    others = [prompt(i, 20 + 5 * i) for i in range(1, 17)]
    batch = engine.generate(input_ids=others + [target], sampling_params=GREEDY)
    assert batch[-1]["output_ids"] == cold
    engine.check_integrity()

    chunked = Engine(tiny, dtype="float32", max_total_tokens=4096, chunked_prefill_size=32)
    assert chunked.generate(input_ids=target, sampling_params=GREEDY)["output_ids"] == cold
    assert chunked.scheduler.stats["prefill_batches"] >= 3
    chunked.check_integrity()

    # A pool too small for all of them at once: decode runs out of KV and retracts.
    tight = Engine(tiny, dtype="float32", max_total_tokens=300, max_running_requests=8)
    params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    many = [prompt(100 + i, 40) for i in range(6)] + [target]
    outs = tight.generate(input_ids=many, sampling_params=params)
    assert tight.scheduler.stats["retractions"] > 0
    solo = Engine(tiny, dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    for ids, out in zip(many, outs):
        assert (
            out["output_ids"] == solo.generate(input_ids=ids, sampling_params=params)["output_ids"]
        )
    tight.check_integrity()


def test_shared_prefix_is_computed_once(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    system = prompt(7, 200)
    reqs = [system + prompt(50 + i, 10) for i in range(8)]
    outs = engine.generate(input_ids=reqs, sampling_params={"max_new_tokens": 4, "temperature": 0})
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    # The first request computes the shared prefix; the others hit it in the cache.
    assert sorted(cached)[0] == 0
    assert all(c >= 200 for c in sorted(cached)[1:])
    engine.check_integrity()


def test_namespaces_never_share(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    ids = prompt(3, 64)
    engine.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="alice")
    other = engine.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="bob")
    same = engine.generate(input_ids=ids, sampling_params=GREEDY, cache_salt="alice")
    assert other["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] >= 63
    engine.check_integrity()


def test_seed_reproducible_and_n(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    ids = prompt(4, 30)
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    a = engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
    b = engine.generate(input_ids=ids, sampling_params=sp)["output_ids"]
    assert a == b
    # The same seeded request inside a batch with unseeded neighbours gives the same tokens.
    batch = engine.generate(
        input_ids=[prompt(9, 12), ids, prompt(10, 50)],
        sampling_params=[{"max_new_tokens": 16, "temperature": 1.0}, sp, GREEDY],
    )
    assert batch[1]["output_ids"] == a
    outs = engine.generate(input_ids=ids, sampling_params=dict(sp, n=3))
    assert isinstance(outs, list) and len(outs) == 3
    assert outs[0]["output_ids"] == a  # choice i uses seed + i
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert all(o["meta_info"]["cached_tokens"] >= 29 for o in outs[1:])
    engine.check_integrity()


def test_logprobs(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096)
    out = engine.generate(
        input_ids=prompt(5, 10), sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
    )
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 24
    for (lp, tok), top, chosen in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], out["output_ids"]
    ):
        assert tok == chosen and lp <= 0
        assert len(top) == 3 and top[0][1] == chosen  # greedy picks the top-1 token
        assert abs(top[0][0] - lp) < 1e-5


def test_bad_input_raises_clear_errors(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=4096, context_length=128)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(input_ids=[1, 2], sampling_params={"top_p": 2})
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=prompt(1, 100), sampling_params={"max_new_tokens": 64})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate(input_ids=[1, 2], sampling_params={"temprature": 0})
    with pytest.raises(ValueError, match="input token ids"):
        engine.generate(input_ids=[1, 999999], sampling_params={"max_new_tokens": 2})
    # A batch with one bad request fails as a whole and leaves nothing behind.
    with pytest.raises(ValueError, match="context length"):
        engine.generate(
            input_ids=[[1, 2, 3], prompt(1, 100)], sampling_params={"max_new_tokens": 64}
        )
    assert not engine.scheduler.has_work()
    assert engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
    small = Engine(tiny, dtype="float32", max_total_tokens=64)
    with pytest.raises(ValueError, match="never fit"):
        small.generate(input_ids=prompt(1, 50), sampling_params={"max_new_tokens": 30})
    engine.check_integrity()
    small.check_integrity()


def test_random_mix_of_finish_abort_retract_leaks_nothing(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=320, max_running_requests=6)
    sched = engine.scheduler
    rng = random.Random(0)
    shared = prompt(11, 40)
    rids = []
    for i in range(24):
        ids = (shared if rng.random() < 0.5 else []) + prompt(200 + i, rng.randrange(5, 60))
        rid = f"r{i}"
        params = SamplingParams(max_new_tokens=rng.randrange(1, 90), temperature=0, ignore_eos=True)
        assert sched.add_request(TokenizedGenerateReq(rid, ids, params)) is None
        rids.append(rid)
    finished = set()
    steps = 0
    while sched.has_work():
        if rng.random() < 0.15:
            sched.abort(rng.choice(rids))
        for out in sched.step():
            if out.finished:
                finished.add(out.rid)
        steps += 1
        sched.check_integrity()  # after every single step
        assert steps < 5000
    assert finished == set(rids)
    assert sched.stats["retractions"] > 0
    sched.check_integrity()
    assert sched.allocator.available_size() + sched.cache.total_size() == sched.max_total_tokens
    assert engine.flush_cache()
    assert sched.allocator.available_size() == sched.max_total_tokens


def test_stop_strings_and_text(smol_engine):
    tok = smol_engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    full = smol_engine.generate(text, {"max_new_tokens": 16, "temperature": 0})
    assert full["text"] == "The capital of France is Paris."
    cut = smol_engine.generate(text, {"max_new_tokens": 16, "temperature": 0, "stop": " of Fr"})
    assert cut["text"] == "The capital"
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": " of Fr"}
    ids = smol_engine.generate(
        text, {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [4649]}
    )
    assert ids["output_ids"][-1] == 4649
    assert ids["meta_info"]["finish_reason"]["matched"] == 4649
    smol_engine.check_integrity()
