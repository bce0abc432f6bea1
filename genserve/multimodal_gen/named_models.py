"""Every diffusion model servable by name: one row each (no torch).

`load_model` (pipelines/__init__.py) builds a builder row's pipeline (`embedded.build_embedded`)
or loads a folder row's diffusers folder, wraps it in the row's family and applies the row's
spec defaults over the family's. Rows marked `default` are served when no
`--diffusion-model-path` is given. Adding an embedded model is one row here plus its builder (or
its weights folder).
"""

from __future__ import annotations

from genserve.multimodal_gen.messages import (
    IMAGE_EDIT,
    IMAGE_TO_VIDEO,
    INPAINTING,
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
)
from genserve.named_models import NamedModel, NamedModelTable

_EMBEDDED = "genserve.multimodal_gen.embedded"
_PIPELINES = "genserve.multimodal_gen.pipelines"
_EMBEDDED_2026 = "genserve.multimodal_gen.embedded_video_2026"
_DEMO = "genserve.demo_models"

# Spec defaults of the embedded random-weight pipelines, sized for a CPU.
_TINY_IMAGE = dict(default_width=64, default_height=64, default_steps=4, max_pixels=512 * 512)
_TINY_VIDEO = dict(default_width=64, default_height=64, default_steps=4, default_num_frames=9,
                   max_num_frames=33, max_pixels=256 * 256, default_fps=8)
_TINY_HELIOS = dict(default_width=64, default_height=64, default_steps=2, max_pixels=256 * 256,
                    default_guidance=1.0, default_fps=8)


def _demo(name: str, task: str, kind: str, summary: str, spec: dict | None = None,
          module: str = "pipeline") -> NamedModel:
    # The trained demo models: weights shipped in the package, their own pipeline class.
    cls = kind.capitalize()
    return NamedModel(
        name, "diffusion", task, "folder", f"{_DEMO}.models:{kind.upper()}_WEIGHTS_PATH",
        family=f"{_DEMO}.family:Shapes{cls}Family",
        pipeline=f"{_DEMO}.{module}:Shapes{cls}Pipeline", spec=spec or {}, default=True,
        summary=summary)


_STREAM_FRAMES = 9 * 64  # one request's longest streamed video (a realtime stream is endless)


def _tiny(name: str, task: str, family: str, spec: dict, summary: str,
          module: str = _EMBEDDED) -> NamedModel:
    builder = "build_" + name.replace("-", "_")
    return NamedModel(name, "diffusion", task, "builder", f"{module}:{builder}",
                      family=f"{_PIPELINES}.{family}", spec=spec, summary=summary)


