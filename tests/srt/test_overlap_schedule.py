"""`--enable-overlap-schedule`: decode steps launched one ahead of their result processing give
the plain scheduler's greedy tokens, whatever ends a request mid-batch (max_new_tokens, a stop
token or string, an abort), with prefills arriving while decode runs and the pool short enough
to retract; the speculative step after a finish leaks no KV slot or row (integrity checked after
every step). Requests that need their tokens on the host take the plain path; speculative
decoding, tensor parallelism and --compile are refused at start."""

from __future__ import annotations

import random

import pytest

from genserve import Engine
from genserve.srt.messages import TokenizedGenerateReq
from genserve.srt.sampling import SamplingParams
from tests.srt.test_engine import prompt

OVERLAP = dict(enable_overlap_schedule=True)
COMMON = dict(dtype="float32", max_total_tokens=2048, chunked_prefill_size=32)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def engines(tiny):
    """(plain, overlap) engines over the same tiny model."""
    pair = Engine(tiny, **COMMON), Engine(tiny, **COMMON, **OVERLAP)
    yield pair
    for engine in pair:
        engine.shutdown()


def greedy(n: int, **more) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **more}


def overlapped(engine: Engine) -> int:
    return engine.scheduler.stats["overlap_decode_steps"]


def run_script(engine: Engine, reqs: list[tuple], events: dict | None = None) -> dict:
    """Add reqs [(rid, ids, SamplingParams, extra fields)], step until idle (events: {step:
    fn(scheduler)} run before that step), checking integrity after every step. Returns
    {rid: (output ids, finish reason type)}."""
    sched = engine.scheduler
    for rid, ids, params, *extra in reqs:
        assert sched.add_request(TokenizedGenerateReq(rid, ids, params, **dict(extra))) is None
    got: dict[str, list[int]] = {}
    ends: dict[str, str] = {}
    steps = 0
    while sched.has_work() or (events and steps in events):
        if events and steps in events:
            events[steps](sched)
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_ids)
            if out.finished:
                ends[out.rid] = out.finish_reason["type"]
        sched.check_integrity()  # after every step, a step in flight or not
        steps += 1
        assert steps < 2000
    assert set(ends) == set(got)
    sched.check_integrity()
    return {rid: (got[rid], ends[rid]) for rid in got}


