"""Speculative decoding (`--speculative-algorithm ngram`): proposals, verification and the
scheduler path. Greedy output must equal plain decoding token for token (batched, cached,
retracted, with stop strings and ineligible requests mixed in); sampled output must keep the
target distribution; no KV slot may leak."""

from __future__ import annotations

import random

import pytest
import torch

from genserve import Engine
from genserve.srt.sampling import SamplingParams
from genserve.srt.speculative import NgramProposer, verify_draft
from genserve.srt.speculative.ngram import ForwardCost, NgramState
from genserve.srt.speculative.verify import target_probs


def test_ngram_proposes_what_followed_the_longest_recent_match():
    prop = NgramProposer(num_draft_tokens=3, min_n=2, max_n=4)
    state = NgramState()
    prompt = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 10]
    # The context ends in "6 7": its most recent earlier occurrence is followed by 3 4 10.
    assert prop.propose(state, prompt, [6, 7], limit=8) == [3, 4, 10]
    # A longer match wins over a more recent shorter one: "2 3 4" was followed by 9,
    # the more recent "3 4" by 7.
    assert prop.propose(NgramState(), [1, 2, 3, 4, 9, 3, 4, 7], [2, 3, 4], limit=8) == [9, 3, 4]
    # The limit (max_new_tokens, context) caps the draft; no match: nothing.
    assert prop.propose(NgramState(), prompt, [6, 7], limit=1) == [3]
    assert prop.propose(NgramState(), prompt, [42, 43], limit=8) == []
    # The index grows with the output: the output's own repeats are found.
    state = NgramState()
    assert prop.propose(state, [11, 12], [20, 21, 22], limit=8) == []
    assert prop.propose(state, [11, 12], [20, 21, 22, 23, 20, 21], limit=8) == [22, 23, 20]


def test_ngram_backs_off_after_misses_and_resets_on_a_hit():
    prop = NgramProposer(num_draft_tokens=2, min_n=1, max_n=2)
    state = NgramState()
    ctx = [1, 2, 3, 1, 2]
    assert prop.propose(state, ctx, [], limit=4) == [3, 1]
    prop.record(state, proposed=2, accepted=0)  # skip 1 step
    assert prop.propose(state, ctx, [], limit=4) == []
    assert prop.propose(state, ctx, [], limit=4) == [3, 1]
    prop.record(state, proposed=2, accepted=0)  # skip 2 steps now
    assert [prop.propose(state, ctx, [], limit=4) for _ in range(3)] == [[], [], [3, 1]]
    prop.record(state, proposed=2, accepted=1)
    assert state.backoff == 1 and (state.proposed, state.accepted) == (6, 1)


def test_ngram_index_is_rebuilt_when_the_output_shrinks():
    prop = NgramProposer(num_draft_tokens=2, min_n=1, max_n=2)
    state = NgramState()
    prop.propose(state, [1, 2, 3], [4, 5, 6], limit=4)
    # A jump-forward rewind or a retokenization took tokens back: no stale n-gram survives.
    assert prop.propose(state, [1, 2, 3], [4], limit=4) == []
    assert prop.propose(state, [1, 2, 3], [4, 1], limit=4) == [2, 3]


