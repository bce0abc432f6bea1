"""A request inside the scheduler: its tokens, its KV ownership and its output state."""

from __future__ import annotations

import time
from typing import Any

import torch

from genserve.srt.detokenizer import IncrementalDetokenizer, StopStringMatcher
from genserve.srt.messages import InputLogprobs, ReqOutput, TokenizedGenerateReq
from genserve.srt.sampling import SamplingParams


class Req:
    """KV state invariant (while `row` is set):
    req_to_token[row, :kv_len] are the KV slots of fill_ids[:kv_len];
    [0, cache_prefix_len) of them belong to the prefix cache and are locked through `last_node`;
    [cache_prefix_len, kv_len) belong to this request and must be returned when it ends.
    """

    def __init__(self, msg: TokenizedGenerateReq, tokenizer: Any, device: torch.device) -> None:
        self.rid = msg.rid
        self.origin_input_ids = list(msg.input_ids)
        self.params: SamplingParams = msg.sampling_params
        self.namespace = msg.namespace  # gains the adapter's load id when it has one
        self.lora_name = msg.lora_name
        self.lora_slot = -1  # the adapter slot it pins while admitted; -1: none
        self.stream = msg.stream
        self.return_logprob = msg.return_logprob
        self.top_logprobs_num = msg.top_logprobs_num
        self.arrival_time = msg.arrival_time or time.monotonic()
        self.output_ids: list[int] = []
        self.logprob_start_len = msg.logprob_start_len
        self.token_ids_logprob = msg.token_ids_logprob
        # True until the prompt's prefill has scored [logprob_start_len, prompt_len).
        self.input_scores_pending = self.return_logprob and self.logprob_start_len >= 0
        self._input_scores: InputLogprobs | None = None
        self._input_scores_ready: InputLogprobs | None = None
        self._pending_ids_lp: list[list[tuple[float, int]]] = []
        # Images: their placeholder tokens carry a value derived from the image's content hash
        # in the prefix-cache key, so equal images share KV and different ones never match.
        self.mm_inputs = msg.mm_inputs
        # A pooling request: its prompt's pooled vector is the result; it never decodes.
        self.pooling = msg.pooling
        self.embedding: list[float] | None = None
        self.mm_refs: set[str] = set()  # image-embedding cache entries this request holds
        self._origin_key_ids = self.origin_input_ids
        if self.mm_inputs is not None:
            self._origin_key_ids = list(self.origin_input_ids)
            for item in self.mm_inputs.images:
                tag = -1 - int(item.content_hash[:15], 16)  # negative: never a real token
                end = item.offset + item.num_tokens
                self._origin_key_ids[item.offset : end] = [tag] * item.num_tokens

        self.row: int | None = None
        self.kv_len = 0
        self.cache_prefix_len = 0
        self.last_node: Any = None
        self.cached_tokens = -1  # prefix-cache hit at first admission; -1 = not admitted yet
        self.retractions = 0
        self.spec_state: Any = None  # speculative decoding: the proposer's per-request state

        self.generator: torch.Generator | None = None
        if self.params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed)

        # Constrained decoding: the compile future while compiling, then the matcher.
        self.grammar_future: Any = None
        self.grammar_deadline = 0.0
        self.grammar: Any = None  # genserve.srt.constrained.RequestGrammar

        self.finish_reason: dict[str, Any] | None = None
        self.error: str | None = None
        self.error_status = 500
        self.aborted = False
        # Text: detokenize incrementally only when someone reads it before the end.
        self._tokenizer = tokenizer
        self._incremental = tokenizer is not None and (self.stream or bool(self.params.stop))
        self._detok = (
            IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=self.params.skip_special_tokens,
                spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            )
            if self._incremental
            else None
        )
        self._stops = StopStringMatcher(self.params.stop) if self.params.stop else None
        self._text = ""  # decoded output text (cut at a stop string)
        self._stop_string_hit = False
        self._final_text = False
        self._sent_text = 0  # chars of _text already sent
        self._sent_ids = 0
        self._pending_logprobs: list[tuple[float, int]] = []
        self._pending_top: list[list[tuple[float, int]]] = []

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """Prefix-cache key of fill_ids (image placeholders replaced by image tags)."""
        return self._origin_key_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def max_prefix_len(self) -> int:
        """How much of fill_ids the prefix cache may serve: positions that must be scored are
        computed, never matched."""
        if self.input_scores_pending:
            return min(self.logprob_start_len, self.seq_len - 1)
        return self.seq_len - 1

    def reset_input_scores(self) -> None:
        """(Re)start scoring the prompt: a prefill from the capped prefix covers it all."""
        if self.input_scores_pending:
            start = self.logprob_start_len
            self._input_scores = InputLogprobs(
                token_logprobs=[(None, self.origin_input_ids[start])],
                top_logprobs=[None] if self.top_logprobs_num > 0 else None,
                token_ids_logprobs=[None] if self.token_ids_logprob else None,
            )

    def add_input_scores(
        self,
        values: list[float],
        tokens: list[int],
        top: list[list[tuple[float, int]]] | None,
        chosen: list[list[tuple[float, int]]] | None,
    ) -> None:
        scores = self._input_scores
        assert scores is not None, "reset_input_scores() runs at admission"
        scores.token_logprobs.extend(zip(values, tokens))
        if scores.top_logprobs is not None and top is not None:
            scores.top_logprobs.extend(top)
        if scores.token_ids_logprobs is not None and chosen is not None:
            scores.token_ids_logprobs.extend(chosen)

    def finish_input_scores(self) -> None:
        """The prompt is fully prefilled: its scores go out with the next output."""
        if self.input_scores_pending:
            self.input_scores_pending = False
            self._input_scores_ready, self._input_scores = self._input_scores, None

    def add_output_token_ids_logprobs(self, row: list[tuple[float, int]]) -> None:
        self._pending_ids_lp.append(row)

    def owned_kv(self) -> int:
        return self.kv_len - self.cache_prefix_len if self.row is not None else 0

    def append_token(
        self,
        token: int,
        eos_ids: frozenset[int],
        context_length: int,
        logprob: float | None = None,
        top: list[tuple[float, int]] | None = None,
    ) -> None:
        self.output_ids.append(token)
        if logprob is not None:
            self._pending_logprobs.append((logprob, token))
        if top is not None:
            self._pending_top.append(top)
        p = self.params
        if not p.ignore_eos and token in eos_ids:
            self.finish_reason = {"type": "stop", "matched": token}
        elif token in p.stop_token_ids:
            self.finish_reason = {"type": "stop", "matched": token}
        elif len(self.output_ids) >= p.max_new_tokens or self.seq_len >= context_length:
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}
        if self._detok is not None:
            prev_len = len(self._text)
            self._text = self._detok.add([token])
            if self._stops is not None:
                # Only text a new token can complete needs searching.
                hit = self._stops.find(self._text, max(0, prev_len - self._stops.max_len + 1))
                if hit is not None:
                    self._text = self._text[: hit[0]]
                    self._stop_string_hit = True
                    self.finish_reason = {"type": "stop", "matched": hit[1]}

    def can_rewind_last_token(self) -> bool:
        """The last output token can be taken back: not sent yet, no logprobs recorded."""
        return (
            bool(self.output_ids)
            and self._sent_ids < len(self.output_ids)
            and not self.return_logprob
            and self.top_logprobs_num == 0
            and not self.finished
        )

    def rewind_last_token(self) -> None:
        """Drop the last output token (jump-forward retokenizes it with the forced text).
        Only while can_rewind_last_token(); the token has no KV yet."""
        self.output_ids.pop()
        if self._detok is not None:
            self._detok = IncrementalDetokenizer(
                self._tokenizer,
                skip_special_tokens=self.params.skip_special_tokens,
                spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            )
            self._text = self._detok.add(self.output_ids) if self.output_ids else ""

    def advance_grammar(self, token: int) -> None:
        """Feed the sampled token to the grammar (the sampler only offered allowed tokens)."""
        if self.finish_reason is not None and self.finish_reason.get("type") == "length":
            return  # truncated: the grammar state no longer matters
        if not self.grammar.accept_token(token):
            # Only when no token was allowed at all (e.g. min_new_tokens forbade the stop).
            self.finish_abort("the grammar allows no further token here", status=200)
        elif self.grammar.is_terminated and self.finish_reason is None:
            # The grammar ended on a stop token that ignore_eos let through.
            self.finish_reason = {"type": "stop", "matched": token}

    def finish_abort(self, message: str, status: int = 200) -> None:
        self.finish_reason = {"type": "abort", "message": message}
        if status != 200:
            self.error, self.error_status = message, status

    def make_output(self) -> ReqOutput:
        """Deltas since the previous output (text held back while it may start a stop string)."""
        if self.finished and not self._final_text:
            self._final_text = True
            if self._detok is None and self._tokenizer is not None:
                self._text = self._tokenizer.decode(
                    self.output_ids,
                    skip_special_tokens=self.params.skip_special_tokens,
                    spaces_between_special_tokens=self.params.spaces_between_special_tokens,
                )
            elif self._detok is not None and not self._stop_string_hit:
                self._text = self._detok.flush()  # emit bytes held back mid-character
        text = self._text
        end = len(text)
        if not self.finished and self._stops is not None:
            end = self._stops.safe_prefix_len(text)
        delta = text[self._sent_text : end] if end > self._sent_text else ""
        self._sent_text = max(self._sent_text, end)
        new_ids = self.output_ids[self._sent_ids :]
        self._sent_ids = len(self.output_ids)
        out = ReqOutput(
            rid=self.rid,
            text_delta=delta,
            new_ids=new_ids,
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.origin_input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=max(self.cached_tokens, 0),
            new_logprobs=self._pending_logprobs if self.return_logprob else None,
            new_top_logprobs=self._pending_top if self.top_logprobs_num > 0 else None,
            new_token_ids_logprobs=self._pending_ids_lp if self.token_ids_logprob else None,
            input_logprobs=self._input_scores_ready,
            error=self.error,
            error_status=self.error_status,
            embedding=self.embedding,
        )
        self._pending_logprobs, self._pending_top, self._pending_ids_lp = [], [], []
        self._input_scores_ready = None
        return out
