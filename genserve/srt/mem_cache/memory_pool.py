"""KV memory: request rows, the per-layer K/V buffers and the slot allocator.

Three objects, following SGLang's split:
- `ReqToTokenPool`: one row per running request; row r, column j holds the KV slot of token j.
- `MHATokenToKVPool`: the K and V tensors themselves, `[size + 1, num_kv_heads, head_dim]` per
  layer. Slot 0 is a padding sink (CUDA-graph padding writes land there) and never handed out.
  `MLATokenToKVPool` is its multi-head latent attention variant (DeepSeek-V2/V3): one compressed
  row per token shared by every head, `[size + 1, 1, kv_lora_rank + qk_rope_head_dim]`.
- `TokenToKVPoolAllocator`: which of the slots 1..size are free.
"""

from __future__ import annotations

import torch

from genserve.srt.mem_cache.errors import IntegrityError

# index_put is not implemented for float8 tensors; those pools store bytes and view them.
_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def canonical_device(device: str | torch.device) -> torch.device:
    """`cuda` -> `cuda:0`, so comparing with a tensor's `.device` is exact."""
    return torch.empty(0, device=device).device


def slot_counts(slots: torch.Tensor, size: int, owner: str) -> torch.Tensor:
    """[size + 1] how often each slot occurs in `slots`; IntegrityError if any is outside
    [1, size] (slot 0 is the padding slot and never owned)."""
    if slots.numel():
        lo, hi = (int(x) for x in torch.aminmax(slots))
        if lo < 1 or hi > size:
            raise IntegrityError(
                f"{owner}: slot outside [1, {size}] (min {lo}, max {hi}); "
                "slot 0 is the padding slot"
            )
    return torch.bincount(slots, minlength=size + 1)


class ReqToTokenPool:
    """Rows of KV slot indices, one row per running request."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool needs size > 0 and max_context_len > 0, "
                f"got size={size}, max_context_len={max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = canonical_device(device)
        # [size, max_context_len] int64: KV slot of token j of the request in row r.
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int64, device=self.device
        )
        self.clear()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Store `slots` at columns [start, start + len(slots)) of `row`."""
        self.req_to_token[row, start : start + slots.numel()] = slots

    def write_next(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """Store slot i at column cols[i] of row rows[i] (each request's next token)."""
        dev = self.device
        r = torch.tensor(rows, dtype=torch.int64, device=dev)
        c = torch.tensor(cols, dtype=torch.int64, device=dev)
        self.req_to_token[r, c] = slots

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """The slots at columns [start, end) of `row` (a view: clone to keep them)."""
        return self.req_to_token[row, start:end]

    def alloc(self, n: int = 1) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} rows")
        if n > len(self._free_rows):
            return None
        rows = self._free_rows[:n]
        del self._free_rows[:n]
        self._free_set.difference_update(rows)
        return rows

    def free(self, rows: int | list[int]) -> None:
        rows = [rows] if isinstance(rows, int) else list(rows)
        # Rows are few (one per running request), so catching a double free here is cheap.
        # Validate everything before changing anything.
        bad = [r for r in rows if not 0 <= r < self.size]
        if bad:
            raise IntegrityError(f"ReqToTokenPool: rows {bad} outside [0, {self.size})")
        if len(set(rows)) != len(rows) or not self._free_set.isdisjoint(rows):
            raise IntegrityError(f"ReqToTokenPool: a row in {rows} freed twice")
        self._free_set.update(rows)
        self._free_rows.extend(rows)

    def available_size(self) -> int:
        return len(self._free_rows)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))
        self._free_set = set(self._free_rows)

    def check_integrity(self) -> None:
        if len(self._free_rows) != len(self._free_set):
            raise IntegrityError("ReqToTokenPool: a row appears twice in the free list")
        if self._free_set != set(self._free_rows):
            raise IntegrityError("ReqToTokenPool: free list and free set disagree")
        bad = [r for r in self._free_rows if not 0 <= r < self.size]
        if bad:
            raise IntegrityError(f"ReqToTokenPool: free rows {bad[:8]} outside [0, {self.size})")


