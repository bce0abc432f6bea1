"""genserve: one server for generative models (LLM chat and diffusion image/video)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import genserve` (the gateway, the CLI) never pulls in torch.
    if name == "Engine":
        from genserve.srt.engine import Engine

        return Engine
    raise AttributeError(f"module 'genserve' has no attribute {name!r}")


__all__ = ["Engine", "__version__"]
