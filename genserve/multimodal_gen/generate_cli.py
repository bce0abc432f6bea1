"""`genserve generate` for diffusion models: one request in this process, no server.

    genserve generate --prompt "a red circle on a white background, top left" --output c.png
    genserve generate --prompt "a blue square moving up on a black background" --output s.mp4
    genserve generate --model tiny-flux --prompt "a red cat" --output cat.png

The output's extension picks the format (.png / .jpg / .webp for images, .mp4 for videos); a
tqdm bar follows the denoising steps. With n > 1 outputs are written as name-0.png, name-1.png.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

from genserve.multimodal_gen.messages import (
    STEP_CACHE_KINDS,
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    DiffusionRequest,
    StepCacheConfig,
    StepDecision,
)
from genserve.multimodal_gen.named_models import default_model_for
from genserve.multimodal_gen.validation import resolve_request

_IMAGE_EXT = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `run` reads (the gateway CLI may already define most of them)."""
    p.add_argument("--model", default=None,
                   help="A name `genserve models` lists (default: the default model of the "
                   "output's kind, image or video), a diffusers folder or a hub id.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--output", required=True, help="out.png / .jpg / .webp, or out.mp4")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None)
    p.add_argument("--fps", type=int, default=None)
    p.add_argument("--num-inference-steps", type=int, default=None)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="Number of outputs.")
    p.add_argument("--step-cache", default="none", choices=STEP_CACHE_KINDS)
    p.add_argument("--step-cache-threshold", type=float, default=None)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="auto")
    p.add_argument("--diffusion-cpu-offload", action="store_true")


def _is_diffusion_model(path: str) -> bool:
    from genserve.multimodal_gen.named_models import DIFFUSION_MODELS

    return path in DIFFUSION_MODELS or (Path(path) / "model_index.json").is_file()


def _model_name(args: argparse.Namespace, output: Path) -> str:
    model = getattr(args, "model", None)
    paths = getattr(args, "diffusion_model_path", None)
    # `genserve generate --model X` reaches us as --model-path (argparse abbreviation) when
    # the gateway CLI has no --model flag of its own.
    llm_paths = [p for p in getattr(args, "model_path", None) or [] if _is_diffusion_model(p)]
    if model:
        return model
    if paths:
        return paths[0]
    if llm_paths:
        return llm_paths[0]
    video = getattr(args, "task", None) == TEXT_TO_VIDEO or output.suffix.lower() == ".mp4"
    if video:
        return default_model_for(TEXT_TO_VIDEO, getattr(args, "num_frames", None))
    return default_model_for(TEXT_TO_IMAGE)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from genserve.multimodal_gen.encoding import encode_image, encode_mp4
    from genserve.multimodal_gen.launch import default_step_cache_from_args
    from genserve.multimodal_gen.malloc_tuning import tune_malloc
    from genserve.multimodal_gen.pipelines import load_model

    tune_malloc()
    output = Path(args.output)
    suffix = output.suffix.lower()
    if suffix not in _IMAGE_EXT and suffix != ".mp4":
        print(f"genserve generate: --output must end in .png, .jpg, .webp or .mp4, got {output}",
              file=sys.stderr)
        return 2
    if (getattr(args, "diffusion_cp", None) or 1) > 1:
        print("genserve generate: --diffusion-cp splits calls over a group of processes; "
              "use `genserve serve --diffusion-cp N`", file=sys.stderr)
        return 2
    from genserve.multimodal_gen.launch import worker_config_from_args

    path = _model_name(args, output)
    # The serve flags' load options: dtype, device, memory options, LoRA adapters.
    model = load_model(path, worker_config_from_args([path], args).options_for(path))
    spec = model.spec
    if (spec.is_video) != (suffix == ".mp4"):
        kind = "a video (.mp4)" if spec.is_video else "an image (.png/.jpg/.webp)"
        print(f"genserve generate: model {spec.name} makes {kind}; change --output",
              file=sys.stderr)
        return 2
    req = DiffusionRequest(
        rid=uuid.uuid4().hex, model=spec.name, prompt=args.prompt,
        negative_prompt=args.negative_prompt, width=args.width, height=args.height,
        num_frames=args.num_frames, fps=args.fps, num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale, seed=args.seed,
        num_outputs=getattr(args, "n", 1) or 1,
    )
    try:
        resolved = resolve_request(req, spec, default_step_cache_from_args(args)
                                   if getattr(args, "step_cache", None) else StepCacheConfig())
    except ValueError as exc:
        print(f"genserve generate: {exc}", file=sys.stderr)
        return 2
    bar = tqdm(total=resolved.num_inference_steps, desc=f"{spec.name} denoising", unit="step")

    def on_step(step: int, total: int, tensors: dict) -> StepDecision:
        bar.total = total
        bar.update(step - bar.n)
        return StepDecision.CONTINUE

    out = model.generate([resolved], on_step)
    bar.close()
    paths = [output] if len(out.frames) == 1 else [
        output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(len(out.frames))]
    for path, frames in zip(paths, out.frames, strict=True):
        if suffix == ".mp4":
            data = encode_mp4(frames, resolved.fps or 16)
        else:
            data = encode_image(frames[0], _IMAGE_EXT[suffix])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path} ({frames.shape[2]}x{frames.shape[1]}, {frames.shape[0]} frame(s), "
              f"seed {resolved.seeds[paths.index(path)]}, {out.cached_steps} cached steps)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="genserve-generate-diffusion")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
