"""Prometheus metrics, exposition written by hand (text format 0.0.4; no extra dependency).

Counters only ever grow (a cache hit *rate* is derived by the scraper from two counters, never a
gauge overwritten per batch). Latencies are measured here in the gateway from stream timing, so
they include tokenization, IPC and detokenization: what a client sees.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable
from typing import Any

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResultEvent
from genserve.srt.messages import GenerateOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = labelnames

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...] = ()) -> None:
        super().__init__(name, doc, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        for labels, value in sorted(self._values.items()):
            lines.append(f"{self.name}{_labels(self.labelnames, labels)} {_num(value)}")
        return lines


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, *labels: str) -> None:
        self._values[labels] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, doc: str, buckets: Iterable[float],
                 labelnames: tuple[str, ...] = ()) -> None:
        super().__init__(name, doc, labelnames)
        self.buckets = tuple(sorted(buckets))
        # labels -> (per-bucket counts (non-cumulative, last = +Inf), sum, count)
        self._series: dict[tuple[str, ...], list[Any]] = {}

    def observe(self, value: float, *labels: str) -> None:
        series = self._series.setdefault(labels, [[0] * (len(self.buckets) + 1), 0.0, 0])
        series[0][bisect.bisect_left(self.buckets, value)] += 1
        series[1] += value
        series[2] += 1

    def count(self, *labels: str) -> int:
        return self._series.get(labels, [None, 0.0, 0])[2]

    def render(self) -> list[str]:
        lines = self.header()
        for labels, (counts, total, count) in sorted(self._series.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                le = _labels(self.labelnames, labels, f'le="{_num(bound)}"')
                lines.append(f"{self.name}_bucket{le} {cumulative}")
            base = _labels(self.labelnames, labels)
            lines.append(f"{self.name}_sum{base} {_num(total)}")
            lines.append(f"{self.name}_count{base} {count}")
        return lines


class GatewayMetrics:
    """Every metric the gateway exports; one instance per app."""

    def __init__(self) -> None:
        m = ("model",)
        self.prompt_tokens = Counter("genserve_prompt_tokens_total", "Prompt tokens processed.", m)
        self.generation_tokens = Counter(
            "genserve_generation_tokens_total", "Tokens generated.", m)
        self.cached_tokens = Counter(
            "genserve_cached_tokens_total", "Prompt tokens served from the prefix cache.", m)
        self.requests = Counter(
            "genserve_requests_total", "Finished requests by finish reason.",
            ("model", "finish_reason"))
        self.rejected = Counter(
            "genserve_requests_rejected_total", "Requests refused before running, by status.",
            ("model", "status"))
        self.ttft = Histogram("genserve_time_to_first_token_seconds",
                              "Time to first token (streaming requests).", _LATENCY_BUCKETS, m)
        self.itl = Histogram("genserve_inter_token_latency_seconds",
                             "Time between output tokens (streaming requests).", _ITL_BUCKETS, m)
        self.e2e = Histogram("genserve_e2e_request_latency_seconds",
                             "End-to-end request latency.", _LATENCY_BUCKETS, m)
        self.running = Gauge("genserve_num_running_reqs", "Requests running in the engine.", m)
        self.waiting = Gauge("genserve_num_waiting_reqs", "Requests waiting in the engine.", m)
        self.kv_usage = Gauge("genserve_kv_cache_usage", "Fraction of the KV pool in use.", m)
        self.max_total_tokens = Gauge(
            "genserve_max_total_tokens", "KV pool capacity in tokens.", m)
        self.grammar_compiles = Gauge(
            "genserve_grammar_compiles", "Grammars compiled by the engine (cache misses).", m)
        self.grammar_cache_hits = Gauge(
            "genserve_grammar_cache_hits", "Constrained requests that reused a compiled grammar.",
            m)
        self.images_encoded = Gauge(
            "genserve_vision_images_encoded",
            "Images the vision encoder has run on (a repeated image is not encoded again).", m)
        self.images_cached = Gauge(
            "genserve_vision_cached_images", "Image embeddings held by the image cache.", m)
        self.in_flight = Gauge("genserve_gateway_in_flight_reqs",
                               "Requests the gateway holds (admitted, not finished).", m)
        self.diffusion_queue_depth = Gauge(
            "genserve_diffusion_queue_depth",
            "Diffusion requests submitted to the worker and not finished (queued or running).")
        self.diffusion_batch_size = Histogram(
            "genserve_diffusion_batch_size", "Requests that shared one pipeline call.",
            _BATCH_BUCKETS, m)
        self.diffusion_step_time = Histogram(
            "genserve_diffusion_step_time_seconds",
            "Denoising time per step (the request's denoise time / its steps).",
            _STEP_BUCKETS, m)
        self.diffusion_steps = Counter(
            "genserve_diffusion_steps_total", "Denoising steps run, per output.", m)
        self.diffusion_cached_steps = Counter(
            "genserve_diffusion_cached_steps_total",
            "Denoising steps served from the step cache, per output.", m)
        self.images = Counter("genserve_images_generated_total", "Images generated.", m)
        self.video_frames = Counter(
            "genserve_video_frames_generated_total", "Video frames generated.", m)

    def all(self) -> list[_Metric]:
        return [v for v in vars(self).values() if isinstance(v, _Metric)]

    def update_server_info(self, model: str, info: dict[str, Any]) -> None:
        for key, gauge in (("num_running_reqs", self.running), ("num_waiting_reqs", self.waiting),
                           ("kv_usage", self.kv_usage), ("max_total_tokens",
                                                         self.max_total_tokens)):
            value = info.get(key)
            if isinstance(value, (int, float)):
                gauge.set(float(value), model)
        grammar = info.get("grammar")
        if isinstance(grammar, dict):
            self.grammar_compiles.set(float(grammar.get("compiles", 0)), model)
            self.grammar_cache_hits.set(float(grammar.get("cache_hits", 0)), model)
        vision = info.get("multimodal")
        if isinstance(vision, dict):
            self.images_encoded.set(float(vision.get("images_encoded", 0)), model)
            self.images_cached.set(float(vision.get("cached_images", 0)), model)

    def observe_diffusion_result(self, model: str, task: str, event: ResultEvent) -> None:
        """Record a finished diffusion request (`task`: text-to-image | text-to-video)."""
        outputs = len(event.outputs)
        self.diffusion_batch_size.observe(event.batch_size, model)
        if event.total_steps > 0 and "denoise" in event.timings:
            self.diffusion_step_time.observe(
                event.timings["denoise"] / 1000.0 / event.total_steps, model)
        self.diffusion_steps.inc(event.total_steps * outputs, model)
        self.diffusion_cached_steps.inc(event.cached_steps * outputs, model)
        if task == TEXT_TO_VIDEO:
            self.video_frames.inc(sum(len(frames) for frames in event.outputs), model)
        else:
            self.images.inc(outputs, model)

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class RequestTimer:
    """Times one request from the gateway's view and records it when it ends."""

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
            self.metrics.ttft.observe(now - self.start, self.model)
        else:
            per_token = (now - self._last_time) / new
            for _ in range(new):
                self.metrics.itl.observe(per_token, self.model)
        self._last_time = now
        self._last_tokens = out.completion_tokens

    def finish(self, out: GenerateOutput | None, reason: str | None = None) -> None:
        """Record the end of the request (`out` None when it died before any output)."""
        if self._done:
            return
        self._done = True
        metrics = self.metrics
        if out is not None:
            metrics.prompt_tokens.inc(out.prompt_tokens, self.model)
            metrics.generation_tokens.inc(out.completion_tokens, self.model)
            metrics.cached_tokens.inc(out.cached_tokens, self.model)
            if reason is None:
                reason = (out.finish_reason or {}).get("type") or "unknown"
        metrics.requests.inc(1, self.model, reason or "abort")
        metrics.e2e.observe(time.perf_counter() - self.start, self.model)
