"""Speculative draft-tree verification through both attention backends: an EXTEND batch where
one request's new tokens are a draft tree (`ForwardBatch.tree_masks`, positions prefix +
depth) and another's a causal extend, against a dense torch computation of what each token
may see (its request's prefix, and its ancestors or its causal past).

Tolerances: kernel_testing.py (ATTN_TOL).
"""

import pytest
import torch
from kernel_testing import ATTN_TOL, DEVICE, assert_close, randn
from test_triton_backend import _batch

from genserve.srt.forward_batch import ForwardMode
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.layers.attention.torch_backend import TorchAttnBackend
from genserve.srt.layers.attention.triton_backend import TritonAttnBackend
from genserve.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from genserve.srt.speculative.tree import DraftTree, ancestor_mask

# Node i's parent (-1: the root, the request's last token): branches of depths 3, 2 and 1.
PARENTS = (-1, 0, 1, -1, 3, 4, -1, 6, 2, 2, 5)


def _dense(q, keys, values, visible, scale):
    """q [n, Hq, D]; keys/values [prefix + n, Hkv, D]; visible [n, prefix + n] bool."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~visible.to(DEVICE), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("backend_name", "dtype", "window"),
    [
        ("torch", torch.float32, None),
        ("torch", torch.float32, 3),
        ("triton", torch.float32, None),
        ("triton", torch.bfloat16, None),
    ],
)
def test_tree_batch_matches_dense_attention(backend_name, dtype, window):
    hq, hkv, d = 4, 2, 64
    tree = DraftTree(tuple(range(len(PARENTS))), PARENTS)
    rows, prefix, extend = [1, 3], [9, 5], [len(tree) + 1, 3]
    req_pool = ReqToTokenPool(4, 64, DEVICE)
    kv_pool = MHATokenToKVPool(128, dtype, 1, hkv, d, DEVICE)
    if backend_name == "torch":
        backend = TorchAttnBackend()
    else:
        backend = TritonAttnBackend(hq, hkv, d, DEVICE)
    layer = AttentionLayerInfo(0, hq, hkv, d, d**-0.5, sliding_window=window)
    slots = (torch.randperm(127, generator=torch.Generator().manual_seed(0)) + 1).to(DEVICE)
    old, used, locs = [], 0, []
    for i, row in enumerate(rows):
        mine = slots[used : used + prefix[i] + extend[i]]
        used += mine.numel()
        req_pool.write(row, 0, mine)
        k = randn(prefix[i], hkv, d, dtype=dtype, seed=10 + i)
        v = randn(prefix[i], hkv, d, dtype=dtype, seed=20 + i)
        kv_pool.set_kv_buffer(0, mine[: prefix[i]], k, v)
        old.append((k, v))
        locs.append(mine[prefix[i] :])
    fb = _batch(
        ForwardMode.EXTEND, rows, prefix, extend, torch.cat(locs), (req_pool, kv_pool), backend
    )
    depths = torch.tensor([0, *tree.depths()])
    fb.positions = torch.cat([depths + prefix[0], torch.arange(3) + prefix[1]]).to(DEVICE)
    fb.tree_masks = [ancestor_mask(tree, DEVICE), None]
    backend.init_forward_metadata(fb)
    t = sum(extend)
    q = randn(t, hq, d, dtype=dtype, seed=1)
    k = randn(t, hkv, d, dtype=dtype, seed=2)
    v = randn(t, hkv, d, dtype=dtype, seed=3)
    out = backend.forward(q, k, v, layer, fb)

    # Request 0: node r sees the prefix and its ancestors; request 1: the causal past.
    seen_tree = torch.cat(
        [
            torch.ones(extend[0], prefix[0], dtype=torch.bool),
            ancestor_mask(tree, torch.device("cpu")),
        ],
        1,
    )
    seen_chain = torch.ones(3, prefix[1] + 3, dtype=torch.bool).tril(prefix[1])
    start = 0
    for i, seen in enumerate((seen_tree, seen_chain)):
        new = slice(start, start + extend[i])
        if window is not None:
            qpos = fb.positions[new].cpu()
            kpos = torch.cat([torch.arange(prefix[i]), qpos])
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        keys, values = torch.cat([old[i][0], k[new]]), torch.cat([old[i][1], v[new]])
        expected = _dense(q[new], keys, values, seen, layer.scaling)
        assert_close(out[new], expected, ATTN_TOL[dtype])
        start += extend[i]
    # The tree mattered: a root child (row 7) attends otherwise than it would causally.
    causal = _dense(
        q[7:8],
        torch.cat([old[0][0], k[:8]]),
        torch.cat([old[0][1], v[:8]]),
        torch.ones(1, prefix[0] + 8, dtype=torch.bool),
        layer.scaling,
    )
    assert not torch.allclose(out[7:8].float(), causal, atol=1e-3)
