"""`genserve generate`: one request without a server (text, or an image / video file)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from genserve.entrypoints.serve import configure_logging, engine_args_from

_MEDIA_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".mp4", ".gif")


def is_diffusion_request(args: argparse.Namespace) -> bool:
    output = (args.output or "").lower()
    return bool(args.diffusion_model_path or args.model or args.task
                or output.endswith(_MEDIA_SUFFIXES))


def run_generate(args: argparse.Namespace) -> int:
    configure_logging(args.log_level or "warning")
    if is_diffusion_request(args):
        if not args.output:
            raise ValueError("a diffusion request needs --output (out.png, .jpg, .webp or .mp4)")
        try:
            from genserve.multimodal_gen.generate_cli import run
        except ImportError as exc:
            print(f"genserve generate: diffusion generation is unavailable ({exc})",
                  file=sys.stderr)
            return 1
        return int(run(args) or 0)
    return _generate_text(args)


def text_engine_args(args: argparse.Namespace) -> Any:
    """The engine settings of `generate`: `serve`'s, except that the decode step is compiled
    only when --compile asks (one request never pays back a minute of compiling)."""
    engine_args = engine_args_from(args, args.model_path[0] if args.model_path else None)
    if engine_args.compile is None:
        engine_args = dataclasses.replace(engine_args, compile=False)
    return engine_args


def _generate_text(args: argparse.Namespace) -> int:
    from genserve.srt.engine import Engine

    if args.model_path and len(args.model_path) > 1:
        raise ValueError("generate takes one --model-path")
    engine_args = text_engine_args(args)
    engine = Engine(**{f: getattr(engine_args, f) for f in engine_args.__dataclass_fields__})
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.seed is not None:
        params["seed"] = args.seed
    result = engine.generate(prompt, params)
    print(result["text"])
    engine.shutdown()
    return 0
