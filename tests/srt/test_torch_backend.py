"""The torch backend's cascade decode (shared prefix attended once per group) equals plain
padded attention."""

from __future__ import annotations

import torch

from genserve.srt.forward_batch import ForwardMode
from genserve.srt.layers.attention import torch_backend
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.attention.torch_backend import TorchAttnBackend
from genserve.srt.mem_cache import MHATokenToKVPool, ReqToTokenPool
from genserve.srt.model_runner import ModelRunner


def _default_layout() -> list[torch.Tensor]:
    shared = torch.arange(1, 101)  # 100 shared slots
    layout, slot = [], 200
    for row in range(7):
        if row < 4:  # rows 0-3 share the 100-slot prefix, then diverge
            own = torch.arange(slot, slot + 10 + 5 * row)
            ids = torch.cat([shared, own])
        elif row < 6:  # rows 4-5 share only 40 slots (below the cascade threshold)
            own = torch.arange(slot, slot + 60)
            ids = torch.cat([torch.arange(2000, 2040), own])
        else:  # a lone request
            ids = torch.arange(3000, 3033)
        slot += 100
        layout.append(ids)
    return layout


def _decode_batch(hq=6, hkv=2, d=16, layout=None):
    torch.manual_seed(0)
    pool = MHATokenToKVPool(4096, torch.float32, 1, hkv, d)
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    r2t = ReqToTokenPool(16, 512)
    seq_lens = []
    for row, ids in enumerate(layout or _default_layout()):
        r2t.req_to_token[row, : len(ids)] = ids
        seq_lens.append(len(ids))
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner.req_to_token_pool, runner.token_to_kv_pool = r2t, pool
    runner.lora = None  # no adapters served
    runner.on_hidden = None  # no EAGLE head reads the hidden states
    backend = TorchAttnBackend()
    runner.attn_backend = backend
    rows = list(range(len(seq_lens)))
    last = [int(r2t.req_to_token[r, n - 1]) for r, n in zip(rows, seq_lens)]
    fb = ModelRunner.build_forward_batch(
        runner,
        ForwardMode.DECODE,
        rows,
        [5] * len(rows),
        [n - 1 for n in seq_lens],
        [1] * len(rows),
        torch.tensor(last),
    )
    info = AttentionLayerInfo(0, hq, hkv, d, d**-0.5)
    q = torch.randn(len(rows), hq, d)
    k = pool.k_buffer[0][last].clone()
    v = pool.v_buffer[0][last].clone()
    return backend, fb, info, q, k, v


def test_cascade_decode_equals_padded(monkeypatch):
    backend, fb, info, q, k, v = _decode_batch()
    backend.init_forward_metadata(fb)
    assert len(backend._groups) == 1 and backend._groups[0].members.tolist() == [0, 1, 2, 3]
    cascade = backend.forward(q, k, v, info, fb)
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_PREFIX", 10**9)
    backend.init_forward_metadata(fb)
    assert backend._groups == []
    plain = backend.forward(q, k, v, info, fb)
    torch.testing.assert_close(cascade, plain, rtol=1e-5, atol=1e-5)


def test_groups_split_below_a_short_head_every_request_shares(monkeypatch):
    """Prompts that all open with the same few tokens (a BOS, a chat template's first line) and
    then fall into two system prompts form two cascade groups, not one group sharing 3 tokens."""
    head = torch.arange(1, 4)
    layout = []
    for row in range(7):
        if row < 6:
            system = torch.arange(100, 200) if row < 3 else torch.arange(300, 400)
            own = torch.arange(1000 + 50 * row, 1000 + 50 * row + 8 + row)
            layout.append(torch.cat([head, system, own]))
        else:  # only the head in common with the others
            layout.append(torch.cat([head, torch.arange(2000, 2080)]))
    backend, fb, info, q, k, v = _decode_batch(layout=layout)
    backend.init_forward_metadata(fb)
    assert sorted(g.members.tolist() for g in backend._groups) == [[0, 1, 2], [3, 4, 5]]
    assert [g.prefix_slots.numel() for g in backend._groups] == [103, 103]
    assert backend._plain_rows.tolist() == [6]
    cascade = backend.forward(q, k, v, info, fb)
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_PREFIX", 10**9)
    backend.init_forward_metadata(fb)
    plain = backend.forward(q, k, v, info, fb)
    torch.testing.assert_close(cascade, plain, rtol=1e-5, atol=1e-5)
