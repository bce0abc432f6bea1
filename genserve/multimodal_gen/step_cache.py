"""Step caching strategies for a pipeline's denoiser: an ABC, a registry and a factory.

`DBCacheStepCache` uses cache-dit's DBCache on one transformer *instance* (cache-dit's
transformer-only path replaces that instance's `forward`; no class is patched, so other pipelines
of the same class are untouched). The cache context is rebuilt before every pipeline call with
that call's config and step count, so a change of size, steps or thresholds never sees stale
residuals; requests that do not ask for caching run the transformer's uncached forward.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from genserve.multimodal_gen.messages import StepCacheConfig


class StepCache(ABC):
    """A step cache bound to one denoiser module."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    @abstractmethod
    def configure(self, config: StepCacheConfig, num_inference_steps: int,
                  separate_cfg: bool = False) -> None:
        """Prepare for one pipeline call: fresh cache state for `config` (disabled = no caching)
        and `num_inference_steps`; `separate_cfg` when the transformer runs twice per step."""

    @abstractmethod
    def cached_steps(self) -> int:
        """Denoising steps served from the cache in the last call."""


class NoStepCache(StepCache):
    def configure(self, config, num_inference_steps, separate_cfg=False) -> None:
        pass

    def cached_steps(self) -> int:
        return 0


class DBCacheStepCache(StepCache):
    """cache-dit DBCache (optionally with the TaylorSeer calibrator), attached on first use."""

    def __init__(self, module: torch.nn.Module, blocks: tuple[str, str] | None = None):
        super().__init__(module)
        # (ModuleList attribute, cache-dit ForwardPattern name) for transformers cache-dit has
        # no registered adapter for (e.g. SD3Transformer2DModel).
        self.blocks = blocks
        self._attached = False
        self._active = False
        self._uncached_forward = None
        self._cached_forward = None

    def _attach(self, config) -> None:
        import cache_dit

        logging.getLogger("cache_dit").setLevel(logging.WARNING)
        _quiet_cache_dit()
        from cache_dit import BlockAdapter, BlockAdapterRegister, ForwardPattern

        self._uncached_forward = self.module.forward
        target = self.module
        if not BlockAdapterRegister.is_supported(self.module) and self.blocks is not None:
            attr, pattern = self.blocks
            from cache_dit.caching.block_adapters.block_adapters import FakeDiffusionPipeline

            target = BlockAdapter(
                pipe=FakeDiffusionPipeline(self.module), transformer=self.module,
                blocks=getattr(self.module, attr),
                forward_pattern=getattr(ForwardPattern, pattern), check_forward_pattern=True)
        cache_dit.enable_cache(target, cache_config=config)
        _quiet_cache_dit()  # loggers of submodules imported by enable_cache
        self._cached_forward = self.module.forward
        self._attached = True

    def configure(self, config, num_inference_steps, separate_cfg=False) -> None:
        if not config.enabled:
            if self._attached:
                # The instance attribute cache-dit set; restore the plain forward.
                self.module.forward = self._uncached_forward
            self._active = False
            return
        import cache_dit
        from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

        db = DBCacheConfig(
            Fn_compute_blocks=config.fn,
            Bn_compute_blocks=config.bn,
            residual_diff_threshold=config.residual_diff_threshold,
            max_warmup_steps=config.warmup_steps,
            max_cached_steps=config.max_cached_steps,
            enable_separate_cfg=separate_cfg,
            num_inference_steps=num_inference_steps,
        )
        if not self._attached:
            self._attach(db)
        self.module.forward = self._cached_forward
        calibrator = (TaylorSeerCalibratorConfig(taylorseer_order=1)
                      if config.taylorseer else None)
        cache_dit.refresh_context(self.module, cache_config=db, calibrator_config=calibrator)
        self._active = True

    def cached_steps(self) -> int:
        if not self._active:
            return 0
        import cache_dit

        stats = cache_dit.summary(self.module, logging=False)
        # With separate CFG the unconditional pass has its own (parallel) cached steps.
        return max((len(s.cached_steps or []) for s in stats), default=0)


class ExpertStepCaches(StepCache):
    """One step cache per expert of a pipeline that switches denoisers by timestep (Wan 2.2
    A14B): each expert keeps its own cache state over the steps it runs, `steps_of(n)` of them
    out of `n`."""

    def __init__(self, caches: list[StepCache],
                 steps_of: Callable[[int], tuple[int, ...]]):
        super().__init__(caches[0].module)
        self.caches = caches
        self.steps_of = steps_of

    def configure(self, config, num_inference_steps, separate_cfg=False) -> None:
        for cache, steps in zip(self.caches, self.steps_of(num_inference_steps), strict=True):
            cache.configure(config, max(1, steps), separate_cfg=separate_cfg)

    def cached_steps(self) -> int:
        return sum(cache.cached_steps() for cache in self.caches)


STEP_CACHES: dict[str, type[StepCache]] = {"none": NoStepCache, "dbcache": DBCacheStepCache}


def make_step_cache(kind: str, module: torch.nn.Module,
                    blocks: tuple[str, str] | None = None) -> StepCache:
    if kind not in STEP_CACHES:
        raise ValueError(f"unknown step cache {kind!r}; choose one of {sorted(STEP_CACHES)}")
    # One cache per module: two wrappers of the same (process-cached) pipeline share it.
    existing = getattr(module, "_genserve_step_cache", None)
    if type(existing) is STEP_CACHES[kind]:
        return existing
    cache = DBCacheStepCache(module, blocks) if kind == "dbcache" else STEP_CACHES[kind](module)
    module._genserve_step_cache = cache
    return cache


def _quiet_cache_dit() -> None:
    # cache-dit logs every context refresh at INFO through its own (non-propagating) loggers.
    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("cache_dit") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.WARNING)
