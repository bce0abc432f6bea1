"""Realtime video over WebSocket (`GET /v1/realtime/video`) and the browser web UI; the
protocol is specified in docs/realtime_protocol.md."""