ROWS = (
    _demo("shapes-image", TEXT_TO_IMAGE, "image", "trained demo model: the shapes grammar"),
    _demo("shapes-video", TEXT_TO_VIDEO, "video", "trained demo model: the shapes grammar",
          spec=dict(max_num_frames=16)),
    # After shapes-video: a plain video request goes there, a longer one (default_model_for)
    # and a realtime session (streaming models first) come here. Its guidance is in its
    # folder's model_index.json (chosen on held-out streams; the model card has the sweep).
    _demo("shapes-stream", TEXT_TO_VIDEO, "stream",
          "trained demo model: one endless shapes video that follows the prompt",
          spec=dict(max_num_frames=_STREAM_FRAMES), module="stream_model"),
    # Random weights: they exercise every code path of their family.
    _tiny("tiny-flux", TEXT_TO_IMAGE, "flux:FluxFamily",
          dict(_TINY_IMAGE, default_guidance=3.5), "random-weight FLUX.1"),
    _tiny("tiny-wan", TEXT_TO_VIDEO, "wan:WanFamily",
          dict(_TINY_VIDEO, default_guidance=1.0), "random-weight Wan 2.1"),
    _tiny("tiny-sd3", TEXT_TO_IMAGE, "sd3:SD3Family",
          dict(_TINY_IMAGE, default_guidance=5.0), "random-weight Stable Diffusion 3"),
    _tiny("tiny-sd", TEXT_TO_IMAGE, "sd:StableDiffusionFamily",
          dict(_TINY_IMAGE, default_guidance=5.0), "random-weight Stable Diffusion 1.x"),
    _tiny("tiny-ltx", TEXT_TO_VIDEO, "ltx:LTXFamily",
          dict(_TINY_VIDEO, default_guidance=3.0), "random-weight LTX-Video"),
    _tiny("tiny-sdxl", TEXT_TO_IMAGE, "sdxl:StableDiffusionXLFamily",
          dict(_TINY_IMAGE, default_guidance=5.0), "random-weight SDXL"),
    _tiny("tiny-flux-kontext", IMAGE_EDIT, "flux_edit:FluxKontextFamily", dict(_TINY_IMAGE),
          "random-weight FLUX.1 Kontext"),
    _tiny("tiny-flux-fill", INPAINTING, "flux_edit:FluxFillFamily", dict(_TINY_IMAGE),
          "random-weight FLUX.1 Fill"),
    _tiny("tiny-wan-i2v", IMAGE_TO_VIDEO, "wan_i2v:WanImageToVideoFamily",
          dict(_TINY_VIDEO, default_guidance=1.0), "random-weight Wan 2.2 image-to-video"),
    _tiny("tiny-qwen-image", TEXT_TO_IMAGE, "qwen_image:QwenImageFamily", dict(_TINY_IMAGE),
          "random-weight Qwen-Image", _EMBEDDED + "_qwen"),
    _tiny("tiny-qwen-image-edit", IMAGE_EDIT, "qwen_image:QwenImageEditFamily",
          dict(_TINY_IMAGE), "random-weight Qwen-Image-Edit", _EMBEDDED + "_qwen"),
    _tiny("tiny-helios", TEXT_TO_VIDEO, "helios:HeliosFamily", dict(_TINY_HELIOS),
          "random-weight Helios"),
    _tiny("tiny-helios-pyramid", TEXT_TO_VIDEO, "helios_pyramid:HeliosPyramidFamily",
          dict(_TINY_HELIOS), "random-weight Helios, pyramid stages"),
    _tiny("tiny-helios-distilled", TEXT_TO_VIDEO, "helios_pyramid:HeliosPyramidFamily",
          dict(_TINY_HELIOS, default_steps=1), "random-weight Helios, distilled (DMD)"),
    _tiny("tiny-flux2", TEXT_TO_IMAGE, "flux2:Flux2Family", dict(_TINY_IMAGE),
          "random-weight FLUX.2 [dev]", _EMBEDDED + "_2026"),
    _tiny("tiny-flux2-klein", TEXT_TO_IMAGE, "flux2:Flux2KleinFamily", dict(_TINY_IMAGE),
          "random-weight FLUX.2 [klein] base", _EMBEDDED + "_2026"),
    _tiny("tiny-z-image", TEXT_TO_IMAGE, "z_image:ZImageFamily", dict(_TINY_IMAGE),
          "random-weight Z-Image", _EMBEDDED + "_2026"),
    # The streaming demo's architecture (a pixel-space Helios transformer) with seeded random
    # weights: the fast test bed of its code paths.
    NamedModel("tiny-shapes-stream", "diffusion", TEXT_TO_VIDEO, "builder",
               f"{_DEMO}.stream_model:build_tiny_shapes_stream",
               family=f"{_DEMO}.family:ShapesStreamFamily",
               pipeline=f"{_DEMO}.stream_model:ShapesStreamPipeline",
               spec=dict(max_num_frames=_STREAM_FRAMES),
               summary="random-weight shapes-stream (pixel-space Helios, streaming)"),
    # The 2025-26 video families (embedded_video_2026.py).
    _tiny("tiny-wan22-ti2v", TEXT_TO_VIDEO, "wan:WanFamily",
          dict(_TINY_VIDEO, default_guidance=1.0),
          "random-weight Wan 2.2 TI2V-5B (2.2 VAE, per-token timesteps)", _EMBEDDED_2026),
    _tiny("tiny-wan22-a14b", TEXT_TO_VIDEO, "wan:WanFamily",
          dict(_TINY_VIDEO, default_guidance=1.0),
          "random-weight Wan 2.2 A14B (two experts switched by timestep)", _EMBEDDED_2026),
    _tiny("tiny-hunyuan-video15", TEXT_TO_VIDEO, "hunyuan_video15:HunyuanVideo15Family",
          dict(_TINY_VIDEO, default_width=32, default_height=32, default_num_frames=5),
          "random-weight HunyuanVideo 1.5", _EMBEDDED_2026),
    _tiny("tiny-ltx2", TEXT_TO_VIDEO, "ltx2:LTX2Family",
          dict(_TINY_VIDEO, default_width=32, default_height=32, default_guidance=3.0),
          "random-weight LTX-2, video only (its audio track is left out)", _EMBEDDED + "_ltx2"),
)
DIFFUSION_MODELS = NamedModelTable("diffusion", ROWS)


def default_model_names() -> tuple[str, ...]:
    return tuple(row.name for row in DIFFUSION_MODELS.defaults())


def default_model_for(task: str, num_frames: int | None = None) -> str:
    """The default model serving `task` (`genserve generate` without --model): the first
    default row of the task whose spec allows `num_frames` (so a long video can go to a
    streaming model), else the first of the task."""
    rows = [row for row in DIFFUSION_MODELS.defaults() if row.task == task]
    fits = [row for row in rows
            if num_frames is None or num_frames <= row.spec.get("max_num_frames", num_frames)]
    return (fits or rows)[0].name
