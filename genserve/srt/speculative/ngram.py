"""N-gram (prompt lookup) proposals: when the last few tokens of a request occurred earlier in
its prompt or output, the tokens that followed them there are likely to follow again (code
edits, extraction, answers that quote their input).

Each request keeps an index from n-gram to the end of its most recent earlier occurrence, for
every n in [min_n, max_n]; the index grows with the request's output, so a proposal costs a few
dictionary lookups.

With a breadth above one (`--speculative-ngram-max-bfs-breadth`), the index also keeps each
n-gram's last few occurrences, and a proposal gathers up to `breadth` distinct continuations
(longest match first, most recent first) merged into a token trie within the node budget
(`tree.merge_candidates`); when they agree it is the same chain a breadth of one proposes.

How long a draft is worth verifying, and when a request whose drafts keep failing stops
speculating, is decided per request by `adaptive.py` (shared with the draft-model proposer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genserve.srt.speculative.adaptive import AcceptanceRecord, ForwardCost, best_draft_len
from genserve.srt.speculative.tree import DraftTree, merge_candidates

__all__ = ["ForwardCost", "NgramProposer", "NgramState", "best_draft_len"]

# Occurrences of one n-gram a tree proposal may draw on (the most recent ones).
_MAX_OCCURRENCES = 8
# Bounds of the per-token acceptance used to price a tree's deeper nodes (`merge_candidates`).
_MIN_DECAY, _MAX_DECAY = 0.1, 0.9


@dataclass
class NgramState(AcceptanceRecord):
    """One request's n-gram index and acceptance record."""

    tokens: list[int] = field(default_factory=list)  # prompt + output seen so far
    prompt_len: int = 0
    # (n-gram tuple) -> index just past its most recent occurrence that has a follower.
    table: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this index are in `table`
    # Breadth > 1 only: (n-gram tuple) -> indices past its last occurrences, oldest first.
    occurrences: dict[tuple[int, ...], list[int]] = field(default_factory=dict)


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int, breadth: int = 1) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram match windows need 1 <= min <= max, got {min_n}, {max_n}")
        if breadth < 1:
            raise ValueError(f"speculative_ngram_max_bfs_breadth must be >= 1, got {breadth}")
        self.num_draft_tokens = num_draft_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.breadth = breadth

    def propose(self, state: NgramState, prompt: list[int], output: list[int],
                limit: int, rho: float = 0.0, tree: bool = True) -> list[int] | DraftTree:
        """Up to min(num_draft_tokens, limit) tokens that followed the longest earlier match of
        the context's last n tokens (the most recent such match), cut to the length that pays
        at extra-token cost `rho` (see `best_draft_len`); [] when none matches or the request
        is backing off. With a breadth above one (and `tree`), a tree of that many nodes when
        earlier matches disagree on what follows."""
        self._sync(state, prompt, output)
        limit = state.draft_len(min(limit, self.num_draft_tokens), rho)
        if limit <= 0:
            return []
        if self.breadth > 1 and tree:
            return self._propose_tree(state, limit)
        toks = state.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            end = state.table.get(tuple(toks[-n:]))
            if end is not None:
                return toks[end : end + limit]
        return []

    def _propose_tree(self, state: NgramState, budget: int) -> list[int] | DraftTree:
        """Up to `breadth` distinct continuations of the context's matches, longest match
        first and the most recent first among equal lengths, merged within `budget` nodes."""
        toks = state.tokens
        candidates: list[list[int]] = []
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            for end in reversed(state.occurrences.get(tuple(toks[-n:]), ())):
                cont = toks[end : end + budget]
                if cont not in candidates:
                    candidates.append(cont)
                    if len(candidates) == self.breadth:
                        break
            if len(candidates) == self.breadth:
                break
        if not candidates:
            return []
        decay = min(max(state.accept_rate, _MIN_DECAY), _MAX_DECAY)
        return merge_candidates(candidates, budget, decay)

    def record(self, state: NgramState, proposed: int, accepted: int) -> None:
        """Count a verified draft; a draft with nothing accepted doubles the back-off."""
        state.record(proposed, accepted)

    def _sync(self, state: NgramState, prompt: list[int], output: list[int]) -> None:
        """Bring the index up to date with the request's tokens (rebuilt if they shrank)."""
        seen = len(state.tokens) - state.prompt_len
        if state.prompt_len != len(prompt) or seen > len(output):
            state.tokens, state.table, state.indexed = list(prompt), {}, 0
            state.occurrences = {}
            state.prompt_len, seen = len(prompt), 0
        state.tokens.extend(output[seen:])
        toks, table = state.tokens, state.table
        many = state.occurrences if self.breadth > 1 else None
        # An n-gram ending at `end` is indexed once a token follows it (end < len(toks)).
        for end in range(max(state.indexed, 1), len(toks)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(toks[end - n : end])
                table[key] = end
                if many is not None:
                    ends = many.setdefault(key, [])
                    ends.append(end)
                    if len(ends) > _MAX_OCCURRENCES:
                        del ends[0]
        state.indexed = max(state.indexed, len(toks))
