"""A decode step with speculation: the running requests' drafts are verified in one extend
forward (each request feeds its last token and its draft, and every position gets logits), each
request appends its accepted tokens plus one from the target, and the KV slots of rejected draft
tokens go back to the free list in the same step.

A draft may be a tree (n-gram with `--speculative-ngram-max-bfs-breadth` above one,
`speculative/tree.py`): its nodes ride in the same extend with tree positions and masks, and
the accepted path's slots are moved into the request's req_to_token row in path order.

Requests that cannot speculate (see `can_speculate`) or have no draft ride along as one-token
extends and are sampled by the plain sampler, so a batch mixes both freely.

Drafts come from prompt lookup (`NgramSpeculation`) or from a draft model
(`DraftModelProposer`, which holds KV of its own: it is freed with the request's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

from genserve.srt.forward_batch import ForwardMode
from genserve.srt.messages import ReqOutput
from genserve.srt.scheduler.kv_ownership import alloc_slots
from genserve.srt.scheduler.sample_step import sample_step
from genserve.srt.server_args import EngineArgs
from genserve.srt.speculative import (
    NgramProposer,
    can_speculate,
    refuse_vision_target,
    verify_draft,
)
from genserve.srt.speculative.draft import DraftModelProposer
from genserve.srt.speculative.grammar_verify import (
    ConstrainedDrafts,
    append_verified,
    masked_rows,
)
from genserve.srt.speculative.ngram import ForwardCost, NgramState
from genserve.srt.speculative.tree import DraftTree, attach_trees, verify_tree, walked_len
from genserve.srt.speculative.verify import token_scores
from genserve.srt.speculative.verify_rows import build_verify_rows, use_verify_rows

if TYPE_CHECKING:
    from genserve.srt.model_runner import ModelRunner
    from genserve.srt.scheduler.req import Req
    from genserve.srt.scheduler.scheduler import Scheduler


class Speculation(Protocol):
    """What the scheduler asks of a proposer (`NgramSpeculation`, `DraftModelProposer`)."""

    cost: ForwardCost  # the target's forward costs, measured by the scheduler

    def drafts(self, reqs: list[Req], context_length: int) -> list[list[int] | DraftTree]:
        """Each running request's draft for this step ([]: it decodes plainly)."""

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        """A verified draft of `req` (its tokens are appended already)."""

    def release(self, req: Req) -> None:
        """Free whatever the proposer holds for `req` (it ended or was retracted)."""

    def check_integrity(self, live: list[Req], waiting: list[Req]) -> None:
        """Raise IntegrityError when what the proposer holds disagrees with the requests."""


class NgramSpeculation:
    """`--speculative-algorithm ngram`: drafts from prompt lookup."""

    def __init__(self, args: EngineArgs) -> None:
        self.proposer = NgramProposer(
            args.speculative_num_draft_tokens,
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
            args.speculative_ngram_max_bfs_breadth,
        )
        self.cost = ForwardCost()

    def drafts(self, reqs: list[Req], context_length: int) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for req in reqs:
            if not can_speculate(req):
                out.append([])
                continue
            if req.spec_state is None:
                req.spec_state = NgramState()
            # Room for the draft plus the target's token, within max_new_tokens and the context.
            limit = min(req.params.max_new_tokens - len(req.output_ids),
                        context_length - req.seq_len) - 1
            # Tree verification applies no grammar mask: a constrained request drafts a chain.
            tree = req.grammar is None and req.params.grammar_key is None
            out.append(self.proposer.propose(req.spec_state, req.origin_input_ids,
                                             req.output_ids, limit, self.cost.rho, tree))
        return out

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        self.proposer.record(req.spec_state, proposed, accepted)

    def release(self, req: Req) -> None:
        """Nothing to free: a request's n-gram index is plain Python state, kept across a
        retraction."""

    def check_integrity(self, live: list[Req], waiting: list[Req]) -> None:
        """Nothing to check: n-gram speculation holds no KV of its own."""


def create_speculation(args: EngineArgs, draft: ModelRunner | None,
                       multimodal: bool) -> Speculation | None:
    """The scheduler's proposer for `--speculative-algorithm`, or None when it is off.
    draft: the draft model's runner, or the EAGLE head's (`EagleRunner`)."""
    if args.speculative_algorithm is None:
        return None
    refuse_vision_target(multimodal)
    if args.speculative_algorithm == "ngram":
        return NgramSpeculation(args)
    if args.speculative_algorithm == "eagle":
        from genserve.srt.speculative.eagle import EagleProposer

        if draft is None:
            raise ValueError("--speculative-algorithm eagle needs the EAGLE head's runner")
        return EagleProposer(draft,  # type: ignore[arg-type]  # an EagleRunner here
                             args.speculative_draft_steps(), args.chunked_prefill_size)
    if draft is None:
        raise ValueError("--speculative-algorithm draft needs the draft model's runner")
    return DraftModelProposer(draft, args.speculative_draft_steps(), args.chunked_prefill_size)


