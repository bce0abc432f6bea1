import pytest
import torch

from genserve.srt.mem_cache import (
    IntegrityError,
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)

# ---- ReqToTokenPool -------------------------------------------------------------------------


def test_req_to_token_pool_alloc_free_and_capacity():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int64
    rows = pool.alloc(2)
    assert len(rows) == 2 and len(set(rows)) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None  # only one row left
    last = pool.alloc()
    assert sorted(rows + last) == [0, 1, 2] and pool.available_size() == 0
    pool.check_integrity()
    pool.write(last[0], 2, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[last[0], 2:5].tolist() == [7, 8, 9]
    assert pool.read(last[0], 2, 5).tolist() == [7, 8, 9]
    # One next-token slot per request: row r gets its slot at column cols[r].
    pool.write_next([rows[0], last[0]], [0, 5], torch.tensor([4, 11]))
    assert pool.read(rows[0], 0, 1).tolist() == [4]
    assert pool.read(last[0], 2, 6).tolist() == [7, 8, 9, 11]
    pool.free(rows)
    pool.free(last[0])
    assert pool.available_size() == 3
    pool.check_integrity()


def test_req_to_token_pool_rejects_double_free_and_bad_rows():
    pool = ReqToTokenPool(size=2, max_context_len=4)
    (row,) = pool.alloc(1)
    pool.free(row)
    with pytest.raises(IntegrityError, match="twice"):
        pool.free(row)
    with pytest.raises(IntegrityError, match="outside"):
        pool.free(5)
    pool.check_integrity()
    pool.alloc(2)
    pool.clear()
    assert pool.available_size() == 2
    pool.check_integrity()


# ---- TokenToKVPoolAllocator -----------------------------------------------------------------


def test_allocator_never_hands_out_slot_zero_and_respects_capacity():
    alloc = TokenToKVPoolAllocator(size=10)
    assert alloc.alloc(0).numel() == 0
    first = alloc.alloc(4)
    rest = alloc.alloc(6)
    assert first.dtype == torch.int64
    assert sorted(torch.cat([first, rest]).tolist()) == list(range(1, 11))
    assert alloc.available_size() == 0
    assert alloc.alloc(1) is None
    alloc.check_integrity()


def test_allocator_reuses_freed_slots():
    alloc = TokenToKVPoolAllocator(size=8)
    a = alloc.alloc(5)
    assert alloc.alloc(4) is None
    alloc.free(a[:2])
    alloc.free(torch.empty(0, dtype=torch.int64))
    alloc.free(a[2:3])
    assert alloc.available_size() == 6
    b = alloc.alloc(6)  # needs the released slots merged back
    assert b is not None
    assert set(b.tolist()) == {6, 7, 8} | set(a[:3].tolist())
    alloc.check_integrity()
    alloc.free(b)
    alloc.free(a[3:])
    assert alloc.available_size() == 8
    assert alloc.free_slots().tolist() == list(range(1, 9))
    alloc.check_integrity()


def test_allocator_double_free_detected():
    alloc = TokenToKVPoolAllocator(size=6)
    a = alloc.alloc(3)
    alloc.free(a)
    alloc.check_integrity()
    alloc.free(a[:1])
    with pytest.raises(IntegrityError, match="twice|double"):
        alloc.check_integrity()


def test_allocator_detects_padding_slot_freed():
    alloc = TokenToKVPoolAllocator(size=4)
    alloc.alloc(1)
    alloc.free(torch.tensor([0]))
    with pytest.raises(IntegrityError, match="slot 0"):
        alloc.check_integrity()


def test_allocator_free_group_counts_at_once_and_batches():
    alloc = TokenToKVPoolAllocator(size=6)
    a = alloc.alloc(6)
    alloc.free_group_begin()
    for i in range(6):
        alloc.free(a[i : i + 1])
    assert alloc.available_size() == 6
    assert alloc.alloc(2) is not None  # grouped frees are reusable inside the group
    alloc.free_group_end()
    assert alloc.available_size() == 4
    alloc.check_integrity()
    with pytest.raises(IntegrityError):
        alloc.free_group_end()
    alloc.clear()
    assert alloc.available_size() == 6
    alloc.check_integrity()


def test_allocator_rejects_bad_size():
    with pytest.raises(ValueError, match="size"):
        TokenToKVPoolAllocator(size=0)


# ---- MHATokenToKVPool -----------------------------------------------------------------------


def test_kv_pool_shapes_and_memory():
    pool = MHATokenToKVPool(size=16, dtype=torch.float16, num_layers=3, num_kv_heads=2, head_dim=4)
    assert len(pool.k_buffer) == 3 and len(pool.v_buffer) == 3
    assert pool.get_key_buffer(1).shape == (17, 2, 4)
    k, v = pool.get_kv_buffer(2)
    assert k.dtype == v.dtype == torch.float16 and v.shape == (17, 2, 4)
    assert pool.mem_bytes() == 2 * 3 * 17 * 2 * 4 * 2


def test_set_kv_buffer_writes_only_the_given_rows_of_one_layer():
    pool = MHATokenToKVPool(size=8, dtype=torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=3)
    loc = torch.tensor([5, 2, 7])
    cache_k = torch.randn(3, 2, 3)  # float32: cast to the pool dtype
    cache_v = torch.randn(3, 2, 3)
    pool.set_kv_buffer(1, loc, cache_k, cache_v)
    k, v = pool.get_kv_buffer(1)
    torch.testing.assert_close(k[loc], cache_k.to(torch.bfloat16))
    torch.testing.assert_close(v[loc], cache_v.to(torch.bfloat16))
    untouched = [i for i in range(9) if i not in (2, 5, 7)]
    assert k[untouched].abs().sum() == 0 and v[untouched].abs().sum() == 0
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layer untouched


def test_fp8_kv_pool_round_trips():
    pool = MHATokenToKVPool(
        size=4, dtype=torch.float8_e4m3fn, num_layers=1, num_kv_heads=1, head_dim=2
    )
    loc = torch.tensor([1, 3])
    cache = torch.tensor([[[0.5, -1.0]], [[2.0, 0.25]]])
    pool.set_kv_buffer(0, loc, cache, cache)
    k = pool.get_key_buffer(0)
    assert k.dtype == torch.float8_e4m3fn
    assert k[loc].float().tolist() == cache.tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pools_on_device(device):
    alloc = TokenToKVPoolAllocator(8, device=device)
    pool = MHATokenToKVPool(
        8, torch.float16, num_layers=1, num_kv_heads=1, head_dim=2, device=device
    )
    rows = ReqToTokenPool(2, 4, device=device)
    slots = alloc.alloc(3)
    assert slots.device == alloc.device == pool.device == rows.device
    rows.write(0, 0, slots)
    pool.set_kv_buffer(
        0, slots, torch.ones(3, 1, 2, device=device), torch.ones(3, 1, 2, device=device)
    )
    assert pool.get_value_buffer(0)[slots].sum().item() == 6
    alloc.free(slots.cpu())  # frees from another device land on the pool's device
    assert alloc.available_size() == 8
    alloc.check_integrity()
    rows.check_integrity()
