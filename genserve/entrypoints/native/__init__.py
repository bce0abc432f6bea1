"""SGLang-compatible native API: /generate and the runtime control endpoints."""
