"""Gateway settings (the HTTP side; runtime settings live in the engines' own args)."""

from __future__ import annotations

from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral")  # `--tool-call-parser`
REASONING_PARSERS = ("deepseek-r1", "qwen3")  # `--reasoning-parser`


@dataclass(frozen=True)
class GatewayConfig:
    # None = no auth. Clients send `Authorization: Bearer <key>` or `x-api-key: <key>`.
    api_key: str | None = None
    # Bodies above this get 413 (images/edits uploads need a few MB).
    max_body_bytes: int = 32 * 1024 * 1024
    # Host header names the server answers to (`--allowed-host`: exact, "*.suffix" or "*");
    # empty = no check. `genserve serve` fills in loopback names when it binds loopback.
    allowed_hosts: tuple[str, ...] = ()
    # Allowed CORS origins; empty = CORS off (no Access-Control headers at all).
    cors_origins: tuple[str, ...] = ()
    # Per LLM: requests the gateway holds at once (running + waiting in the engine). Beyond it
    # new requests get 503 at once instead of queueing without bound. None = no limit.
    max_queued_requests: int | None = None
    # Extra names under which the first LLM is also served (`--served-model-name`).
    served_model_names: tuple[str, ...] = ()
    # Concurrent realtime video WebSocket sessions (read by the realtime router).
    max_realtime_sessions: int = 4
    # Hosts whose http(s) image URLs vision requests may name ("*" = any public host); empty =
    # image URLs are refused (data URLs and base64 always work). See srt/multimodal.
    allowed_image_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int = 30000
    # Output format of tool calls (`--tool-call-parser`); None = detected from the template.
    tool_call_parser: str | None = None
    # Split <think>...</think> into reasoning_content (`--reasoning-parser`); None = off.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be non-empty when given (omit it to disable auth)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be >= 1 (or None for no limit), "
                f"got {self.max_queued_requests}"
            )
        if not isinstance(self.allowed_hosts, tuple) or not all(
                isinstance(h, str) and h.strip() for h in self.allowed_hosts):
            raise ValueError("allowed_hosts must be a tuple of non-empty host names")
        if not isinstance(self.cors_origins, tuple):
            raise ValueError("cors_origins must be a tuple of origins")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, "
                             f"got {self.reasoning_parser!r}")
        if not isinstance(self.served_model_names, tuple):
            raise ValueError("served_model_names must be a tuple of names")
        if self.max_realtime_sessions < 1:
            raise ValueError(
                f"max_realtime_sessions must be >= 1, got {self.max_realtime_sessions}")
        if not isinstance(self.allowed_image_domains, tuple):
            raise ValueError("allowed_image_domains must be a tuple of host names")
        if self.max_image_bytes < 1024:
            raise ValueError(f"max_image_bytes must be >= 1024, got {self.max_image_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
