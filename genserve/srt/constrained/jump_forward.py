"""Jump-forward decoding (the compressed-FSM idea of the SGLang paper): when the grammar
admits exactly one continuation (`{"name": "`, closing brackets, the rest of an enum value),
append its tokens without a decode step; the scheduler then computes their KV in one extend.

The boundary: the token just sampled and the forced text may tokenize differently together
(`{"` + `name": "` is not `{"` `name` `":` ` "` in every vocabulary). That token has no KV
yet and has not been sent, so it is rewound and retokenized with the forced text: the
sequence stays what the tokenizer itself would write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genserve.srt.scheduler.req import Req

REPLACEMENT_CHAR = "\ufffd"


def _encode(tokenizer: Any, text: str) -> list[int] | None:
    """Token ids of `text` that decode back to exactly `text`, else None."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids or tokenizer.decode(ids) != text:
        return None
    return ids


def forced_tokens(req: Req, tokenizer: Any) -> tuple[bool, list[int]] | None:
    """(rewind the last token?, tokens to append) for the grammar's forced text, or None."""
    forced = req.grammar.jump_forward_string()
    if not forced:
        return None
    last = req.output_ids[-1]
    last_text = tokenizer.decode([last])
    if REPLACEMENT_CHAR not in last_text and req.can_rewind_last_token():
        ids = _encode(tokenizer, last_text + forced)
        if ids is not None and ids[0] != last:
            return True, ids
        if ids is not None:
            return False, ids[1:]
    ids = _encode(tokenizer, forced)
    return (False, ids) if ids is not None else None


def jump_forward(req: Req, tokenizer: Any, eos_ids: frozenset[int], context_length: int) -> int:
    """Append the grammar's forced tokens to a running constrained request; returns how many
    output tokens it gained (0 when nothing is forced or the forced text does not fit)."""
    if req.return_logprob or req.top_logprobs_num:
        return 0  # forced tokens have no logprobs to report
    plan = forced_tokens(req, tokenizer)
    if plan is None:
        return 0
    rewind, ids = plan
    if not ids:
        return 0
    grow = len(ids) - (1 if rewind else 0)
    left = min(req.params.max_new_tokens - len(req.output_ids), context_length - req.seq_len)
    if grow <= 0 or grow > left:
        return 0  # no gain, or the budget ends inside the forced text: decode it normally
    grammar = req.grammar
    if rewind:
        grammar.rollback(1)
    accepted = 0
    for token in ids:
        if not grammar.accept_token(token):
            break
        accepted += 1
    if accepted < len(ids):  # the grammar disagrees with this tokenization: undo
        grammar.rollback(accepted)
        if rewind:
            grammar.accept_token(req.output_ids[-1])
        return 0
    if rewind:
        req.rewind_last_token()
    for token in ids:
        req.append_token(token, eos_ids, context_length)
        if req.finished:
            break
    return grow
