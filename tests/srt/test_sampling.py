"""SamplingParams validation and the batched Sampler, checked against transformers' processors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from genserve.srt.sampling.sampler import (
    Sampler,
    SamplingBatchInfo,
    apply_frequency_presence_penalty,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_vocab_bitmask,
    sample_from_probs,
)
from genserve.srt.sampling.sampling_params import SamplingParams

VOCAB = 64
EOS = 5


def make_logits(batch: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, VOCAB, generator=g) * 3.0


def build(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    device: str = "cpu",
) -> SamplingBatchInfo:
    n = len(params)
    return SamplingBatchInfo.build(
        params,
        generators or [None] * n,
        prompt_ids or [[] for _ in range(n)],
        output_ids or [[] for _ in range(n)],
        {EOS},
        VOCAB,
        device,
    )


def seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_k": -2}, "top_k", ">= 1"),
        ({"min_p": 1.1}, "min_p", "[0, 1]"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
        ({"presence_penalty": -3}, "presence_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "(0, 2]"),
        ({"max_new_tokens": -1}, "max_new_tokens", ">= 0"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens", "max_new_tokens"),
        ({"n": 0}, "n", "[1, 64]"),
        ({"n": 65}, "n", "[1, 64]"),
        ({"seed": -1}, "seed", "2**63"),
        ({"stop": ["ok", ""]}, "stop", "non-empty"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "16"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", ">= 0"),
        ({"max_new_tokens": True}, "max_new_tokens", "integer"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"ignore_eos": 1}, "ignore_eos", "true or false"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value)
    assert fragment in str(err.value)


def test_normalisation_and_properties():
    p = SamplingParams(stop="###", stop_token_ids=[7, 8], top_k=0, temperature=1)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 8)
    assert p.top_k == -1 and isinstance(p.temperature, float)
    assert not p.is_greedy and not p.needs_penalties
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties
    hash(p)  # frozen dataclass of tuples: usable as a dict key


def test_from_dict():
    assert SamplingParams.from_dict(None) == SamplingParams()
    p = SamplingParams.from_dict(
        {"max_new_tokens": None, "temperature": 0.5, "stop": ["a", "b"], "json_schema": None}
    )
    assert p.max_new_tokens == 128 and p.temperature == 0.5 and p.stop == ("a", "b")
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown sampling parameter 'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5})
    assert SamplingParams.from_dict({"regex": "x+"}).grammar_key == ("regex", "x+")


# ------------------------------------------------------------------- processors vs transformers


def finite_set(x: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in x]


@pytest.mark.parametrize("top_k", [1, 3, 10, VOCAB])
def test_top_k_matches_transformers(top_k):
    logits = make_logits()
    ours = apply_top_k(logits, torch.full((4,), top_k))
    ref = TopKLogitsWarper(top_k)(None, logits.clone())
    assert torch.equal(ours, ref)
    assert all(len(s) == top_k for s in finite_set(ours))


def test_top_k_per_row_and_disabled():
    logits = make_logits()
    ours = apply_top_k(logits, torch.tensor([2, -1, 5, 0]))
    assert [len(s) for s in finite_set(ours)] == [2, VOCAB, 5, VOCAB]


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.8, 0.95])
@pytest.mark.parametrize("candidates", [4, 256])  # 4: the top-k shortcut and its fallback
def test_top_p_matches_transformers(top_p, candidates):
    logits = make_logits(batch=8, seed=1)
    ours = apply_top_p(logits, torch.full((8,), top_p), candidates=candidates)
    ref = TopPLogitsWarper(top_p)(None, logits.clone())
    assert finite_set(ours) == finite_set(ref)
    kept = torch.isfinite(ours)
    assert torch.equal(ours[kept], logits[kept])
    assert all(len(s) >= 1 for s in finite_set(ours))


def test_top_p_one_keeps_everything():
    logits = make_logits()
    for candidates in (4, 256):
        ps = torch.tensor([1.0, 0.01, 1.0, 0.01])
        out = apply_top_p(logits, ps, candidates=candidates)
        assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
        assert [len(s) for s in finite_set(out)][1::2] == [1, 1]


def test_sample_from_probs_draws_only_allowed_tokens_in_proportion():
    probs = torch.zeros(2, VOCAB)
    probs[0, [1, 2, 40]] = torch.tensor([0.5, 0.3, 0.2])
    probs[1, VOCAB - 2] = 1.0  # first and last entries have probability 0
    g = seeded(0)
    draws = torch.stack([sample_from_probs(probs, g) for _ in range(2000)])  # [2000, 2]
    assert set(draws[:, 1].tolist()) == {VOCAB - 2}
    row0 = draws[:, 0].tolist()
    assert set(row0) == {1, 2, 40}
    for token, p in ((1, 0.5), (2, 0.3), (40, 0.2)):
        assert abs(row0.count(token) / len(row0) - p) < 0.05


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(min_p):
    logits = make_logits(batch=8, seed=2)
    ours = apply_min_p(logits, torch.full((8,), min_p))
    ref = MinPLogitsWarper(min_p)(None, logits.clone())
    assert finite_set(ours) == finite_set(ref)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(temperature):
    logits = make_logits()
    ours = apply_temperature(logits, torch.full((4,), temperature))
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    torch.testing.assert_close(ours, ref)


def test_repetition_penalty_matches_transformers():
    logits = make_logits(batch=3, seed=3)
    prompts = [[1, 2, 3], [10, 10, 40], [63]]
    outputs = [[4, 2], [], [0, 1, 2]]
    penalties = [1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p, temperature=0) for p in penalties]
    info = build(params, prompt_ids=prompts, output_ids=outputs)
    ours = apply_repetition_penalty(logits, info.repetition_penalties, info.seen_tokens)
    for row, penalty in enumerate(penalties):
        ids = torch.tensor([prompts[row] + outputs[row]])
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], ref)
    assert not torch.equal(ours, logits)
    # The sampler applies it: greedy picks the argmax of the penalised logits.
    out = Sampler().sample(logits, info)
    assert torch.equal(out.next_token_ids, ours.argmax(-1))


def test_frequency_presence_arithmetic_counts_output_only():
    logits = torch.zeros(2, VOCAB)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, temperature=0),
        SamplingParams(temperature=0),
    ]
    # Token 9 appears in the prompt only: no frequency/presence penalty for it.
    info = build(params, prompt_ids=[[9, 9], [7]], output_ids=[[3, 3, 3, 4], [3]])
    ours = apply_frequency_presence_penalty(
        logits, info.output_counts, info.frequency_penalties, info.presence_penalties
    )
    assert ours[0, 3].item() == pytest.approx(-(0.5 * 3 + 1.0))
    assert ours[0, 4].item() == pytest.approx(-(0.5 * 1 + 1.0))
    assert ours[0, 9].item() == 0.0
    assert torch.count_nonzero(ours[1]) == 0  # row without penalties untouched


def test_append_output_tokens_equals_rebuild():
    params = [
        SamplingParams(frequency_penalty=0.4, repetition_penalty=1.5, min_new_tokens=2),
        SamplingParams(presence_penalty=-0.5),
    ]
    prompts, outputs = [[1, 2], [3]], [[6], []]
    info = build(params, prompt_ids=prompts, output_ids=outputs)
    info.append_output_tokens(torch.tensor([8, 8]))
    rebuilt = build(params, prompt_ids=prompts, output_ids=[[6, 8], [8]])
    logits = make_logits(batch=2)
    sampler = Sampler()
    for field in ("output_counts", "seen_tokens"):
        assert torch.equal(getattr(info, field), getattr(rebuilt, field))
    assert info.mask_rows is None and rebuilt.mask_rows is None  # min_new_tokens reached
    greedy = [
        SamplingParams(temperature=0, **{k: v for k, v in p.to_dict().items() if "penalty" in k})
        for p in params
    ]
    a = build(greedy, prompt_ids=prompts, output_ids=outputs)
    a.append_output_tokens(torch.tensor([8, 8]))
    b = build(greedy, prompt_ids=prompts, output_ids=[[6, 8], [8]])
    assert torch.equal(
        sampler.sample(logits, a).next_token_ids, sampler.sample(logits, b).next_token_ids
    )


def test_min_new_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0  # EOS is by far the most likely token
    logits[:, 11] = 9.0  # a stop token id of row 0
    params = [
        SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[11]),
        SamplingParams(temperature=0, min_new_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, min_new_tokens=1),  # already has one output token
    ]
    info = build(params, output_ids=[[1], [], [2]])
    next_ids = Sampler().sample(logits, info).next_token_ids.tolist()
    assert next_ids[0] not in (EOS, 11)
    assert next_ids[1] == 11  # EOS is masked even with ignore_eos; 11 is not its stop id
    assert next_ids[2] == EOS
    # Once min_new_tokens is reached, EOS is allowed again.
    info.append_output_tokens(torch.tensor(next_ids))
    info.append_output_tokens(torch.tensor(next_ids))
    assert Sampler().sample(logits, info).next_token_ids.tolist()[0] == EOS


# ---------------------------------------------------------------------------------- sampling


def test_greedy_is_argmax_and_logprobs():
    logits = make_logits(batch=5).to(torch.bfloat16)
    info = build([SamplingParams(temperature=0)] * 4 + [SamplingParams(top_k=1)])
    assert info.all_greedy
    out = Sampler().sample(logits, info, top_logprobs_num=5, return_logprob=True)
    assert torch.equal(out.next_token_ids, logits.float().argmax(-1))
    ref = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.next_token_ids[:, None])[:, 0])
    assert out.logprobs.dtype == torch.float32
    assert out.top_logprobs_values.shape == (5, 5)
    assert torch.all(out.top_logprobs_values[:, :-1] >= out.top_logprobs_values[:, 1:])
    torch.testing.assert_close(out.top_logprobs_values, ref.gather(1, out.top_logprobs_ids))
    # Greedy: the chosen token is the top-1 entry.
    assert torch.equal(out.top_logprobs_ids[:, 0], out.next_token_ids)


def test_logprobs_are_of_raw_logits_not_penalised():
    logits = make_logits(batch=2)
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.8, top_k=4, seed=1)] * 2
    info = build(params, [seeded(1), None], prompt_ids=[[0, 1, 2], [3]])
    out = Sampler().sample(logits, info, return_logprob=True)
    ref = torch.log_softmax(logits, dim=-1).gather(1, out.next_token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, ref)


def test_sampled_tokens_respect_filters():
    logits = make_logits(batch=3, seed=5)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.2), SamplingParams(min_p=0.5)]
    allowed = [
        finite_set(apply_top_k(logits[:1], torch.tensor([3])))[0],
        finite_set(apply_top_p(logits[1:2], torch.tensor([0.2])))[0],
        finite_set(apply_min_p(logits[2:], torch.tensor([0.5])))[0],
    ]
    info = build(params)
    sampler = Sampler()
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(50):
        for row, token in enumerate(sampler.sample(logits, info).next_token_ids.tolist()):
            assert token in allowed[row]
            seen[row].add(token)
    assert len(seen[0]) > 1  # it samples, it does not just take the argmax


def test_seed_reproduces_alone_and_in_batch():
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=42)
    other = SamplingParams(temperature=0.8)
    sampler = Sampler()

    def run_alone(steps: int) -> list[int]:
        g, tokens = seeded(42), []
        for step in range(steps):
            logits = make_logits(batch=1, seed=100 + step)
            info = build([params], [g])
            tokens.append(int(sampler.sample(logits, info).next_token_ids[0]))
        return tokens

    def run_batched(steps: int) -> list[int]:
        g, tokens = seeded(42), []
        greedy = SamplingParams(temperature=0)
        for step in range(steps):
            row = make_logits(batch=1, seed=100 + step)
            # The seeded row sits in the middle, between an unseeded and a greedy row,
            # and a second seeded row draws from its own generator.
            logits = torch.cat([make_logits(batch=1, seed=7), row, make_logits(2, seed=step)])
            info = build([other, params, greedy, params], [None, g, None, seeded(step)])
            tokens.append(int(sampler.sample(logits, info).next_token_ids[1]))
        return tokens

    alone = run_alone(12)
    assert alone == run_alone(12)
    assert alone == run_batched(12)
    assert len(set(alone)) > 1


def test_different_seeds_differ_and_unseeded_rows_sample():
    logits = torch.zeros(1, VOCAB)  # uniform: two seeds agree 12 times with prob 64**-12
    sampler = Sampler()
    draws = {}
    for seed in (1, 2):
        g = seeded(seed)
        info = build([SamplingParams(seed=seed)], [g])
        draws[seed] = [int(sampler.sample(logits, info).next_token_ids[0]) for _ in range(12)]
    assert draws[1] != draws[2]
    info = build([SamplingParams()] * 2)
    batch_logits = logits.expand(2, VOCAB)
    tokens = {int(t) for _ in range(10) for t in sampler.sample(batch_logits, info).next_token_ids}
    assert len(tokens) > 1


def test_temperature_sharpens_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    sampler = Sampler()
    g = seeded(0)
    counts = {}
    for t in (0.2, 3.0):
        info = build([SamplingParams(temperature=t, seed=0)], [g])
        tokens = [int(sampler.sample(logits, info).next_token_ids[0]) for _ in range(300)]
        counts[t] = tokens.count(0) / len(tokens)
    # p(token 0) is softmax(logits / t)[0]: ~0.99 at t=0.2, ~0.4 at t=3.
    assert counts[0.2] > 0.95
    assert abs(counts[3.0] - torch.softmax(logits[0, :4] / 3.0, 0)[0].item()) < 0.12


def test_bad_logits_shape_is_rejected():
    info = build([SamplingParams()])
    with pytest.raises(ValueError, match="vocab"):
        Sampler().sample(torch.zeros(1, VOCAB + 1), info)
    with pytest.raises(ValueError, match="batch"):
        Sampler().sample(torch.zeros(2, VOCAB), info)


def test_build_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatchInfo.build([SamplingParams()], [], [[]], [[]], {EOS}, VOCAB, "cpu")


def test_no_penalty_batch_builds_no_vocab_tensors():
    info = build([SamplingParams(), SamplingParams(temperature=0)], output_ids=[[1] * 50, [2]])
    assert not info.has_penalties and not info.has_token_mask
    assert info.output_counts is None and info.seen_tokens is None
    assert not math.isnan(info.temperatures.sum().item())


@pytest.mark.gpu
def test_cuda_sampling():
    """The same semantics on a GPU: seeded rows alone == batched, filters, penalties, masks."""
    dev = "cuda"
    sampler = Sampler()
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02, seed=5)
    plain = SamplingParams(temperature=1.1, repetition_penalty=1.2, frequency_penalty=0.5)
    greedy = SamplingParams(temperature=0, presence_penalty=1.0, min_new_tokens=4)
    g_alone, g_batch = seeded(5, dev), seeded(5, dev)
    alone, batched = [], []
    for step in range(16):
        row = make_logits(batch=1, seed=200 + step).to(dev)
        info = build([params], [g_alone], device=dev)
        alone.append(int(sampler.sample(row, info).next_token_ids[0]))
        logits = torch.cat([make_logits(1, seed=step).to(dev), row, row])
        logits[2, EOS] = 50.0
        info = build(
            [plain, params, greedy],
            [None, g_batch, None],
            prompt_ids=[[1, 2, 3], [4], [5, 6]],
            output_ids=[[7] * step, [], [8]],
            device=dev,
        )
        out = sampler.sample(logits, info, top_logprobs_num=3, return_logprob=True)
        ids = out.next_token_ids.tolist()
        batched.append(ids[1])
        assert ids[2] != EOS  # min_new_tokens=4 masks EOS even at logit 50
        ref = torch.log_softmax(logits, dim=-1).gather(1, out.next_token_ids[:, None])
        torch.testing.assert_close(out.logprobs, ref[:, 0])
    assert alone == batched
    assert len(set(alone)) > 1


def test_logit_bias_shifts_only_its_row_and_token():
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 2.0
    params = [SamplingParams(temperature=0, logit_bias={"9": 3.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={5: -100, 7: 0.5})]
    out = Sampler().sample(logits, build(params), return_logprob=True)
    assert out.next_token_ids.tolist() == [9, 5, 7]
    # logprobs stay those of the model's raw logits
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[[0, 1, 2], [9, 5, 7]])


@pytest.mark.parametrize("bias, fragment", [({"x": 1.0}, "token ids"), ({"-1": 1.0}, ">= 0"),
                                            ({"3": 101}, "[-100, 100]"), ([1], "logit_bias")])
def test_logit_bias_validation(bias, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(logit_bias=bias)
    assert fragment in str(err.value)
    p = SamplingParams.from_dict({"logit_bias": {"3": 1, "1": -2.5}})
    assert p.logit_bias == ((1, -2.5), (3, 1.0))
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_vocab_bitmask_restricts_only_constrained_rows():
    logits = torch.randn(3, VOCAB)
    allowed = {0: [3, 40, 63], 2: [33]}  # 63: the sign bit of the second word
    bitmask = torch.zeros(2, VOCAB // 32, dtype=torch.int32)
    for k, row in enumerate(sorted(allowed)):
        for t in allowed[row]:
            word = int(bitmask[k, t // 32]) | (1 << (t % 32))
            bitmask[k, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    out = apply_vocab_bitmask(logits, torch.tensor([0, 2]), bitmask)
    assert finite_set(out)[0] == {3, 40, 63} and finite_set(out)[2] == {33}
    assert torch.equal(out[1], logits[1])
    params = [SamplingParams(temperature=0)] * 3
    info = build(params)
    info.grammar_rows, info.grammar_bitmask = torch.tensor([0, 2]), bitmask
    ids = Sampler().sample(logits, info).next_token_ids.tolist()
    assert ids[0] in allowed[0] and ids[2] == 33 and ids[1] == int(logits[1].argmax())
