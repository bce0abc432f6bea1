"""OpenAI-compatible /v1/embeddings, served by embedding models (and the pooled-request path the
rerank and Ollama /api/embed endpoints share)."""
