"""The adapter pool: registered adapters (host memory), the slots that hold some of them on the
model's device, and the per-forward grouping the adapted layers read.

- Registered adapters (`--lora-paths`, `/load_lora_adapter`) are checked against the model
  when they are added and kept in host memory.
- `num_slots` (`--max-loaded-loras`) of them sit in the layers' slot buffers. A request pins
  its adapter's slot from admission until it finishes, is retracted or is aborted; when an
  adapter that holds no slot is needed, the least recently used unpinned one leaves its slot.
  With every slot pinned the request waits in the queue.
- Each adapted layer adds its delta through a forward hook on the base module, reading
  `self.batch` (set by the model runner around each forward), so the model families need no
  LoRA code.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from genserve.srt.lora.adapter import LoRAAdapter, linear_geometry, load_adapter
from genserve.srt.lora.layers import LoRABatch, LoRALayer, make_lora_batch
from genserve.srt.mem_cache.errors import IntegrityError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_adapter_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"LoRA adapter name {name!r} must be 1-128 letters, digits, '.', '_' "
                         "or '-' (starting with a letter or digit)")
    return name


class LoRAManager:
    def __init__(self, model: nn.Module, num_slots: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        """Built before the model's linear layers are quantized: their geometry (fused
        shards) is read from the full-precision modules."""
        if num_slots < 1:
            raise ValueError(f"max_loaded_loras must be >= 1, got {num_slots}")
        self.model = model
        self.device, self.dtype = device, dtype
        self.table = linear_geometry(model)
        self.adapters: dict[str, LoRAAdapter] = {}
        self.layers: dict[str, LoRALayer] = {}
        self.rank = 0  # the slot buffers' rank: the largest registered adapter's
        self.slots: list[str | None] = [None] * num_slots
        self.lru: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, oldest first
        self.pins: dict[str, int] = {}
        self.batch: LoRABatch | None = None  # the current forward's grouping
        self._next_uid = 0
        self.stats = {"slot_loads": 0, "slot_evictions": 0}

    # ---- registry ---------------------------------------------------------------------------

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Register (check and read) the PEFT adapter at `path` as `name`."""
        check_adapter_name(name)
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        self._next_uid += 1
        adapter = load_adapter(name, path, self.model, self.table, self._next_uid)
        if adapter.rank > self.rank:
            for layer in self.layers.values():
                layer.grow_rank(adapter.rank)
            self.rank = adapter.rank
        for module in adapter.weights:
            if module not in self.layers:
                self._add_layer(module)
        self.adapters[name] = adapter
        logger.info("LoRA adapter %s loaded from %s: rank %d, %d layers", name, path,
                    adapter.rank, len(adapter.weights))
        return adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        if self.pins.get(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by running requests")
        slot = self.lru.pop(name, None)
        if slot is not None:
            self._clear_slot(slot)
        del self.adapters[name]
        self.pins.pop(name, None)

    def names(self) -> list[str]:
        return list(self.adapters)

    def _add_layer(self, module_name: str) -> None:
        layer = LoRALayer(self.table[module_name], len(self.slots), self.rank, self.device,
                          self.dtype)
        for slot, holder in enumerate(self.slots):  # slots taken before this layer existed
            if holder is not None:
                layer.write(slot, self.adapters[holder])
        self.layers[module_name] = layer
        # The module now (a quantized layer replaced the full-precision one of that name).
        module = self.model.get_submodule(module_name)
        module.register_forward_hook(self._hook(layer))

    def _hook(self, layer: LoRALayer):
        def add_lora_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.batch is not None:
                x = args[0]
                layer.add_delta(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]),
                                self.batch)

        return add_lora_delta

    # ---- slots ------------------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """Pin `name` in a slot (loading it, evicting the least recently used unpinned
        adapter if needed); None when every slot is pinned by other adapters."""
        slot = self.lru.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            for layer in self.layers.values():
                layer.write(slot, self.adapters[name])
            self.slots[slot] = name
            self.stats["slot_loads"] += 1
        self.lru[name] = slot
        self.lru.move_to_end(name)
        self.pins[name] = self.pins.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        self.pins[name] -= 1

    def _free_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        for victim, slot in self.lru.items():  # oldest first
            if not self.pins.get(victim):
                del self.lru[victim]
                self._clear_slot(slot)
                self.stats["slot_evictions"] += 1
                return slot
        return None

    def _clear_slot(self, slot: int) -> None:
        self.slots[slot] = None
        for layer in self.layers.values():
            layer.active[slot] = False

    # ---- forwards ---------------------------------------------------------------------------

    def make_batch(self, slots: list[int], extend_lens: list[int]) -> LoRABatch | None:
        return make_lora_batch(slots, extend_lens, self.device, len(self.slots), self.dtype)

    def info(self) -> dict[str, Any]:
        return {
            "adapters": {n: {"path": a.path, "rank": a.rank, "slot": self.lru.get(n),
                             "pins": self.pins.get(n, 0)} for n, a in self.adapters.items()},
            "max_loaded_loras": len(self.slots),
            **self.stats,
        }

    def check_integrity(self, pinned_by_reqs: dict[str, int]) -> None:
        """Pins equal the live requests holding each adapter; slots and the LRU agree."""
        for name in set(self.pins) | set(pinned_by_reqs):
            if self.pins.get(name, 0) != pinned_by_reqs.get(name, 0):
                raise IntegrityError(
                    f"LoRA adapter {name!r}: {self.pins.get(name, 0)} pins for "
                    f"{pinned_by_reqs.get(name, 0)} live requests")
        for name, slot in self.lru.items():
            if self.slots[slot] != name:
                raise IntegrityError(f"LoRA slot {slot} holds {self.slots[slot]!r}, "
                                     f"the LRU says {name!r}")
        if len(self.lru) != sum(s is not None for s in self.slots):
            raise IntegrityError("LoRA slots and LRU disagree on the loaded adapters")
