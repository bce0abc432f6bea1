"""Per-batch sampling tensors, built once per forward step from the requests' SamplingParams.

The scheduler rebuilds this every step, so `build` does only O(B) Python work plus a couple of
small host-to-device copies in the common case; the [B, V] penalty statistics are made only when
some row uses a penalty, and `append_output_tokens` updates them in place for callers that keep
one info across decode steps of an unchanged batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from genserve.srt.sampling.penalties import token_counts
from genserve.srt.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    batch_size: int
    vocab_size: int
    device: torch.device
    # [B] per-row values. Greedy rows have temperature 1 (they never divide by it); rows without
    # top-k have top_k == vocab_size.
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    greedy_mask: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]
    # Row lists drive the sampling loop: seeded rows sample one by one with their generator so a
    # seed gives the same tokens alone or batched; unseeded non-greedy rows sample together.
    seeded_rows: list[int]
    unseeded_rows: torch.Tensor | None  # [R] long, or None when there are none
    all_greedy: bool
    any_greedy: bool
    need_temperature: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    # Penalties (None when no row of the batch uses them).
    repetition_penalties: torch.Tensor | None = None  # [B]
    seen_tokens: torch.Tensor | None = None  # [B, V] bool: in prompt or output
    frequency_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] float32
    # min_new_tokens: (row, token) pairs to forbid this step; None when nothing is forbidden.
    mask_rows: torch.Tensor | None = None
    mask_cols: torch.Tensor | None = None
    # logit_bias: logits[bias_rows[i], bias_cols[i]] += bias_values[i]; None when no row has one.
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Grammar-constrained rows [R] and their allowed-token bitmask [R, ceil(V/32)] int32.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Host-side state for append_output_tokens: per row, tokens still to generate before EOS is
    # allowed, and the ids forbidden until then.
    _min_tokens_left: list[int] = field(default_factory=list)
    _banned_ids: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def has_penalties(self) -> bool:
        return self.seen_tokens is not None or self.output_counts is not None

    @property
    def has_token_mask(self) -> bool:
        return self.mask_rows is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_token_ids: Iterable[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatchInfo:
        """Precompute the batch's sampling tensors. Generators must live on `device`."""
        batch = len(params)
        if not (len(generators) == len(prompt_ids) == len(output_ids) == batch):
            raise ValueError(
                "params, generators, prompt_ids and output_ids must have one entry per row, got "
                f"{batch}, {len(generators)}, {len(prompt_ids)}, {len(output_ids)}"
            )
        if batch == 0:
            raise ValueError("cannot build SamplingBatchInfo for an empty batch")
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        # One host-to-device copy for the float rows, one for the int rows.
        floats = torch.tensor([temps, top_ps, min_ps], dtype=torch.float32).to(device)
        ints = torch.tensor([top_ks, greedy], dtype=torch.long).to(device)
        sampled = [i for i, g in enumerate(greedy) if not g]
        seeded = [i for i in sampled if generators[i] is not None]
        unseeded = [i for i in sampled if generators[i] is None]
        info = cls(
            batch_size=batch,
            vocab_size=vocab_size,
            device=device,
            temperatures=floats[0],
            top_ks=ints[0],
            top_ps=floats[1],
            min_ps=floats[2],
            greedy_mask=ints[1].bool(),
            generators=list(generators),
            seeded_rows=seeded,
            unseeded_rows=torch.tensor(unseeded, dtype=torch.long, device=device)
            if unseeded
            else None,
            all_greedy=not sampled,
            any_greedy=len(sampled) < batch,
            need_temperature=any(temps[i] != 1.0 for i in sampled),
            need_top_k=any(top_ks[i] < vocab_size for i in sampled),
            need_top_p=any(top_ps[i] < 1.0 for i in sampled),
            need_min_p=any(min_ps[i] > 0.0 for i in sampled),
        )
        info._build_penalties(params, prompt_ids, output_ids)
        info._build_min_tokens(params, output_ids, eos_token_ids)
        info._build_logit_bias(params)
        return info

    def _build_logit_bias(self, params: list[SamplingParams]) -> None:
        if not any(p.logit_bias for p in params):
            return
        rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
        cols = [t for p in params for t, _ in p.logit_bias]
        values = [b for p in params for _, b in p.logit_bias]
        index = torch.tensor([rows, cols], dtype=torch.long).to(self.device)
        self.bias_rows, self.bias_cols = index[0], index[1]
        self.bias_values = torch.tensor(values, dtype=torch.float32).to(self.device)

    def _build_penalties(
        self,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> None:
        vocab, device = self.vocab_size, self.device
        if any(p.repetition_penalty != 1.0 for p in params):
            # Rows with penalty 1.0 are left empty: dividing by 1 changes nothing.
            seen_lists = [
                list(prompt) + list(out) if p.repetition_penalty != 1.0 else []
                for p, prompt, out in zip(params, prompt_ids, output_ids, strict=True)
            ]
            self.seen_tokens = token_counts(seen_lists, vocab, device) > 0
            self.repetition_penalties = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32
            ).to(device)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            out_lists = [
                list(out) if (p.frequency_penalty or p.presence_penalty) else []
                for p, out in zip(params, output_ids, strict=True)
            ]
            self.output_counts = token_counts(out_lists, vocab, device)
            pens = torch.tensor(
                [[p.frequency_penalty for p in params], [p.presence_penalty for p in params]],
                dtype=torch.float32,
            ).to(device)
            self.frequency_penalties, self.presence_penalties = pens[0], pens[1]

    def _build_min_tokens(
        self,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        eos_token_ids: Iterable[int],
    ) -> None:
        if not any(p.min_new_tokens > 0 for p in params):
            return
        eos = tuple(eos_token_ids)
        self._min_tokens_left = [
            max(p.min_new_tokens - len(out), 0) for p, out in zip(params, output_ids, strict=True)
        ]
        self._banned_ids = [
            tuple(t for t in sorted(set(eos) | set(p.stop_token_ids)) if 0 <= t < self.vocab_size)
            for p in params
        ]
        self._refresh_token_mask()

    def _refresh_token_mask(self) -> None:
        rows: list[int] = []
        cols: list[int] = []
        pairs = zip(self._min_tokens_left, self._banned_ids, strict=True)
        for row, (left, banned) in enumerate(pairs):
            if left > 0:
                rows.extend([row] * len(banned))
                cols.extend(banned)
        if not rows:
            self.mask_rows = self.mask_cols = None
            return
        index = torch.tensor([rows, cols], dtype=torch.long).to(self.device)
        self.mask_rows, self.mask_cols = index[0], index[1]

    def append_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Account for one new output token per row (same rows, same order as at build time).

        Equivalent to rebuilding with each row's output_ids extended by its token, but O(B).
        """
        ids = next_token_ids.to(device=self.device, dtype=torch.long).view(-1)
        if ids.numel() != self.batch_size:
            raise ValueError(f"expected {self.batch_size} token ids, got {ids.numel()}")
        rows = torch.arange(self.batch_size, device=self.device)
        valid = (ids >= 0) & (ids < self.vocab_size)
        rows, ids = rows[valid], ids[valid]
        if self.seen_tokens is not None and self.repetition_penalties is not None:
            # Only rows that use the penalty track seen tokens (see _build_penalties).
            tracked = self.repetition_penalties[rows] != 1.0
            self.seen_tokens[rows[tracked], ids[tracked]] = True
        if self.output_counts is not None:
            self.output_counts.index_put_(
                (rows, ids), torch.ones(rows.numel(), device=self.device), accumulate=True
            )
        if self._min_tokens_left:
            self._min_tokens_left = [max(left - 1, 0) for left in self._min_tokens_left]
            self._refresh_token_mask()
