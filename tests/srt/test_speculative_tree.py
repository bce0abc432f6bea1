"""N-gram draft trees (`--speculative-ngram-max-bfs-breadth` > 1): candidates merged into a
token trie, verified in one forward with a tree attention mask. Greedy output equals plain
decoding token for token with trees actually verified; sampled tree verification keeps the
target distribution; the accepted path's KV lands in the request's row and every other node's
slot is freed (integrity checked after each step, also across an abort)."""

from __future__ import annotations

import pytest
import torch

from genserve import Engine
from genserve.srt.sampling import SamplingParams
from genserve.srt.speculative.ngram import NgramProposer, NgramState
from genserve.srt.speculative.tree import (
    DraftTree,
    ancestor_mask,
    merge_candidates,
    verify_tree,
    walked_len,
)
from genserve.srt.speculative.verify import target_probs
from genserve.srt.tokenizer_manager import make_tokenized_req
from tests.srt.test_speculative import UnmeasuredCost, repetitive

GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


def test_candidates_merge_into_a_trie_within_the_budget():
    # One candidate, or candidates that agree: the chain a breadth of one proposes.
    assert merge_candidates([[5, 6, 7, 8]], 3, 0.8) == [5, 6, 7]
    assert merge_candidates([[5, 6, 7], [5, 6]], 4, 0.8) == [5, 6, 7]
    # Shared prefixes share nodes; a node scores its candidates' weight (2^-i) times
    # decay^depth, so the best candidate's deep nodes can outrank another's first one.
    tree = merge_candidates([[5, 6, 7, 8], [5, 9, 10]], 5, 0.8)
    assert isinstance(tree, DraftTree)
    assert tree.tokens == (5, 6, 7, 8, 9) and tree.parents == (-1, 0, 1, 2, 0)
    assert tree.depths() == [1, 2, 3, 4, 2]
    # A lower acceptance spends the budget on the other candidates' first tokens instead.
    tree = merge_candidates([[1, 2, 3, 4], [7, 8, 9], [11]], 4, 0.6)
    assert isinstance(tree, DraftTree)
    assert tree.tokens == (1, 2, 7, 3) and tree.parents == (-1, 0, -1, 1)
    assert merge_candidates([[1, 2, 3, 4], [7, 8, 9], [11]], 4, 0.9) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree((1, 2), (1, -1))


def test_ngram_proposes_a_tree_from_disagreeing_matches():
    prop = NgramProposer(num_draft_tokens=6, min_n=2, max_n=3, breadth=3)
    # "1 2" was followed by 3 4 5, later by 8 9, most recently by 3 4 6.
    prompt = [1, 2, 3, 4, 5, 0, 1, 2, 8, 9, 0, 1, 2, 3, 4, 6, 0]
    state = NgramState(hits=0.6, misses=0.4)  # a request whose drafts often fail
    tree = prop.propose(state, prompt, [1, 2], limit=8)
    assert isinstance(tree, DraftTree) and len(tree) == 6
    paths = {tuple(_path(tree, i)) for i in range(len(tree))}
    assert (3, 4, 6, 0) in paths and (8, 9) in paths
    # A grammar-constrained request asks for a chain: the best match's, as at breadth one.
    assert prop.propose(state, prompt, [1, 2], limit=8, tree=False) == [3, 4, 6, 0, 1, 2]
    # While every draft is accepted, the budget goes to the best match's chain.
    assert prop.propose(NgramState(), prompt, [1, 2], limit=8) == [3, 4, 6, 0, 1, 2]
    # Breadth one: today's chain, the most recent longest match.
    chain = NgramProposer(num_draft_tokens=6, min_n=2, max_n=3)
    assert chain.propose(NgramState(), prompt, [1, 2], limit=8) == [3, 4, 6, 0, 1, 2]
    # Matches that all agree give that chain at breadth three too.
    assert prop.propose(NgramState(), [1, 2, 3, 4, 1, 2, 3, 4], [1, 2], limit=3) == [3, 4, 1]