class MHATokenToKVPool:
    """K and V buffers of every layer for multi-head (and grouped-query) attention."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: str | torch.device = "cpu",
    ):
        if min(size, num_layers, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                "MHATokenToKVPool needs positive sizes, got "
                f"size={size}, num_layers={num_layers}, num_kv_heads={num_kv_heads}, "
                f"head_dim={head_dim}"
            )
        self.size = size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = canonical_device(device)
        self.store_dtype = torch.uint8 if dtype in _FP8_DTYPES else dtype
        # One allocation each for K and V: [num_layers, size + 1, num_kv_heads, head_dim];
        # row 0 of every layer is the padding slot.
        shape = (num_layers, size + 1, num_kv_heads, head_dim)
        self.k_all = torch.zeros(shape, dtype=self.store_dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=self.store_dtype, device=self.device)
        # Per-layer views, each [size + 1, num_kv_heads, head_dim].
        self.k_buffer = list(self.k_all.unbind(0))
        self.v_buffer = list(self.v_all.unbind(0))

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.store_dtype == self.dtype else buf.view(self.dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[layer_id])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_buffer[layer_id])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write `cache_k`/`cache_v` ([N, num_kv_heads, head_dim]) at slots `loc` ([N] int64)."""
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
        if cache_v.dtype != self.dtype:
            cache_v = cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
            cache_v = cache_v.view(self.store_dtype)
        self.k_buffer[layer_id][loc] = cache_k
        self.v_buffer[layer_id][loc] = cache_v

    def mem_bytes(self) -> int:
        return self.k_all.numel() * self.k_all.element_size() * 2

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, elt: int) -> int:
        """K and V bytes one token takes over every layer (`elt` bytes per element)."""
        return 2 * num_layers * num_kv_heads * head_dim * elt

    def check_integrity(self) -> None:
        """The buffers hold exactly the per-head layout: size + 1 rows of every layer."""
        shape = (self.num_layers, self.size + 1, self.num_kv_heads, self.head_dim)
        if tuple(self.k_all.shape) != shape or tuple(self.v_all.shape) != shape:
            raise IntegrityError(f"MHATokenToKVPool: buffers are not {shape}")
        elt = torch.empty(0, dtype=self.dtype).element_size()
        want = (self.size + 1) * self.bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, elt
        )
        if self.mem_bytes() != want:
            raise IntegrityError(f"MHATokenToKVPool: {self.mem_bytes()} bytes, expected {want}")


class MLATokenToKVPool:
    """The compressed KV of multi-head latent attention: per layer and token one row
    `[kv_lora_rank latent | qk_rope_head_dim rotated key]` that every head shares (the heads'
    keys and values are recovered from it by the layer's up-projections, never stored).

    To the attention backend it is a one-KV-head pool whose key is the whole row and whose
    value is a view of its first `kv_lora_rank` columns, so nothing is stored twice."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        device: str | torch.device = "cpu",
    ):
        if min(size, num_layers, kv_lora_rank) <= 0 or qk_rope_head_dim < 0:
            raise ValueError(
                "MLATokenToKVPool needs positive sizes, got "
                f"size={size}, num_layers={num_layers}, kv_lora_rank={kv_lora_rank}, "
                f"qk_rope_head_dim={qk_rope_head_dim}"
            )
        self.size = size
        self.dtype = dtype
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.device = canonical_device(device)
        self.store_dtype = torch.uint8 if dtype in _FP8_DTYPES else dtype
        # [num_layers, size + 1, 1, kv_lora_rank + qk_rope_head_dim]; row 0 is the padding slot.
        shape = (num_layers, size + 1, 1, self.head_dim)
        self.kv_all = torch.zeros(shape, dtype=self.store_dtype, device=self.device)
        self.kv_buffer = list(self.kv_all.unbind(0))

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.store_dtype == self.dtype else buf.view(self.dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.kv_buffer[layer_id])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent columns of the key rows (a view, not a copy)."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write the rows `cache_k` ([N, 1, kv_lora_rank + qk_rope_head_dim]) at slots `loc`.
        `cache_v` must be the latent part of `cache_k` (it is not stored again)."""
        if cache_k.shape[1:] != (1, self.head_dim):
            raise ValueError(
                f"MLATokenToKVPool rows are [N, 1, {self.head_dim}], got {tuple(cache_k.shape)}"
            )
        if cache_v.shape[-1] != self.kv_lora_rank:
            raise ValueError(f"MLA value must be the {self.kv_lora_rank}-wide latent")
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
        self.kv_buffer[layer_id][loc] = cache_k

    def mem_bytes(self) -> int:
        return self.kv_all.numel() * self.kv_all.element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, elt: int) -> int:
        """Latent + rotated-key bytes one token takes over every layer."""
        return num_layers * (kv_lora_rank + qk_rope_head_dim) * elt

    def check_integrity(self) -> None:
        """The buffer holds exactly the latent layout (no per-head copy): size + 1 rows of
        kv_lora_rank + qk_rope_head_dim elements in every layer."""
        shape = (self.num_layers, self.size + 1, 1, self.head_dim)
        if tuple(self.kv_all.shape) != shape:
            raise IntegrityError(
                f"MLATokenToKVPool: buffer is {tuple(self.kv_all.shape)}, expected {shape}"
            )
        elt = torch.empty(0, dtype=self.dtype).element_size()
        want = (self.size + 1) * self.bytes_per_token(
            self.num_layers, self.kv_lora_rank, self.qk_rope_head_dim, elt
        )
        if self.mem_bytes() != want:
            raise IntegrityError(f"MLATokenToKVPool: {self.mem_bytes()} bytes, expected {want}")


