"""Sampling: per-request parameters, per-batch tensors and the batched sampler.

`SamplingParams` is importable without torch (`genserve.srt.sampling.sampling_params`); this
package's top level re-exports the torch parts too.
"""

from genserve.srt.sampling.sampling_params import SamplingParams

__all__ = ["SampleOutput", "Sampler", "SamplingBatchInfo", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `from genserve.srt.sampling import SamplingParams` does not import torch
    # (the gateway validates sampling params and must stay torch-free).
    if name in ("SampleOutput", "Sampler", "SamplingBatchInfo"):
        from genserve.srt.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
