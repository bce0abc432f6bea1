"""The schedule policies change what a user notices: which waiting requests run first, and so
how many prompt tokens come from the cache when the KV pool is tight.

One request runs at a time (`max_running_requests=1`), so the order in which requests leave the
waiting queue is the order they run. Two prefixes are cached (A: 64 tokens, B: 96); seven
requests arrive: two share nothing with the cache (x), three extend A, two extend B. The pool
(260 tokens) cannot hold both prefixes and a fresh 100-token prompt, so running a fresh prompt
first evicts cached prefixes that later requests would have hit.
"""

from __future__ import annotations

import random

import pytest

from genserve import Engine
from genserve.srt.messages import TokenizedGenerateReq
from genserve.srt.sampling import SamplingParams


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


A, B = prompt(1, 64), prompt(2, 96)
ARRIVALS = [("x1", prompt(20, 100)), ("b1", B + prompt(21, 8)), ("a1", A + prompt(22, 8)),
            ("x2", prompt(23, 100)), ("a2", A + prompt(24, 8)), ("b2", B + prompt(25, 8)),
            ("a3", A + prompt(26, 8))]
MATCHED = {"a1": 64, "a2": 64, "a3": 64, "b1": 96, "b2": 96}  # cached prefix, if kept


def run(model: str, policy: str) -> tuple[list[str], dict[str, int]]:
    """(the order requests left the waiting queue, cached prompt tokens per request)."""
    engine = Engine(model, dtype="float32", max_total_tokens=260, max_running_requests=1,
                    schedule_policy=policy)
    engine.generate(input_ids=[A + prompt(10, 8), B + prompt(11, 8)],
                    sampling_params={"max_new_tokens": 1, "temperature": 0})
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    for rid, ids in ARRIVALS:
        assert sched.add_request(TokenizedGenerateReq(rid, ids, params)) is None
    order: list[str] = []
    cached: dict[str, int] = {}
    while sched.has_work():
        waiting = {r.rid for r in sched.waiting}
        outputs = sched.step()
        order += [rid for rid in waiting if rid not in {r.rid for r in sched.waiting}]
        cached.update({o.rid: o.cached_tokens for o in outputs if o.finished})
        sched.check_integrity()
    return order, cached


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_fcfs_runs_in_arrival_order_and_loses_cache_hits(tiny):
    order, cached = run(tiny, "fcfs")
    assert order == [rid for rid, _ in ARRIVALS]
    # The fresh prompts ran between them and evicted prefixes the later requests needed.
    assert sum(cached.values()) < sum(MATCHED.values())


def test_lpm_runs_the_longest_cached_prefix_first(tiny):
    order, cached = run(tiny, "lpm")
    assert order == ["b1", "b2", "a1", "a2", "a3", "x1", "x2"]
    assert cached == {**MATCHED, "x1": 0, "x2": 0}  # every shared prefix hit in full


def test_dfs_weight_runs_the_cached_subtrees_first_heaviest_first(tiny):
    order, cached = run(tiny, "dfs-weight")
    assert order[0] == "a1"  # A's subtree holds three waiting requests, B's two
    assert sorted(order[:5]) == sorted(MATCHED) and order[5:] == ["x1", "x2"]
    assert cached == {**MATCHED, "x1": 0, "x2": 0}
