"""The gateway's Prometheus metrics (prometheus-client, one registry per app, no globals).

Names follow SGLang's (`sglang:` -> `genserve:`, label `model_name`), so dashboards built for
SGLang read genserve with the prefix changed; the diffusion runtime adds its own. Latencies are
measured here in the gateway from stream timing, so they include tokenization, IPC and
detokenization: what a client sees. Values the engines own (running and queued requests, KV
usage, grammar and vision-cache counts) are copied from their `server_info` at each scrape.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResultEvent
from genserve.srt.messages import GenerateOutput

# What /metrics answers with: the classic text format every Prometheus version scrapes.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_M = ("model_name",)

# server_info key -> attribute of the gauge it sets
_SERVER_INFO_GAUGES = (("num_running_reqs", "running"), ("num_waiting_reqs", "queued"),
                       ("kv_usage", "token_usage"), ("max_total_tokens", "max_total_num_tokens"))


class GatewayMetrics:
    """Every metric the gateway exports; one instance (and registry) per app."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # -- every runtime
        self.requests = Counter("genserve:num_requests", "Finished requests by finish reason.",
                                (*_M, "finish_reason"), registry=r)
        self.rejected = Counter(
            "genserve:num_rejected_requests", "Requests refused before running, by status.",
            (*_M, "status"), registry=r)
        self.e2e = Histogram("genserve:e2e_request_latency_seconds",
                             "End-to-end request latency.", _M, buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.in_flight = Gauge("genserve:gateway_in_flight_reqs",
                               "Requests the gateway holds (admitted, not finished).", _M,
                               registry=r)
        # -- LLM
        self.prompt_tokens = Counter("genserve:prompt_tokens", "Prompt tokens processed.", _M,
                                     registry=r)
        self.generation_tokens = Counter("genserve:generation_tokens", "Tokens generated.", _M,
                                         registry=r)
        self.cached_tokens = Counter(
            "genserve:cached_tokens", "Prompt tokens served from the prefix cache.", _M,
            registry=r)
        self.cache_hit_rate = Gauge(
            "genserve:cache_hit_rate",
            "Fraction of all prompt tokens so far that were served from the prefix cache.", _M,
            registry=r)
        self.ttft = Histogram("genserve:time_to_first_token_seconds", "Time to first token.",
                              _M, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("genserve:inter_token_latency_seconds",
                             "Time between output tokens.", _M, buckets=_ITL_BUCKETS, registry=r)
        self.running = Gauge("genserve:num_running_reqs", "Requests running in the engine.", _M,
                             registry=r)
        self.queued = Gauge("genserve:num_queue_reqs", "Requests waiting in the engine.", _M,
                            registry=r)
        self.token_usage = Gauge("genserve:token_usage", "Fraction of the KV pool in use.", _M,
                                 registry=r)
        self.max_total_num_tokens = Gauge("genserve:max_total_num_tokens",
                                          "KV pool capacity in tokens.", _M, registry=r)
        self.grammar_compiles = Gauge(
            "genserve:grammar_compiles", "Grammars compiled by the engine (cache misses).", _M,
            registry=r)
        self.grammar_cache_hits = Gauge(
            "genserve:grammar_cache_hits",
            "Constrained requests that reused a compiled grammar.", _M, registry=r)
        self.images_encoded = Gauge(
            "genserve:vision_images_encoded",
            "Images the vision encoder has run on (a repeated image is not encoded again).", _M,
            registry=r)
        self.images_cached = Gauge(
            "genserve:vision_cached_images", "Image embeddings held by the image cache.", _M,
            registry=r)
        # -- diffusion
        self.diffusion_streams = Gauge(
            "genserve:diffusion_streams",
            "Streaming video sessions whose history the diffusion worker holds.", registry=r)
        self.diffusion_stream_bytes = Gauge(
            "genserve:diffusion_stream_bytes",
            "Bytes of history, prompt and generator state held for streaming sessions.",
            registry=r)
        self.diffusion_queue_depth = Gauge(
            "genserve:diffusion_queue_depth",
            "Diffusion requests submitted to the worker and not finished (queued or running).",
            registry=r)
        self.diffusion_batch_size = Histogram(
            "genserve:diffusion_batch_size", "Requests that shared one pipeline call.", _M,
            buckets=_BATCH_BUCKETS, registry=r)
        self.diffusion_step_time = Histogram(
            "genserve:diffusion_step_time_seconds",
            "Denoising time per step (a request's denoise time / its steps).", _M,
            buckets=_STEP_BUCKETS, registry=r)
        self.diffusion_steps = Counter(
            "genserve:diffusion_steps", "Denoising steps run, per output.", _M, registry=r)
        self.diffusion_cached_steps = Counter(
            "genserve:diffusion_cached_steps",
            "Denoising steps served from the step cache, per output.", _M, registry=r)
        self.images = Counter("genserve:images_generated", "Images generated.", _M, registry=r)
        self.video_frames = Counter("genserve:video_frames_generated",
                                    "Video frames generated (video jobs and realtime chunks).",
                                    _M, registry=r)
        # model -> (prompt tokens, cached prompt tokens) so far, for cache_hit_rate
        self._prompt_totals: dict[str, tuple[int, int]] = {}

    def request_finished(self, model: str, reason: str, seconds: float) -> None:
        self.requests.labels(model, reason).inc()
        self.e2e.labels(model).observe(seconds)

    def count_tokens(self, model: str, prompt: int, generated: int, cached: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt)
        self.generation_tokens.labels(model).inc(generated)
        self.cached_tokens.labels(model).inc(cached)
        total, hits = self._prompt_totals.get(model, (0, 0))
        total, hits = total + prompt, hits + cached
        self._prompt_totals[model] = (total, hits)
        if total > 0:
            self.cache_hit_rate.labels(model).set(hits / total)

    def update_server_info(self, model: str, info: dict[str, Any]) -> None:
        """Copy the engine-owned values of one LLM's server_info into their gauges."""
        for key, attr in _SERVER_INFO_GAUGES:
            value = info.get(key)
            if isinstance(value, (int, float)):
                getattr(self, attr).labels(model).set(float(value))
        grammar = info.get("grammar")
        if isinstance(grammar, dict):
            self.grammar_compiles.labels(model).set(float(grammar.get("compiles", 0)))
            self.grammar_cache_hits.labels(model).set(float(grammar.get("cache_hits", 0)))
        vision = info.get("multimodal")
        if isinstance(vision, dict):
            self.images_encoded.labels(model).set(float(vision.get("images_encoded", 0)))
            self.images_cached.labels(model).set(float(vision.get("cached_images", 0)))

    def observe_diffusion_result(self, model: str, task: str, event: ResultEvent) -> None:
        """Record a finished diffusion request (`task`: text-to-image | text-to-video)."""
        outputs = len(event.outputs)
        self.diffusion_batch_size.labels(model).observe(event.batch_size)
        if event.total_steps > 0 and "denoise" in event.timings:
            self.diffusion_step_time.labels(model).observe(
                event.timings["denoise"] / 1000.0 / event.total_steps)
        self.diffusion_steps.labels(model).inc(event.total_steps * outputs)
        self.diffusion_cached_steps.labels(model).inc(event.cached_steps * outputs)
        if task == TEXT_TO_VIDEO:
            self.video_frames.labels(model).inc(sum(len(frames) for frames in event.outputs))
        else:
            self.images.labels(model).inc(outputs)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Times one LLM request from the gateway's view and records it when it ends."""

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.start = time.perf_counter()
        self._last_time: float | None = None
        self._last_tokens = 0
        self._done = False

    def on_output(self, out: GenerateOutput) -> None:
        """Call for each streamed output; new tokens since the last call drive TTFT / ITL."""
        new = out.completion_tokens - self._last_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self._last_time is None:
            self.metrics.ttft.labels(self.model).observe(now - self.start)
        else:
            per_token = (now - self._last_time) / new
            itl = self.metrics.itl.labels(self.model)
            for _ in range(new):
                itl.observe(per_token)
        self._last_time = now
        self._last_tokens = out.completion_tokens

    def finish(self, out: GenerateOutput | None, reason: str | None = None) -> None:
        """Record the end of the request (`out` None when it died before any output)."""
        if self._done:
            return
        self._done = True
        if out is not None:
            self.metrics.count_tokens(self.model, out.prompt_tokens, out.completion_tokens,
                                      out.cached_tokens)
            if reason is None:
                reason = (out.finish_reason or {}).get("type") or "unknown"
        self.metrics.request_finished(self.model, reason or "abort",
                                      time.perf_counter() - self.start)