def _path(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


def test_ancestor_mask_and_greedy_walk():
    tree = DraftTree((3, 4, 5, 6), (-1, -1, 1, 0))  # root -> 3 -> 6, root -> 4 -> 5
    mask = ancestor_mask(tree, torch.device("cpu")).int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 0, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    logits = torch.full((5, 8), -5.0)
    for row, best in enumerate([4, 0, 5, 7, 1]):  # row 0 picks 4, its node (row 2) picks 5...
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    assert verify_tree(logits, tree, greedy, None) == ([4, 5, 7], [0, 2, 3])
    assert walked_len(tree, [0, 2, 3]) == 2  # ended at a leaf: nothing rejected
    assert walked_len(tree, [0, 2]) == 2 and walked_len(tree, [0]) == 1
    logits[0] = -5.0
    logits[0, 2] = 5.0  # no child holds the target's token: only the target's own
    assert verify_tree(logits, tree, greedy, None) == ([2], [0])
    with pytest.raises(ValueError, match="logit rows"):
        verify_tree(logits[:3], tree, greedy, None)


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}])
def test_sampled_tree_verification_keeps_the_target_distribution(params):
    """On a 6-token vocabulary with two candidates at the root and one below the first, the
    first emitted token follows p0 and, after the first candidate, the next follows its row's
    distribution -- whichever tokens the tree holds."""
    vocab, trials = 6, 6000
    sp = SamplingParams(max_new_tokens=8, **params)
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * 1.5
    probs = target_probs(logits, sp)
    order = torch.argsort(probs[0]).tolist()
    drawable = [t for t in order if probs[0, t] > 0]
    # An unlikely first candidate, the likeliest second; node 0's child is row 1's likeliest.
    tree = DraftTree((drawable[0], drawable[-1], int(probs[1].argmax())), (-1, -1, 0))
    gen = torch.Generator().manual_seed(1)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(trials):
        tokens, rows = verify_tree(logits, tree, sp, gen)
        first[tokens[0]] += 1
        if tokens[0] == tree.tokens[0]:
            assert rows[1] == 1
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        n = counts.sum()
        sd = (n * p * (1 - p)).clamp_min(1e-9).sqrt()
        assert ((counts - p * n).abs() <= 4.5 * sd + 1).all(), (counts, p * n)
    assert second.sum() > 0  # the unlikely first candidate was accepted sometimes


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def plain(tiny):
    return Engine(tiny, dtype="float32", max_total_tokens=4096)


def tree_engine(path: str, **kw) -> Engine:
    """Trees of 6 nodes from up to 3 candidates; one-token matches too, so that the random
    model's outputs (which copy little) still find several disagreeing matches."""
    engine = Engine(
        path,
        dtype="float32",
        max_total_tokens=kw.pop("max_total_tokens", 4096),
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=6,
        speculative_ngram_max_bfs_breadth=3,
        speculative_ngram_min_match_window_size=1,
        **kw,
    )
    engine.scheduler.spec.cost = UnmeasuredCost()
    return engine


def test_tree_greedy_output_equals_plain_decoding(tiny, plain):
    prompts = [repetitive(i, 30 + 7 * i) for i in range(5)]
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    engine = tree_engine(tiny)
    got = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in got] == want
    stats = engine.scheduler.stats
    assert stats["spec_tree_verifies"] > 0, "no tree was verified: nothing was tested"
    # A tree has more nodes than its deepest path: more than one node per tree on average,
    # and tokens were accepted from them.
    assert stats["spec_tree_nodes"] > 2 * stats["spec_tree_verifies"]
    assert stats["spec_accepted_tokens"] > 0
    assert stats["decode_steps"] < stats["generated_tokens"]
    engine.check_integrity()
    # Logprobs of appended tokens come from the accepted path's rows.
    lp = {"return_logprob": True, "top_logprobs_num": 2}
    got = engine.generate(input_ids=prompts[2], sampling_params=GREEDY, **lp)
    want = plain.generate(input_ids=prompts[2], sampling_params=GREEDY, **lp)
    assert got["output_ids"] == want["output_ids"]
    for (g, gid), (w, wid) in zip(
        got["meta_info"]["output_token_logprobs"],
        want["meta_info"]["output_token_logprobs"],
        strict=True,
    ):
        assert gid == wid and g == pytest.approx(w, abs=1e-4)
    for g_top, w_top in zip(
        got["meta_info"]["output_top_logprobs"],
        want["meta_info"]["output_top_logprobs"],
        strict=True,
    ):
        assert [i for _, i in g_top] == [i for _, i in w_top]
    engine.check_integrity()


