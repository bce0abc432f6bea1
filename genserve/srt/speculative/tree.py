"""Draft trees: several speculative continuations of one request, verified in one forward.

A tree's nodes are draft tokens. Node i's parent is an earlier node or the root (-1): the
request's last token, fed first (it has no KV yet). Siblings hold distinct tokens (a token
trie: continuations that share a prefix share its nodes), and a parent comes before its
children, so node i is verify row 1 + i of its request, at position prefix + depth(i), and
attends to the request's cached context, the root and its own ancestors (`ancestor_mask`).

A chain (each node the child of the one before) is a plain draft: `merge_candidates` hands it
over as a list and the scheduler verifies it as it always has (`verify.verify_draft`).

Acceptance (`verify_tree`) is the walk a chain's verify takes too (`verify.verify_walk`), with
several children per row: greedy follows the child that is the target's argmax; sampled tries
the children in order, each rejected child's token taken out of what is left of the target
distribution p before the next is tried, so the emitted token is distributed exactly as p,
level after level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from genserve.srt.sampling.sampling_params import SamplingParams
from genserve.srt.speculative.verify import verify_walk

if TYPE_CHECKING:
    from genserve.srt.forward_batch import ForwardBatch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # node tokens, a parent before its children
    parents: tuple[int, ...]  # each node's parent node, -1 = the root

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def children(self) -> list[list[int]]:
        """Children of each verify row: [0] the root's, [1 + i] node i's (in node order)."""
        out: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return out

    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))


def merge_candidates(
    candidates: list[list[int]], budget: int, decay: float
) -> list[int] | DraftTree:
    """At most `budget` nodes of the token trie of `candidates` (best first): a list when they
    form a chain (one candidate always does: its first `budget` tokens).

    Candidate i weighs 2^-i; a node scores the weight of the candidates through it, as a share
    of the total, times decay^depth (`decay`: the request's per-token acceptance estimate).
    The best-scoring nodes stay: a child never outscores its parent, and on a tie the shallower
    node goes first, so the kept nodes form a tree."""
    tokens: list[int] = []
    parents: list[int] = []
    weight: list[float] = []
    depth: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for i, cand in enumerate(candidates):
        node = -1
        for d, token in enumerate(cand[:budget]):
            found = index.get((node, token))
            if found is None:
                found = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                weight.append(0.0)
                depth.append(d + 1)
            weight[found] += 0.5**i
            node = found
    total = sum(0.5**i for i in range(len(candidates)))
    score = [w / total * decay**d for w, d in zip(weight, depth, strict=True)]
    order = sorted(range(len(tokens)), key=lambda j: (-score[j], depth[j], j))
    kept: dict[int, int] = {}  # trie node -> tree node
    for j in order:
        if len(kept) == budget:
            break
        if parents[j] < 0 or parents[j] in kept:
            kept[j] = len(kept)
    tree = DraftTree(tuple(tokens[j] for j in kept), tuple(kept.get(parents[j], -1) for j in kept))
    return list(tree.tokens) if tree.is_chain() else tree


def ancestor_mask(tree: DraftTree, device: torch.device) -> torch.Tensor:
    """[1 + n, 1 + n] bool over a request's verify rows (the root, then the nodes): row r sees
    column c when c is r itself, the root, or one of r's ancestors."""
    n = len(tree)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for i, parent in enumerate(tree.parents):
        mask[i + 1] = mask[parent + 1]
        mask[i + 1, i + 1] = True
    return mask.to(device)


def attach_trees(fb: ForwardBatch, drafts: list[list[int] | DraftTree]) -> None:
    """Give an extend verify batch its trees' positions (prefix + depth) and masks; requests
    with a chain or no draft keep their causal layout. Trees run this eager extend: the
    compiled verify rows (`verify_rows.py`) are causal decode rows and cannot take one."""
    positions = fb.positions.clone()
    masks: list[torch.Tensor | None] = []
    start = 0
    for draft, prefix in zip(drafts, fb.extend_prefix_lens_cpu, strict=True):
        if isinstance(draft, DraftTree):
            depths = torch.tensor([0, *draft.depths()], dtype=torch.int64) + prefix
            positions[start : start + len(draft) + 1] = depths.to(positions.device)
            masks.append(ancestor_mask(draft, positions.device))
        else:
            masks.append(None)
        start += len(draft) + 1
    fb.positions, fb.tree_masks = positions, masks


def walked_len(tree: DraftTree, rows: list[int]) -> int:
    """The draft length a tree verify counts as in a request's acceptance record: its accepted
    nodes, plus one when the walk ended on rejected children (as a chain's verify ends on a
    rejected token) rather than at a leaf. rows: `verify_tree`'s rows."""
    return len(rows) - 1 + (1 if tree.children()[rows[-1]] else 0)


def verify_tree(
    logits: torch.Tensor, tree: DraftTree, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], list[int]]:
    """Tokens to append (the accepted path's tokens and one from the target) and, for each,
    the verify row that scored it: 0 (the root), then 1 + each accepted node.

    logits: [1 + len(tree), V], row r scoring the token after row r's input."""
    if logits.shape[0] != len(tree) + 1:
        raise ValueError(
            f"need {len(tree) + 1} logit rows for a tree of {len(tree)}, got {logits.shape[0]}"
        )
    return verify_walk(logits, tree.tokens, tree.children(), params, generator)
