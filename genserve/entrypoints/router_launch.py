"""Starts sglang-router's Rust router with its own command-line flags, for `--dp`.

`python -m sglang_router.launch_router` imports the package's Python mini load balancer first,
which imports all of SGLang, torch and transformers when SGLang is installed: seconds of CPU and
a torch-sized resident set in a process that only forwards requests. genserve never uses that
balancer, so this launcher reads the same flags with the package's own `RouterArgs` and starts
the Rust `Router` directly, importing nothing else.

    python -m genserve.entrypoints.router_launch --worker-urls http://127.0.0.1:30001 ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def build_router(argv: Sequence[str]) -> Any:
    """The (not yet started) Rust router the flags describe; `--mini-lb` is refused."""
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="genserve-router",
                                     description="sglang-router's Rust router, for genserve --dp")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(list(argv)), use_router_prefix=False)
    if getattr(args, "mini_lb", False):
        raise SystemExit("genserve-router runs the Rust router only; for the Python mini load "
                         "balancer use `python -m sglang_router.launch_router --mini-lb`")
    validate = getattr(args, "_validate_router_args", None)
    if validate is not None:
        validate()
    return Router.from_args(args)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle("sglang::router")
    except ImportError:
        pass
    build_router(sys.argv[1:] if argv is None else argv).start()


if __name__ == "__main__":
    main()
