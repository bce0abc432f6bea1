"""HTTP gateway: app factory, routers (native SGLang API, OpenAI API, ops), CLI.

Nothing in this package imports torch; it talks to runtimes through `LLMEngineClient` and the
diffusion client only.
"""
