"""N-gram (prompt lookup) proposals: when the last few tokens of a request occurred earlier in
its prompt or output, the tokens that followed them there are likely to follow again (code
edits, extraction, answers that quote their input).

Each request keeps an index from n-gram to the end of its most recent earlier occurrence, for
every n in [min_n, max_n]; the index grows with the request's output, so a proposal costs a few
dictionary lookups.

How long a draft is worth verifying depends on how often the request's drafts are accepted and
on what each extra token costs the verify forward on this device (`ForwardCost`, measured while
serving): a draft of k tokens at per-token acceptance a yields (1 - a^(k+1)) / (1 - a) tokens for
1 + rho * k decode steps of time, and the proposer takes the k that maximises the ratio (k = 0:
decode plainly). Requests whose drafts keep failing also back off exponentially, so speculation
stays off where it does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_BACKOFF = 32  # decode steps a request skips speculation after repeated misses
_DECAY = 0.9  # weight of a request's older verifies in its acceptance estimate
_EMA = 0.1  # weight of a new timing in ForwardCost


class ForwardCost:
    """Online estimate of a forward's time: a plain decode step, and what each extra (draft)
    token adds to it, as a share `rho` of the step. Until both are measured rho is 0 (drafts
    look free), so the first verifies measure the cost."""

    def __init__(self) -> None:
        self.step_s = 0.0
        self.per_token_s = 0.0
        self._measured_verify = False

    def record_decode(self, seconds: float) -> None:
        if self.step_s and seconds > 10 * self.step_s:
            return  # a stall (compile, GC, another process), not the step's cost
        self.step_s = seconds if not self.step_s else (1 - _EMA) * self.step_s + _EMA * seconds

    def record_verify(self, seconds: float, extra_tokens: int) -> None:
        if not self.step_s or extra_tokens <= 0 or seconds > 10 * self.step_s:
            return
        sample = max(0.0, seconds - self.step_s) / extra_tokens
        if not self._measured_verify:
            self.per_token_s, self._measured_verify = sample, True
        else:
            self.per_token_s = (1 - _EMA) * self.per_token_s + _EMA * sample

    @property
    def rho(self) -> float:
        return self.per_token_s / self.step_s if self.step_s and self._measured_verify else 0.0


def best_draft_len(accept: float, rho: float, limit: int) -> int:
    """The draft length k in [0, limit] with the most expected tokens per unit of forward time:
    (1 + a + ... + a^k) / (1 + rho * k)."""
    best_k, best, expected, power = 0, 1.0, 1.0, 1.0
    for k in range(1, limit + 1):
        power *= accept
        expected += power
        value = expected / (1 + rho * k)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


@dataclass
class NgramState:
    """One request's n-gram index and acceptance record."""

    tokens: list[int] = field(default_factory=list)  # prompt + output seen so far
    prompt_len: int = 0
    # (n-gram tuple) -> index just past its most recent occurrence that has a follower.
    table: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this index are in `table`
    skip: int = 0  # decode steps left without speculation
    backoff: int = 1
    proposed: int = 0
    accepted: int = 0
    # Decayed counts of draft positions accepted and of verifies that ended on a rejection:
    # the per-token acceptance estimate is hits / (hits + misses), optimistic at the start.
    hits: float = 1.0
    misses: float = 0.0

    @property
    def accept_rate(self) -> float:
        return self.hits / (self.hits + self.misses)


class NgramProposer:
    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram match windows need 1 <= min <= max, got {min_n}, {max_n}")
        self.num_draft_tokens = num_draft_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, state: NgramState, prompt: list[int], output: list[int],
                limit: int, rho: float = 0.0) -> list[int]:
        """Up to min(num_draft_tokens, limit) tokens that followed the longest earlier match of
        the context's last n tokens (the most recent such match), cut to the length that pays
        at extra-token cost `rho` (see `best_draft_len`); [] when none matches or the request
        is backing off."""
        self._sync(state, prompt, output)
        if state.skip > 0:
            state.skip -= 1
            return []
        limit = min(limit, self.num_draft_tokens)
        if limit > 0 and rho > 0:
            limit = best_draft_len(state.accept_rate, rho, limit)
        if limit <= 0:
            return []
        toks = state.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            end = state.table.get(tuple(toks[-n:]))
            if end is not None:
                return toks[end : end + limit]
        return []

    def record(self, state: NgramState, proposed: int, accepted: int) -> None:
        """Count a verified draft; a draft with nothing accepted doubles the back-off."""
        state.proposed += proposed
        state.accepted += accepted
        state.hits = _DECAY * state.hits + accepted
        state.misses = _DECAY * state.misses + (1 if accepted < proposed else 0)
        if accepted == 0:
            state.skip = state.backoff
            state.backoff = min(state.backoff * 2, _MAX_BACKOFF)
        else:
            state.backoff = 1

    def _sync(self, state: NgramState, prompt: list[int], output: list[int]) -> None:
        """Bring the index up to date with the request's tokens (rebuilt if they shrank)."""
        seen = len(state.tokens) - state.prompt_len
        if state.prompt_len != len(prompt) or seen > len(output):
            state.tokens, state.table, state.indexed = list(prompt), {}, 0
            state.prompt_len, seen = len(prompt), 0
        state.tokens.extend(output[seen:])
        toks, table = state.tokens, state.table
        # An n-gram ending at `end` is indexed once a token follows it (end < len(toks)).
        for end in range(max(state.indexed, 1), len(toks)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table[tuple(toks[end - n : end])] = end
        state.indexed = max(state.indexed, len(toks))
