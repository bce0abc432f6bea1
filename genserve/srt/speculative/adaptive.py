"""When speculation pays, per request: an online estimate of what a forward costs, the draft
length that maximises expected tokens per unit of time, and each request's acceptance record
with exponential back-off. Every proposer (n-gram, draft model) uses the same mechanism, so a
request whose drafts keep failing falls back to plain decoding whatever proposes them.

A draft of k tokens at per-token acceptance a yields (1 - a^(k+1)) / (1 - a) tokens for
1 + rho * k decode steps of time, where rho is what one more draft token costs as a share of
a plain decode step (its verify position, plus a draft-model forward where there is one); the
best k may be 0: decode plainly.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class SecondsPerCall:
    """An exponential moving average of one kind of call's duration (a draft-model forward)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def record(self, seconds: float) -> None:
        if self.seconds and seconds > 10 * self.seconds:
            return  # a stall, not the call's cost
        self.seconds = seconds if not self.seconds else (
            (1 - _EMA) * self.seconds + _EMA * seconds)


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
class AcceptanceRecord:
    """One request's record of verified drafts."""

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

    def draft_len(self, limit: int, rho: float) -> int:
        """How many tokens to draft now (at most `limit`): 0 while backing off, else the
        length that pays at extra-token cost `rho` for this request's acceptance."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        if limit > 0 and rho > 0:
            limit = best_draft_len(self.accept_rate, rho, limit)
        return max(limit, 0)

    def record(self, proposed: int, accepted: int) -> None:
        """Count a verified draft; a draft with nothing accepted doubles the back-off."""
        self.proposed += proposed
        self.accepted += accepted
        self.hits = _DECAY * self.hits + accepted
        self.misses = _DECAY * self.misses + (1 if accepted < proposed else 0)
        if accepted == 0:
            self.skip = self.backoff
            self.backoff = min(self.backoff * 2, _MAX_BACKOFF)
        else:
            self.backoff = 1