KVPool = MHATokenToKVPool | MLATokenToKVPool


def create_kv_pool(
    size: int,
    dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    latent: tuple[int, int] | None,
    device: str | torch.device = "cpu",
) -> KVPool:
    """The latent pool when `latent` = (kv_lora_rank, qk_rope_head_dim), else per-head K/V."""
    if latent is not None:
        return MLATokenToKVPool(size, dtype, num_layers, *latent, device)
    return MHATokenToKVPool(size, dtype, num_layers, num_kv_heads, head_dim, device)


def kv_bytes_per_token(
    dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    latent: tuple[int, int] | None,
) -> int:
    """Bytes one token takes in the pool `create_kv_pool` makes with the same arguments."""
    elt = torch.empty(0, dtype=dtype).element_size()
    if latent is not None:
        return MLATokenToKVPool.bytes_per_token(num_layers, *latent, elt)
    return MHATokenToKVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, elt)


class TokenToKVPoolAllocator:
    """Free-list of KV slots 1..size, kept as int64 tensors (no Python loop per slot).

    `alloc` slices off the front of `_free_slots`. `free` only appends the tensor to
    `_released`; released slots are merged back (one `torch.cat`) when the front runs short,
    so freeing many small tensors per step costs O(len) each.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        if size <= 0:
            raise ValueError(f"TokenToKVPoolAllocator needs size > 0, got {size}")
        self.size = size
        self.device = canonical_device(device)
        self._group: list[torch.Tensor] | None = None
        self.clear()

    def available_size(self) -> int:
        return self._free_slots.numel() + self._released_count

    def alloc(self, n: int) -> torch.Tensor | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} KV slots")
        if n > self._free_slots.numel():
            if n > self.available_size():
                return None
            self._merge_released()
        out = self._free_slots[:n]
        self._free_slots = self._free_slots[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        # Skip no-op conversions: this runs for many small tensors every step.
        if indices.dtype != torch.int64 or indices.device != self.device:
            indices = indices.to(device=self.device, dtype=torch.int64)
        if indices.dim() != 1:
            indices = indices.reshape(-1)
        self._released_count += indices.numel()
        (self._released if self._group is None else self._group).append(indices)

    def free_group_begin(self) -> None:
        """Collect frees until `free_group_end`, which releases them as one tensor.

        Slots freed inside a group count as available at once and `alloc` may reuse them.
        """
        if self._group is not None:
            raise IntegrityError("TokenToKVPoolAllocator: free groups do not nest")
        self._group = []

    def free_group_end(self) -> None:
        if self._group is None:
            raise IntegrityError("TokenToKVPoolAllocator: free_group_end without begin")
        group, self._group = self._group, None
        if group:
            self._released.append(torch.cat(group))

    def clear(self) -> None:
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []
        if self._group is not None:
            self._group = []
        # Slots in `_released` and `_group`.
        self._released_count = 0

    def free_slots(self, sort: bool = True) -> torch.Tensor:
        """All free slots, for tests and integrity checks; not for the hot path."""
        slots = torch.cat([self._free_slots, *self._released, *(self._group or [])])
        return torch.sort(slots).values if sort else slots

    def check_integrity(self) -> None:
        slots = self.free_slots(sort=False)
        if slots.numel() != self.available_size():
            raise IntegrityError(
                f"TokenToKVPoolAllocator: counted {self.available_size()} free slots, "
                f"found {slots.numel()}"
            )
        counts = slot_counts(slots, self.size, "TokenToKVPoolAllocator")
        dup = torch.nonzero(counts > 1).flatten()
        if dup.numel():
            raise IntegrityError(f"TokenToKVPoolAllocator: slots freed twice: {dup[:8].tolist()}")

    def _merge_released(self) -> None:
        self._free_slots = torch.cat([self._free_slots, *self._released, *(self._group or [])])
        self._released = []
        if self._group is not None:
            self._group = []
        self._released_count = 0