def test_concurrent_requests_of_different_lengths_get_the_plain_tokens(engines):
    """Six requests, prompts of 5 to 80 tokens (chunked), ending at different steps by
    max_new_tokens or a stop token; the speculative step after each finish is dropped."""
    plain, overlap = engines
    prompts = [prompt(30 + i, 5 + 15 * i) for i in range(6)]
    params = [greedy(n) for n in (1, 2, 5, 9, 16, 24)]
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    before = overlapped(overlap)
    got = [o["output_ids"] for o in overlap.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    assert overlapped(overlap) - before >= 20  # the longest request decoded overlapped
    # A stop token met mid-batch (the 4th token of the longest request).
    stop = want[5][3]
    params[5] = greedy(24, stop_token_ids=[stop])
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    outs = overlap.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    assert outs[5]["output_ids"][-1] == stop and len(outs[5]["output_ids"]) <= 4
    assert outs[5]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    overlap.check_integrity()
    # The same KV went to the cache as in the plain scheduler: nothing more, nothing less.
    assert overlap.scheduler.cache.total_size() == plain.scheduler.cache.total_size()


def test_abort_mid_decode_and_a_prefill_arriving_while_decode_runs(engines):
    plain, overlap = engines
    # a1, a2 and late0 stream: each token comes out once, in order (run_script joins them).
    reqs = [
        (f"a{i}", prompt(60 + i, 8 + 9 * i), SamplingParams(**greedy(40)), ("stream", i in (1, 2)))
        for i in range(4)
    ]
    late = [
        (f"late{i}", prompt(70 + i, 40 + 30 * i), SamplingParams(**greedy(12)), ("stream", i == 0))
        for i in range(2)
    ]  # both prefill in chunks of 32 while the others decode
    want = {rid: ids for rid, (ids, _) in run_script(plain, reqs + late).items()}
    base = overlapped(overlap)
    seen: dict[str, int] = {}

    def arrive(sched):
        assert sched.overlap.in_flight is not None  # the a's decode overlapped until now
        seen["before"] = overlapped(overlap) - base
        for rid, ids, params, *extra in late:
            sched.add_request(TokenizedGenerateReq(rid, ids, params, **dict(extra)))

    def abort(sched):
        assert sched.overlap.in_flight is not None  # a2's next token is in flight
        sched.abort("a2")

    got = run_script(overlap, reqs, events={8: arrive, 18: abort})
    assert seen["before"] > 0 and overlapped(overlap) - base > seen["before"] + 5
    assert got["a2"][1] == "abort"
    assert 0 < len(got["a2"][0]) < 40 and want["a2"][: len(got["a2"][0])] == got["a2"][0]
    for rid in want:
        if rid != "a2":
            assert got[rid] == (want[rid], "length"), rid


def test_stop_strings_mid_batch_match_the_plain_scheduler(smol_engine):
    """Real text (SmolLM2): a stop string ends one request while the others decode on."""
    overlap = Engine(dtype="float32", max_total_tokens=4096, **OVERLAP)
    tok = smol_engine.tokenizer
    chats = ["What is the capital of France?", "Name three colours.", "Count to five."]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
        )
        for c in chats
    ]
    params = [
        {"max_new_tokens": 16, "temperature": 0, "stop": " of Fr"},
        {"max_new_tokens": 20, "temperature": 0},
        {"max_new_tokens": 12, "temperature": 0, "stop": ["three", "3"]},
    ]
    want = smol_engine.generate(texts, params)
    got = overlap.generate(texts, params)
    assert got[0]["text"] == "The capital"
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["meta_info"]["finish_reason"] for g in got] == [
        w["meta_info"]["finish_reason"] for w in want
    ]
    assert overlapped(overlap) > 0
    overlap.check_integrity()
    overlap.shutdown()


def test_requests_that_need_host_tokens_take_the_plain_path(engines):
    """Logprobs and penalties read the last token on the host: those steps are plain, and the
    tokens and logprobs are the plain scheduler's."""
    plain, overlap = engines
    ids = prompt(90, 20)
    for sp, kwargs in (
        (greedy(10), dict(return_logprob=True, top_logprobs_num=2)),
        (greedy(10, repetition_penalty=1.3), {}),
    ):
        before = overlapped(overlap)
        want = plain.generate(input_ids=ids, sampling_params=sp, **kwargs)
        got = overlap.generate(input_ids=ids, sampling_params=sp, **kwargs)
        assert got["output_ids"] == want["output_ids"]
        for lp, want_lp in zip(
            got["meta_info"].get("output_token_logprobs", []),
            want["meta_info"].get("output_token_logprobs", []),
            strict=True,
        ):
            assert lp[1] == want_lp[1] and lp[0] == pytest.approx(want_lp[0], abs=1e-5)
        assert overlapped(overlap) == before  # not one overlapped step
    # Mixed with a plain request: the plain one overlaps once the other has ended.
    reqs = [
        ("lp", ids, SamplingParams(**greedy(4)), ("return_logprob", True)),
        ("plain", prompt(91, 12), SamplingParams(**greedy(16))),
    ]
    want = run_script(plain, reqs)
    before = overlapped(overlap)
    assert run_script(overlap, reqs) == want
    assert overlapped(overlap) > before


def test_seeded_sampling_gives_the_plain_tokens(engines):
    """Sampling runs in the worker thread with each request's own generator: a seeded request's
    tokens are the plain scheduler's, alone or beside others."""
    plain, overlap = engines
    seeded = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    prompts = [prompt(80, 15), prompt(81, 30)]
    params = [seeded, greedy(20)]
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    before = overlapped(overlap)
    got = [o["output_ids"] for o in overlap.generate(input_ids=prompts, sampling_params=params)]
    assert got == want and overlapped(overlap) > before
    overlap.check_integrity()


