"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens."""
