"""The Ollama API: /api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps,
/api/version."""