def test_a_short_pool_retracts_and_nothing_leaks(tiny):
    """Finish, abort and retraction at random over a pool too small for every request: the
    plain step evicts and retracts, then decode overlaps again; integrity after every step."""
    runs = []
    for extra in ({}, OVERLAP):
        engine = Engine(
            tiny, dtype="float32", max_total_tokens=320, max_running_requests=6, **extra
        )
        rng = random.Random(0)
        shared = prompt(11, 40)
        reqs = []
        for i in range(24):
            ids = (shared if rng.random() < 0.5 else []) + prompt(200 + i, rng.randrange(5, 60))
            reqs.append((f"r{i}", ids, SamplingParams(**greedy(rng.randrange(1, 90)))))
        aborts = {s: (lambda sched, rid=f"r{s % 24}": sched.abort(rid)) for s in (9, 30, 52)}
        runs.append(run_script(engine, reqs, aborts))
        assert engine.scheduler.stats["retractions"] > 0
        assert engine.flush_cache()
        sched = engine.scheduler
        assert sched.allocator.available_size() == sched.max_total_tokens
        engine.shutdown()
    plain_run, overlap_run = runs
    assert overlapped(engine) > 0
    done = [rid for rid in plain_run if plain_run[rid][1] == overlap_run[rid][1] == "length"]
    assert len(done) >= 18
    assert all(overlap_run[rid] == plain_run[rid] for rid in done)


def test_overlap_with_decode_graphs_gives_the_plain_tokens(tiny):
    """The graphs' static buffers take the step's input tokens from the future token map."""
    graphs = dict(enable_cuda_graph=True, cuda_graph_capture="eager", cuda_graph_max_bs=4)
    plain = Engine(tiny, dtype="float32", max_total_tokens=1024)
    both = Engine(tiny, dtype="float32", max_total_tokens=1024, **graphs, **OVERLAP)
    prompts = [prompt(i, 10 + 3 * i) for i in range(3)]
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy(9))]
    got = [o["output_ids"] for o in both.generate(input_ids=prompts, sampling_params=greedy(9))]
    assert got == want
    assert both.runtime.runner.decode_graphs.replays > 0 and overlapped(both) > 0
    both.check_integrity()


@pytest.mark.parametrize(
    "clash", [dict(speculative_algorithm="ngram"), dict(tp_size=2), dict(compile=True)]
)
def test_what_cannot_overlap_is_refused_at_start(clash):
    with pytest.raises(ValueError, match="--enable-overlap-schedule is not supported with"):
        Engine(**OVERLAP, **clash)


def test_the_flag_reaches_the_engine_and_keeps_auto_compile_off(tiny):
    """`genserve serve --enable-overlap-schedule`; an int8wo model on a CPU, where compile's auto
    default may turn on, decodes overlapped and uncompiled."""
    from genserve.entrypoints.cli import build_parser
    from genserve.entrypoints.serve import engine_args_from

    parse = build_parser().parse_args
    assert engine_args_from(parse(["serve"]), None).enable_overlap_schedule is False
    flagged = engine_args_from(parse(["serve", "--enable-overlap-schedule"]), None)
    assert flagged.enable_overlap_schedule is True
    common = dict(dtype="float32", max_total_tokens=1024, quantization="int8wo")
    plain = Engine(tiny, **common, compile=False)
    both = Engine(tiny, **common, **OVERLAP)
    assert not both.runtime.runner.compiled
    assert both.runtime.model_info()["overlap_schedule"] is True
    prompts = [prompt(5, 9), prompt(6, 17)]
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy(8))]
    got = [o["output_ids"] for o in both.generate(input_ids=prompts, sampling_params=greedy(8))]
    assert got == want and overlapped(both) > 0
    both.check_integrity()
