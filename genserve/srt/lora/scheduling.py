"""What the scheduler does with a request's adapter: resolve its name into the radix-cache
namespace, pin its slot while it holds KV, and tell each forward which slot each row uses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genserve.srt.lora.manager import LoRAManager
    from genserve.srt.scheduler.req import Req


def attach_adapter(lora: LoRAManager | None, refusal: str | None, req: Req) -> str | None:
    """None when `req` may run; else why not (a 400). An adapted request's KV lives in a
    namespace of its own adapter load (like a cache_salt): adapters, the base model and a
    reloaded adapter of the same name never share KV."""
    name = req.lora_name
    if name is None:
        return None
    if lora is None:
        return f"LoRA adapters are not served here: {refusal}"
    adapter = lora.adapters.get(name)
    if adapter is None:
        loaded = ", ".join(sorted(lora.adapters)) or "none"
        return f"unknown LoRA adapter {name!r} (loaded: {loaded})"
    req.namespace = f"{req.namespace}\x00lora:{adapter.uid}"
    return None


def pin_adapter(lora: LoRAManager | None, req: Req) -> bool:
    """Give an admitted request its adapter's slot; False when every slot is pinned by
    other adapters (the request waits)."""
    if req.lora_name is None or req.lora_slot >= 0 or lora is None:
        return True
    slot = lora.acquire(req.lora_name)
    if slot is None:
        return False
    req.lora_slot = slot
    return True


def unpin_adapter(lora: LoRAManager | None, req: Req) -> None:
    """The request gave its KV back (finished, aborted, retracted): its pin goes too."""
    if req.lora_slot >= 0 and lora is not None:
        lora.release(req.lora_name)  # type: ignore[arg-type]
        req.lora_slot = -1


def load_adapter_into(sched: Any, name: str, path: str) -> None:
    """Register an adapter with the scheduler's pool; ValueError says why it cannot."""
    if sched.lora is None:
        raise ValueError(f"LoRA adapters are not served here: {sched.runner.lora_refusal}")
    sched.lora.add(name, path)


def unload_adapter(lora: LoRAManager | None, refusal: str | None, reqs: dict[str, Any],
                   name: str) -> None:
    """ValueError when `name` is unknown or a queued or running request uses it."""
    if lora is None:
        raise ValueError(f"LoRA adapters are not served here: {refusal}")
    users = sum(1 for r in reqs.values() if r.lora_name == name)
    if users:
        raise ValueError(f"LoRA adapter {name!r} is in use by {users} requests")
    lora.remove(name)


def pins_by_adapter(reqs: list[Req]) -> dict[str, int]:
    pins: dict[str, int] = {}
    for r in reqs:
        if r.lora_slot >= 0:
            pins[r.lora_name] = pins.get(r.lora_name, 0) + 1  # type: ignore[index]
    return pins