def test_greedy_verification_keeps_the_matching_prefix_and_the_target_token():
    vocab = 8
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([3, 5, 2, 7]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    assert verify_draft(logits, [3, 5, 2], greedy, None) == [3, 5, 2, 7]  # all + bonus
    assert verify_draft(logits, [3, 4, 2], greedy, None) == [3, 5]  # stops at the miss
    assert verify_draft(logits, [1, 5, 2], greedy, None) == [3]
    assert verify_draft(logits[:1], [], greedy, None) == [3]
    with pytest.raises(ValueError, match="logit rows"):
        verify_draft(logits, [3], greedy, None)


@pytest.mark.parametrize("params", [
    {"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 1.3, "top_p": 0.8},
])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """On a 5-token vocabulary, the first emitted token follows p0 and, after an accepted first
    draft token, the second follows p1 -- whatever the draft proposes."""
    vocab, trials = 5, 6000
    sp = SamplingParams(max_new_tokens=8, **params)
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 1.5
    probs = target_probs(logits, sp)
    # The least likely token that can be drawn at all (top-k / top-p cut some), then the likeliest.
    unlikely = int(torch.where(probs[0] > 0, probs[0], torch.tensor(2.0)).argmin())
    draft = [unlikely, int(probs[1].argmax())]
    gen = torch.Generator().manual_seed(1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        out = verify_draft(logits, draft, sp, gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        n = counts.sum()
        expected = p * n
        # Every token within 4.5 standard deviations of its binomial count.
        sd = (n * p * (1 - p)).clamp_min(1e-9).sqrt()
        assert ((counts - expected).abs() <= 4.5 * sd + 1).all(), (counts, expected)
    assert second.sum() > 0  # the unlikely draft was accepted sometimes


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def repetitive(seed: int, n: int) -> list[int]:
    """A prompt that repeats a short motif with variations, as quoted or edited text does."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, 256) for _ in range(12)]
    out: list[int] = []
    while len(out) < n:
        out += motif[: rng.randrange(6, 13)]
    return out[:n]


class UnmeasuredCost(ForwardCost):
    """A forward cost that ignores its timings, so drafts always look free (rho 0): whether a
    request speculates then depends on its acceptance only, never on how loaded the machine
    running the test is (priced drafts turned speculation off on a busy run)."""

    def record_decode(self, seconds: float) -> None:
        pass

    def record_verify(self, seconds: float, extra_tokens: int) -> None:
        pass


def spec_engine(path: str, **kw) -> Engine:
    engine = Engine(path, dtype="float32", max_total_tokens=kw.pop("max_total_tokens", 4096),
                    speculative_algorithm="ngram", **kw)
    engine.scheduler.spec.cost = UnmeasuredCost()
    return engine


def test_greedy_output_equals_plain_decoding_batched_and_cached(tiny):
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    prompts = [repetitive(i, 30 + 7 * i) for i in range(6)]
    plain = Engine(tiny, dtype="float32", max_total_tokens=4096)
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]

    engine = spec_engine(tiny, speculative_num_draft_tokens=5)
    solo = engine.generate(input_ids=prompts[0], sampling_params=params)["output_ids"]
    assert solo == want[0]
    batch = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in batch] == want
    stats = engine.scheduler.stats
    assert stats["spec_verify_steps"] > 0
    assert stats["spec_accepted_tokens"] > 0, "no draft was ever accepted: nothing was tested"
    # Fewer forwards than tokens: accepted drafts saved decode steps.
    assert stats["decode_steps"] < stats["generated_tokens"]
    engine.check_integrity()


def test_mixed_eligibility_limits_and_stop_tokens(tiny):
    engine = spec_engine(tiny, speculative_num_draft_tokens=4)
    plain = Engine(tiny, dtype="float32", max_total_tokens=4096)
    prompts = [repetitive(10 + i, 40) for i in range(5)]
    base = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    free_run = plain.generate(input_ids=prompts[4], sampling_params=base)["output_ids"]
    per_req = [
        {**base, "max_new_tokens": 37},  # a cap that falls inside a draft
        {**base, "frequency_penalty": 0.5},  # penalties: decodes plainly in the same forward
        {**base, "min_new_tokens": 10},  # speculates once the minimum is reached
        base,
        {**base, "stop_token_ids": [free_run[12]]},  # stops inside an accepted draft
    ]
    got = engine.generate(input_ids=prompts, sampling_params=per_req)
    want = plain.generate(input_ids=prompts, sampling_params=per_req)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert len(got[0]["output_ids"]) == 37
    assert got[4]["output_ids"][-1] == free_run[12] and len(got[4]["output_ids"]) <= 13
    assert engine.scheduler.stats["spec_accepted_tokens"] > 0
    # Logprobs and top logprobs come from the verify's rows: the same as plain decoding's.
    accepted = engine.scheduler.stats["spec_accepted_tokens"]
    lp_got = engine.generate(input_ids=prompts[3], sampling_params=base, return_logprob=True,
                             top_logprobs_num=3)
    lp_want = plain.generate(input_ids=prompts[3], sampling_params=base, return_logprob=True,
                             top_logprobs_num=3)
    assert engine.scheduler.stats["spec_accepted_tokens"] > accepted  # it speculated
    assert lp_got["output_ids"] == lp_want["output_ids"]
    got, want = lp_got["meta_info"], lp_want["meta_info"]
    assert len(got["output_token_logprobs"]) == len(lp_got["output_ids"])
    for (g, gid), (w, wid) in zip(got["output_token_logprobs"], want["output_token_logprobs"],
                                  strict=True):
        assert gid == wid and g == pytest.approx(w, abs=1e-4)
    for g_top, w_top in zip(got["output_top_logprobs"], want["output_top_logprobs"],
                            strict=True):
        assert [i for _, i in g_top] == [i for _, i in w_top]
        assert [v for v, _ in g_top] == pytest.approx([v for v, _ in w_top], abs=1e-4)
    engine.check_integrity()


def test_retraction_and_a_small_pool_lose_nothing(tiny):
    params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    many = [repetitive(100 + i, 40) for i in range(7)]
    tight = spec_engine(tiny, max_total_tokens=300, max_running_requests=8)
    outs = tight.generate(input_ids=many, sampling_params=params)
    assert tight.scheduler.stats["retractions"] > 0
    plain = Engine(tiny, dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    want = plain.generate(input_ids=many, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    tight.check_integrity()


def test_seeded_sampling_with_speculation_is_reproducible_and_bounded(tiny):
    engine = spec_engine(tiny)
    params = {"max_new_tokens": 40, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    prompt_ids = repetitive(7, 50)
    a = engine.generate(input_ids=prompt_ids, sampling_params=params)["output_ids"]
    b = engine.generate(input_ids=prompt_ids, sampling_params=params)["output_ids"]
    assert a == b and len(a) == 40 and all(0 <= t < 256 for t in a)
    engine.check_integrity()


def test_bad_speculative_arguments_are_refused(tiny):
    with pytest.raises(ValueError, match="speculative_algorithm must be one of"):
        Engine(tiny, speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        Engine(tiny, speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        Engine(tiny, speculative_algorithm="ngram", speculative_ngram_min_match_window_size=4,
               speculative_ngram_max_match_window_size=2)


def test_draft_length_follows_acceptance_and_cost():
    from genserve.srt.speculative.ngram import ForwardCost, best_draft_len

    assert best_draft_len(1.0, 0.0, 5) == 5  # free and always accepted: the longest
    assert best_draft_len(0.9, 0.2, 8) > best_draft_len(0.6, 0.2, 8) > 0
    assert best_draft_len(0.3, 0.4, 8) == 0  # costs more than it brings: decode plainly
    cost = ForwardCost()
    assert cost.rho == 0.0  # nothing measured: drafts look free
    cost.record_decode(0.030)
    cost.record_verify(0.030 + 4 * 0.006, extra_tokens=4)
    assert cost.rho == pytest.approx(0.2)
    cost.record_decode(5.0)  # a stall is not the step's cost
    assert cost.step_s == pytest.approx(0.030)
    # The proposer cuts its draft to what pays for this request.
    prop = NgramProposer(num_draft_tokens=4, min_n=1, max_n=2)
    state = NgramState()
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]
    assert prop.propose(state, ctx, [], limit=8, rho=0.2) == [3, 4, 5, 6]
    for _ in range(6):
        prop.record(state, proposed=4, accepted=1)
    state.skip = 0
    assert len(prop.propose(state, ctx, [], limit=8, rho=0.2)) < 4


def test_verify_as_decode_rows_keeps_greedy_output(tiny, monkeypatch):
    """A lone request's verify laid out as decode rows of its one req_to_token row (what the
    compiled decode step runs under GENSERVE_SPEC_COMPILED_VERIFY) gives plain decoding's
    tokens; forced here on an eager float32 engine, where the layout is all that differs."""
    from genserve.srt.scheduler import speculative
    from genserve.srt.speculative.verify_rows import MAX_ROWS

    calls = []

    def always(runner, num_reqs, num_tokens):
        use = num_reqs == 1 and 1 < num_tokens <= MAX_ROWS
        calls.append(use)
        return use

    monkeypatch.setattr(speculative, "use_verify_rows", always)
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    prompts = [repetitive(i, 30 + 7 * i) for i in range(4)]
    plain = Engine(tiny, dtype="float32", max_total_tokens=4096)
    want = [plain.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    engine = spec_engine(tiny, speculative_num_draft_tokens=5)
    got = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    assert got == want
    assert any(calls), "no verify ran as decode rows: nothing was tested"
    assert engine.scheduler.stats["spec_accepted_tokens"] > 0
    engine.check_integrity()