def run_speculative_decode(s: Scheduler, outputs: list[ReqOutput]) -> bool:
    """One decode step of `s.running` with drafts; False (nothing done) when no request has a
    draft or the pool has no room for the drafts, and the caller decodes plainly."""
    assert s.spec is not None
    if not any(can_speculate(r) for r in s.running):
        return False
    if not s._fit_running(outputs):
        return True  # a lone request that cannot fit has ended
    reqs = s.running
    checked = ConstrainedDrafts(s, reqs, s.spec.drafts(reqs, s.context_length))
    drafts = checked.drafts
    for req, draft, judged in zip(reqs, drafts, checked.judged, strict=True):
        if judged and not draft:  # the grammar rejects its first token: a miss
            s.spec.record(req, judged, 0)
    s.stats["spec_grammar_cut_tokens"] += checked.cut_tokens
    if not any(drafts):
        return False
    lens = [1 + len(d) for d in drafts]
    need = sum(lens)
    slots = alloc_slots(need, s.allocator, s.cache)
    if slots is None:
        return False
    input_ids: list[int] = []
    start = 0
    for req, draft, n in zip(reqs, drafts, lens, strict=True):
        s.req_to_token_pool.write(req.row, req.kv_len, slots[start : start + n])
        input_ids.append(req.output_ids[-1])  # the last token, which has no KV yet
        input_ids.extend(draft.tokens if isinstance(draft, DraftTree) else draft)
        start += n
    trees = any(isinstance(d, DraftTree) for d in drafts)
    rows = not trees and use_verify_rows(s.runner, len(reqs), need)
    if rows:  # one request under --compile: the compiled decode step verifies
        fb = build_verify_rows(s.runner, reqs[0].row, input_ids, reqs[0].kv_len, slots)
    else:
        fb = s.runner.build_forward_batch(
            ForwardMode.EXTEND,
            [r.row for r in reqs],  # type: ignore[misc]
            input_ids,
            [r.kv_len for r in reqs],
            lens,
            slots,
            lora_slots=[r.lora_slot for r in reqs],
        )
        fb.logits_indices = torch.arange(need, dtype=torch.int64, device=s.device)
        if trees:
            attach_trees(fb, drafts)
    started = time.perf_counter()
    logits = s.runner.forward(fb, verify_rows=rows)
    s.stats["decode_steps"] += 1
    s.stats["spec_verify_steps"] += 1
    plain: list[Req] = []
    plain_rows: list[int] = []
    start = 0
    for req, draft, judged, mask, n in zip(reqs, drafts, checked.judged, checked.masks, lens,
                                           strict=True):
        if not draft:
            req.kv_len += 1
            plain.append(req)
            plain_rows.append(start)
        else:
            scored = logits[start : start + n]
            path = None  # a tree's verify rows that scored the appended tokens
            if isinstance(draft, DraftTree):  # never a grammar request's: they draft chains
                tokens, path = verify_tree(scored, draft, req.params, req.generator)
                scored = scored[path]
            else:
                # Grammar masks apply to the choice, not to the reported logprobs (as plain).
                chosen = scored if mask is None else masked_rows(scored, mask)
                tokens = verify_draft(chosen, draft, req.params, req.generator)
            lps, tops = [None] * len(tokens), None
            if req.return_logprob or req.top_logprobs_num > 0:
                lps, tops = token_scores(scored, tokens, req.top_logprobs_num)
            appended = append_verified(s, req, tokens, lps, tops)
            # KV stays for the last token and the accepted draft tokens now in the sequence;
            # the rest of the draft's slots are free again.
            if path is not None:
                keep_tree_path(s, req, slots[start : start + n], path[:appended])
                s.stats["spec_tree_verifies"] += 1
                s.stats["spec_tree_nodes"] += len(draft)
            elif appended < n:
                s.allocator.free(slots[start + appended : start + n])
            req.kv_len += appended
            walked = judged if path is None else walked_len(draft, path)
            s.spec.record(req, walked, len(tokens) - 1)
            s.stats["spec_draft_tokens"] += len(draft)
            s.stats["spec_accepted_tokens"] += len(tokens) - 1
            s.stats["generated_tokens"] += appended
        start += n
    if plain:
        sample_step(s, plain, logits[plain_rows])
    s.spec.cost.record_verify(time.perf_counter() - started, need - len(reqs))
    s._end_decode_step(reqs, outputs)
    return True


def keep_tree_path(s: Scheduler, req: Req, slots: torch.Tensor, kept: list[int]) -> None:
    """After a tree verify of `req` (whose KV holds req.kv_len tokens before it): the verify
    rows `kept` (the root, then the accepted nodes in path order) keep their KV at
    [kv_len, kv_len + len(kept)) of the request's row; every other row's slot is freed.
    slots: the verify's slots of this request, [1 + nodes], in row order."""
    index = torch.tensor(kept, dtype=torch.int64, device=slots.device)
    s.req_to_token_pool.write(req.row, req.kv_len, slots[index])
    rejected = torch.ones(slots.shape[0], dtype=torch.bool, device=slots.device)
    rejected[index] = False
    if bool(rejected.any()):
        s.allocator.free(slots[rejected])