def test_tree_greedy_output_with_the_triton_backend(tiny, plain):
    """The same through the Triton extend kernel's custom mask (under Triton's interpreter on
    a CPU: tests/conftest.py sets TRITON_INTERPRET=1)."""
    prompts = [repetitive(i, 30) for i in range(2)]
    params = {**GREEDY, "max_new_tokens": 24}
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    engine = tree_engine(tiny, attention_backend="triton")
    try:
        assert engine.runtime.model_info()["attention_backend"] == "triton"
        got = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in got] == want
        assert engine.scheduler.stats["spec_tree_verifies"] > 0
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_tree_pool_integrity_every_step_and_across_an_abort(tiny, plain):
    engine = tree_engine(tiny)
    sched = engine.scheduler
    prompts = [repetitive(40 + i, 36) for i in range(3)]
    reqs = [
        make_tokenized_req(p, SamplingParams.from_dict(GREEDY), rid=f"t{i}")
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        sched.add_request(r)
    outputs: dict[str, list[int]] = {}
    aborted = False
    while sched.has_work():
        trees = sched.stats["spec_tree_verifies"]
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_ids)
        sched.check_integrity()
        for req in sched.running:  # KV for every token in the sequence but the last
            assert req.kv_len == req.seq_len - 1
        if not aborted and sched.stats["spec_tree_verifies"] > trees:
            sched.abort("t1")  # right after a tree step
            aborted = True
    assert aborted
    sched.check_integrity()
    assert sched.allocator.available_size() + sched.cache.total_size() == sched.max_total_tokens
    for i in (0, 2):
        want = plain.generate(input_ids=prompts[i], sampling_params=GREEDY)["output_ids"]
        assert outputs[f"t{i}"] == want


def test_tree_retraction_and_a_small_pool_lose_nothing(tiny, plain):
    params = {**GREEDY, "max_new_tokens": 60}
    many = [repetitive(100 + i, 40) for i in range(6)]
    tight = tree_engine(tiny, max_total_tokens=300, max_running_requests=8)
    outs = tight.generate(input_ids=many, sampling_params=params)
    assert tight.scheduler.stats["retractions"] > 0
    assert tight.scheduler.stats["spec_tree_verifies"] > 0
    want = plain.generate(input_ids=many, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    tight.check_integrity()


def test_seeded_sampling_with_trees_is_reproducible(tiny):
    engine = tree_engine(tiny)
    params = {"max_new_tokens": 40, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    a = engine.generate(input_ids=repetitive(7, 50), sampling_params=params)["output_ids"]
    b = engine.generate(input_ids=repetitive(7, 50), sampling_params=params)["output_ids"]
    assert a == b and len(a) == 40
    assert engine.scheduler.stats["spec_tree_verifies"] > 0
    engine.check_integrity()


def test_trees_with_tensor_parallelism_are_refused(tiny):
    with pytest.raises(ValueError, match="draft trees"):
        Engine(tiny, speculative_algorithm="ngram", speculative_ngram_max_bfs_breadth=2, tp_size=2)
    with pytest.raises(ValueError, match="max_bfs_breadth"):
        Engine(tiny, speculative_algorithm="ngram", speculative_ngram_max_bfs_breadth=0)
