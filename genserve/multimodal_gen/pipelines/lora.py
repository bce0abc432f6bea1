"""LoRA adapters of a served model: loaded at start by name, combined per request.

diffusers' `load_lora_weights` reads an adapter file (kohya, diffusers or peft key layouts) and
peft injects its low-rank layers into the pipeline's modules under the adapter's name;
`set_adapters` picks which adapters are active, with which scale, for the next call. A batch
holds requests with the same adapters and scales (their `batch_key` says so), so one
`set_adapters` per pipeline call serves every row. Runs in the worker process (imports torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from genserve.multimodal_gen.batch_invariance import make_batch_invariant


def load_adapters(model: Any, adapters: tuple[tuple[str, str], ...]) -> None:
    """Load each (name, path) into `model`'s pipeline, then switch them all off. ValueError
    when a file cannot be read or its weights match none of the model's layers."""
    pipe = model.pipe
    if not hasattr(pipe, "load_lora_weights"):
        raise ValueError(f"model {model.name} ({model.family}) does not take LoRA adapters")
    for name, path in adapters:
        try:
            pipe.load_lora_weights(path, adapter_name=name)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise ValueError(f"LoRA adapter {name!r} ({path}) does not fit model "
                             f"{model.name}: {type(exc).__name__}: {exc}") from None
        loaded = {a for names in pipe.get_list_adapters().values() for a in names}
        if name not in loaded:
            raise ValueError(f"LoRA adapter {name!r} ({path}) does not fit model {model.name}: "
                             "none of its weights name a layer of this model")
    # The adapters' own linear layers join the batch-invariant denoiser (see base.py).
    for denoiser in model.denoisers:
        make_batch_invariant(denoiser)
    pipe.disable_lora()
    model.lora_adapters = tuple(sorted({*model.lora_adapters, *(n for n, _ in adapters)}))
    model.spec = dataclasses.replace(model.spec, lora_adapters=model.lora_adapters)


def activate(model: Any, loras: tuple[tuple[str, float], ...]) -> None:
    """Make `loras` ((name, scale) pairs; empty = none) the active adapters of the next call."""
    if loras == model.active_loras:
        return
    pipe = model.pipe
    if loras:
        pipe.enable_lora()
        pipe.set_adapters([n for n, _ in loras], [s for _, s in loras])
    else:
        pipe.disable_lora()
    model.active_loras = loras
