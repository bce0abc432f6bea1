"""OpenAI-compatible API: /v1/completions and /v1/chat/completions."""
