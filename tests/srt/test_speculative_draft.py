"""Speculative decoding with a draft model (`--speculative-algorithm draft`): greedy output
equals plain decoding token for token (a batch of different lengths, a logprobs request riding
along plainly, a prefix-cache hit, retraction); the draft pool's KV follows the requests and
comes back when they end; a draft whose proposals fail stops being asked; bad draft models and
unsupported combinations are refused at start-up, naming the flag."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from genserve import Engine
from genserve.srt.sampling import SamplingParams
from genserve.srt.speculative.draft import DraftState
from genserve.srt.speculative.draft_model import check_same_tokenizer
from genserve.srt.tokenizer_manager import RequestState, make_tokenized_req
from tests.srt.conftest import make_tiny_model_dir
from tests.srt.test_speculative import repetitive

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another random model of the same shape and vocabulary: its drafts are mostly wrong."""
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-seed1"), "llama", 1))


def draft_engine(target: str, draft: str, **kw) -> Engine:
    return Engine(target, dtype="float32", max_total_tokens=kw.pop("max_total_tokens", 4096),
                  speculative_algorithm="draft", speculative_draft_model_path=draft, **kw)


def run_checked(engine: Engine, reqs: list) -> list:
    """Run tokenized requests through the scheduler, checking every pool after each step."""
    sched = engine.scheduler
    states = {r.rid: RequestState(r) for r in reqs}
    for r in reqs:
        assert sched.add_request(r) is None
    while sched.has_work():
        for out in sched.step():
            states[out.rid].update(out)
        sched.check_integrity()
        for req in sched.running:  # draft KV only for tokens in the sequence: none rejected
            state = req.spec_state
            if isinstance(state, DraftState) and state.row is not None:
                assert len(state.tokens) < req.seq_len
                assert state.tokens == req.fill_ids[: len(state.tokens)]
    return [states[r.rid].last for r in reqs]


def batch(prompts: list[list[int]], logprob_index: int) -> list:
    return [make_tokenized_req(p, SamplingParams.from_dict(GREEDY), rid=f"r{i}",
                               return_logprob=i == logprob_index)
            for i, p in enumerate(prompts)]


def test_greedy_output_equals_plain_decoding(tiny):
    """The target itself as the draft: every draft is right, so the draft KV must stay in step
    with the target's tokens for the acceptance to hold; output equals plain decoding."""
    warm = repetitive(50, 40)
    prompts = [repetitive(i, 12 + 11 * i) for i in range(5)]
    prompts.append(warm + [7, 8, 9])  # hits the prefix cache left by the warm-up request
    plain = Engine(tiny, dtype="float32", max_total_tokens=4096)
    plain.generate(input_ids=warm, sampling_params=GREEDY)
    want = run_checked(plain, batch(prompts, logprob_index=2))

    engine = draft_engine(tiny, tiny, speculative_num_steps=3)
    engine.generate(input_ids=warm, sampling_params=GREEDY)
    got = run_checked(engine, batch(prompts, logprob_index=2))
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert got[-1].cached_tokens >= len(warm) - 1
    # The logprobs request decoded plainly, in the same batch: same tokens, same logprobs.
    assert [lp for lp, _ in got[2].output_token_logprobs] == pytest.approx(
        [lp for lp, _ in want[2].output_token_logprobs], abs=1e-4)
    stats = engine.scheduler.stats
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"] > 0
    assert stats["decode_steps"] < stats["generated_tokens"] / 2
    engine.check_integrity()
    draft = engine.scheduler.spec.runner
    assert draft.allocator.available_size() == draft.max_total_tokens  # all draft KV is back


def test_a_poor_draft_keeps_outputs_and_stops_speculating(tiny, other):
    prompts = [repetitive(20 + i, 30) for i in range(3)]
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 64})

    def reqs() -> list:
        return [make_tokenized_req(p, params, rid=f"p{i}") for i, p in enumerate(prompts)]

    want = run_checked(Engine(tiny, dtype="float32", max_total_tokens=4096), reqs())
    engine = draft_engine(tiny, other)
    got = run_checked(engine, reqs())  # rejected drafts' KV is freed at once
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    stats = engine.scheduler.stats
    assert stats["spec_accepted_tokens"] < 0.2 * stats["spec_draft_tokens"]
    # Missed drafts back the requests off: most steps decode plainly.
    assert 0 < stats["spec_verify_steps"] < stats["decode_steps"] / 4
    engine.check_integrity()


