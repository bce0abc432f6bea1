"""A lone request's verify forward laid out as decode rows, so the compiled decode step runs it.

Verifying a draft of k tokens feeds k + 1 tokens of one request. As an extend forward it runs
eager (the extend path plans attention per request in Python, which a compiled graph would
specialise on every prefix length). The same forward is also k + 1 decode rows of that one
request: row i is the token at position prefix + i, its sequence is prefix + i + 1 tokens
long, and it reads the request's KV through the same req_to_token row. Every row's K/V is
written to the pool before any row attends, so row i sees exactly the keys a causal extend
would give it. The compiled decode step traces each row count once (the row count is a static
size of its graph; the sequence length stays dynamic), and the scheduler uses this layout only
under --compile with GENSERVE_SPEC_COMPILED_VERIFY=1, for a batch of one request, up to
`MAX_ROWS` rows. It is opt-in because a row count's first verify compiles a graph (minutes on a
small CPU) in the middle of serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genserve import envs
from genserve.srt.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from genserve.srt.model_runner import ModelRunner

# Rows (draft tokens + 1) a compiled verify takes: each count is a graph of its own.
MAX_ROWS = 8


def use_verify_rows(runner: ModelRunner, num_reqs: int, num_tokens: int) -> bool:
    """Whether a verify of `num_tokens` tokens of `num_reqs` requests runs as decode rows."""
    return (
        runner.compiled
        and envs.GENSERVE_SPEC_COMPILED_VERIFY.get()
        and num_reqs == 1
        and 1 < num_tokens <= MAX_ROWS
    )


def build_verify_rows(
    runner: ModelRunner, row: int, input_ids: list[int], prefix: int, slots: torch.Tensor
) -> ForwardBatch:
    """Decode rows for one request whose KV holds `prefix` tokens and whose next tokens are
    `input_ids` (its last token, then the draft), written to `slots` (already in its
    req_to_token row at [prefix, prefix + len(input_ids)))."""
    n = len(input_ids)
    return runner.build_forward_batch(
        ForwardMode.DECODE, [row] * n, input_ids, [prefix + i for i in range(n)], [1] * n, slots
    )