def staggered(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Half the requests arrive after the first ones have decoded a few steps, so those decode
    inside the newcomers' (chunked) prefills without the draft model."""
    sched = engine.scheduler
    reqs = [make_tokenized_req(p, SamplingParams.from_dict(GREEDY), rid=f"s{i}")
            for i, p in enumerate(prompts)]
    states = {r.rid: RequestState(r) for r in reqs}
    half = len(reqs) // 2
    for i, r in enumerate(reqs):
        if i == half:
            for _ in range(4):
                for out in sched.step():
                    states[out.rid].update(out)
        sched.add_request(r)
    while sched.has_work():
        for out in sched.step():
            states[out.rid].update(out)
        sched.check_integrity()
    return [states[r.rid].last.output_ids for r in reqs]


def test_draft_catches_up_after_chunked_prefills_and_mixed_decodes(tiny):
    """A 16-token prefill budget: prompts prefill in chunks, the draft catches up on them over
    several steps, and running requests decode inside prefills without the draft."""
    prompts = [repetitive(60 + i, 20 + 15 * i) for i in range(4)]
    want = staggered(Engine(tiny, dtype="float32", max_total_tokens=4096,
                            chunked_prefill_size=16), prompts)
    engine = draft_engine(tiny, tiny, chunked_prefill_size=16)
    assert staggered(engine, prompts) == want
    stats = engine.scheduler.stats
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"] > 0
    engine.check_integrity()


def test_abort_and_finish_release_the_draft_kv(tiny):
    engine = draft_engine(tiny, tiny)
    sched = engine.scheduler
    draft = sched.spec.runner
    reqs = [make_tokenized_req(repetitive(30 + i, 20 + 5 * i),
                               SamplingParams.from_dict({**GREEDY, "max_new_tokens": 30 + 10 * i}),
                               rid=f"a{i}") for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):  # prefill, then two speculative steps
        sched.step()
        sched.check_integrity()
    holding = [r for r in sched.running if isinstance(r.spec_state, DraftState)
               and r.spec_state.row is not None]
    assert len(holding) == 3
    held = sum(len(r.spec_state.tokens) for r in holding)
    assert draft.allocator.available_size() == draft.max_total_tokens - held
    victim = holding[1]
    sched.abort(victim.rid)
    sched.step()
    sched.check_integrity()
    assert victim.spec_state.row is None and victim not in sched.running
    while sched.has_work():
        sched.step()
        sched.check_integrity()
    assert draft.allocator.available_size() == draft.max_total_tokens
    assert draft.req_to_token_pool.available_size() == draft.req_to_token_pool.size


def test_retraction_with_a_small_pool_loses_nothing(tiny):
    params = {**GREEDY, "max_new_tokens": 60}
    many = [repetitive(100 + i, 40) for i in range(7)]
    tight = draft_engine(tiny, tiny, max_total_tokens=300, max_running_requests=8)
    outs = tight.generate(input_ids=many, sampling_params=params)
    assert tight.scheduler.stats["retractions"] > 0
    plain = Engine(tiny, dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    want = plain.generate(input_ids=many, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    tight.check_integrity()
    draft = tight.scheduler.spec.runner
    assert draft.allocator.available_size() == draft.max_total_tokens


def test_sampled_requests_verify_drafts_by_rejection(tiny, other):
    """Sampling goes through verify.py's rejection rule (its distribution test is in
    test_speculative.py); here: drafts are verified, outputs are whole, the pools are too."""
    for draft in (tiny, other):
        engine = draft_engine(tiny, draft)
        params = {"max_new_tokens": 40, "temperature": 0.8, "seed": 3, "ignore_eos": True}
        outs = engine.generate(input_ids=[repetitive(7, 50), repetitive(8, 20)],
                               sampling_params=params)
        assert all(len(o["output_ids"]) == 40 and all(0 <= t < 256 for t in o["output_ids"])
                   for o in outs)
        assert engine.scheduler.stats["spec_verify_steps"] > 0
        engine.check_integrity()


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_algorithm": "draft"}, "needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "ngram", "speculative_draft_model_path": "x"},
     "applies to --speculative-algorithm draft"),
    ({"speculative_algorithm": "ngram", "speculative_num_steps": 3},
     "--speculative-num-steps applies to"),
    ({"speculative_algorithm": "draft", "speculative_draft_model_path": "x",
      "speculative_num_steps": 0}, "speculative_num_steps must be in"),
    ({"speculative_algorithm": "draft", "speculative_draft_model_path": "x", "tp_size": 2},
     "not supported with --tp > 1"),
    ({"speculative_algorithm": "draft", "speculative_draft_model_path": "x",
      "lora_paths": ["a=/nowhere"]}, "not supported with LoRA adapters"),
])
def test_unsupported_combinations_are_refused(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny, **kwargs)


def _edited_copy(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_bad_draft_models_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"--speculative-draft-model-path '/no/such/draft'.*"
                                         "does not exist"):
        draft_engine(tiny, "/no/such/draft")
    wide = _edited_copy(tiny, tmp_path / "wide", vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens, the target model 256"):
        draft_engine(tiny, wide)
    short = _edited_copy(tiny, tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ValueError, match="pass --context-length 128 or less"):
        draft_engine(tiny, short)
    assert draft_engine(tiny, short, context_length=128).generate(
        input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
    with pytest.raises(ValueError, match="not supported for vision-language models"):
        Engine("shapes-vl", speculative_algorithm="draft", speculative_draft_model_path=tiny)


def test_a_draft_with_another_tokenizer_is_refused():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    def tok(vocab: dict[str, int]) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, "<unk>")))

    mine = tok({"<unk>": 0, "hello": 1, "world": 2})
    check_same_tokenizer(mine, tok({"<unk>": 0, "hello": 1, "world": 2}), "d")
    check_same_tokenizer(mine, None, "d")  # a weights-only draft: vocabulary size only
    with pytest.raises(ValueError, match="another tokenizer than the target model"):
        check_same_tokenizer(mine, tok({"<unk>": 0, "world": 1, "hello": 2}), "d")


@pytest.mark.slow
def test_the_benchmark_smoke_run_compares_both_algorithms():
    """On the tiny random chat model: the run's steps and summary, not SmolLM2's answers."""
    from genserve.bench.tiny import tiny_chat_model

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_speculative.py"),
         "--algorithms", "ngram,draft", "--smoke", "--sets", "grounded",
         "--model", str(tiny_chat_model())],
        capture_output=True, text=True, timeout=600, cwd=root, check=True)
    summary = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])
    for algorithm in ("ngram", "draft"):
        assert summary["grounded"][algorithm]["identical_outputs"] is True
    assert summary["grounded"]["draft"]["acceptance"] > 0.9  # the model drafts for itself
