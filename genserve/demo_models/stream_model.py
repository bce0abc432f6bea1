"""`shapes-stream`: the trained streaming demo model, a small Helios transformer in pixel space.

Components (stock classes, so `save_pretrained` / `from_pretrained` work as for any diffusers
folder):
- `tokenizer` / `text_encoder`: the demo models' word-level tokenizer and tiny T5 encoder;
- `transformer`: diffusers' `HeliosTransformer3DModel`, the architecture of the Helios
  checkpoints: it denoises a chunk of frames while reading the video's history through its
  short / mid / long patch embeddings;
- `scheduler`: `HeliosScheduler` with one stage and Euler steps.

Two latent spaces (`ShapesStreamPipeline.pack` / `unpack`):
- without a `vae` the working "latents" are the frames themselves, drawn at 32x32 and
  pixel-unshuffled 2x to [C=12, 16, 16] per frame, so decoding is exact and costs nothing;
- with a `vae` (diffusers' `AutoencoderTiny` trained on the world's frames, `stream_ae.py`)
  they are its scaled [8, 8, 8] latents, frame by frame, and its conv decoder draws the frame
  (a linear read-out from each token draws blobs: docs/benchmarks.md).
The served 64x64 (or larger) frames are the 32x32 picture upscaled bilinearly, as the
other demo models do. The transformer sees each frame as 4x4 tokens, with torus
coordinates appended to its input channels (`with_coords`: rotary positions alone cannot place
the first chunk). Its output becomes the clean chunk by the pipeline's `prediction`
(`Parameterization`: the output itself, a rectified-flow velocity, or EDM's skip mix of input
and output), and `velocity` turns the clean chunk into the flow the Helios scheduler steps
with. (Why 32x32 and 8x8-pixel tokens: docs/benchmarks.md.) The served chunk loop is
`pipelines/helios.HeliosFamily`'s, through `family.ShapesStreamFamily`, which draws each chunk
in a frame that follows the shape (`stream_follow.py`).

The trained weights ship in `weights/shapes-stream` (a default model: the realtime demo's and
`genserve generate`'s for videos longer than shapes-video's 16 frames; its model card is the
folder's README.md). `tiny-shapes-stream` is the same architecture with seeded random weights,
the fast test bed; `stream_train.py` trains and exports a folder that `--diffusion-model-path`
serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderTiny, DiffusionPipeline, HeliosScheduler, HeliosTransformer3DModel
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

from genserve.demo_models.models import MAX_PROMPT_TOKENS, TEXT_DIM, build_tokenizer
from genserve.demo_models.stream_world import SIZE

MODEL_SIZE = SIZE // 2  # the frames the transformer draws (larger sizes are upscaled)
UNSHUFFLE = 2  # pixels per latent pixel along each side
LATENT_CHANNELS = 3 * UNSHUFFLE * UNSHUFFLE
FRAMES_PER_CHUNK = 9
HISTORY_SIZES = (16, 2, 1)  # long, mid, short windows (frames), as the Helios checkpoints
DEFAULT_STEPS = 3
MIN_SIGMA = 0.05  # x-prediction turns into a velocity by dividing by the noise level
PREDICTIONS = ("sample", "velocity", "edm")  # what the transformer's output means
COORD_CHANNELS = 4  # sin and cos of x and of y on the torus (`with_coords`)
TRANSFORMER_CONFIG = dict(
    patch_size=(1, 4, 4),
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=LATENT_CHANNELS + COORD_CHANNELS,
    out_channels=LATENT_CHANNELS,
    text_dim=TEXT_DIM,
    freq_dim=64,
    ffn_dim=256,
    num_layers=3,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_dim=(8, 12, 12),
    has_multi_term_memory_patch=True,
    guidance_cross_attn=True,
    zero_history_timestep=True,
)
# With an autoencoder (`stream_ae.py`) the transformer denoises its [8, 8, 8] latents instead:
# 2x2-latent-pixel tokens (the same 4x4 tokens a frame), 32 values each.
AE_DOWNSCALE = 4
LATENT_TRANSFORMER_CONFIG = dict(
    TRANSFORMER_CONFIG, patch_size=(1, 2, 2), in_channels=8 + COORD_CHANNELS, out_channels=8
)


@dataclass(frozen=True)
class Parameterization:
    """How the transformer's output F becomes the clean chunk, for noisy latents
    x_s = (1 - s) x0 + s noise: clean = c_skip(s) x_s + c_out(s) F.

    - `sample`: F is the clean chunk (c_skip 0, c_out 1), the exports before this option;
    - `velocity`: F is the rectified-flow velocity noise - x0, so clean = x_s - s F;
    - `edm`: EDM's preconditioning (Karras et al. 2022) for this interpolation, with clean
      latents of standard deviation `sigma_data`: c_skip = (1 - s) sd^2 / D^2 and
      c_out = s sd / D, D^2 = (1 - s)^2 sd^2 + s^2. F's target then has unit variance at every
      s; at s = 1 it is x-prediction, and as s falls the input passes through, so the low-noise
      steps keep the detail they are handed instead of redrawing it."""

    kind: str = "sample"
    sigma_data: float = 1.0

    def __post_init__(self):
        if self.kind not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {self.kind!r}")
        if not self.sigma_data > 0:
            raise ValueError(f"sigma_data must be positive, got {self.sigma_data!r}")

    def scalings(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_skip, c_out) for noise levels `sigma` (any shape, in [0, 1])."""
        if self.kind == "sample":
            return torch.zeros_like(sigma), torch.ones_like(sigma)
        if self.kind == "velocity":
            return torch.ones_like(sigma), -sigma
        sd2 = self.sigma_data**2
        d2 = (1 - sigma) ** 2 * sd2 + sigma**2
        return (1 - sigma) * sd2 / d2, sigma * self.sigma_data / d2.sqrt()

    def clean(
        self, output: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor
    ) -> torch.Tensor:
        """The clean chunk from the transformer's `output` for `latents` [B, C, F, h, w] at
        noise levels `sigma` [B]."""
        if self.kind == "sample":
            return output  # exactly as before the option
        c_skip, c_out = (
            c.view(-1, 1, 1, 1, 1).to(output.dtype) for c in self.scalings(sigma.float())
        )
        return c_skip * latents.to(output.dtype) + c_out * output


def pack(frames: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] pixels -> [B, 48, F, H/4, W/4] latents."""
    b, c, f, h, w = frames.shape
    x = frames.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
    x = torch.nn.functional.pixel_unshuffle(x, UNSHUFFLE)
    return x.view(b, f, *x.shape[1:]).permute(0, 2, 1, 3, 4)


def unpack(latents: torch.Tensor) -> torch.Tensor:
    """[B, 48, F, h, w] latents -> [B, 3, F, 4h, 4w] pixels."""
    b, c, f, h, w = latents.shape
    x = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
    x = torch.nn.functional.pixel_shuffle(x, UNSHUFFLE)
    return x.view(b, f, *x.shape[1:]).permute(0, 2, 1, 3, 4)


class ShapesStreamPipeline(DiffusionPipeline):
    """Holds the components; the chunk loop is the serving family's (see module doc)."""

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["vae"]

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        text_encoder: T5EncoderModel,
        transformer: HeliosTransformer3DModel,
        scheduler: HeliosScheduler,
        vae: AutoencoderTiny | None = None,
        prediction: str = "sample",
        sigma_data: float = 1.0,
        guidance_scale: float = 1.0,
    ):
        super().__init__()
        Parameterization(prediction, sigma_data)  # checks both
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (1: none), got {guidance_scale}")
        self.register_modules(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            transformer=transformer,
            scheduler=scheduler,
            vae=vae,
        )
        # In model_index.json, so serving reads what training used; a folder without them
        # (exported before the option) is x-prediction. `guidance_scale` is the classifier-
        # free guidance the folder serves with unless a request names one (chosen on held-out
        # streams; 1: none).
        self.register_to_config(
            prediction=prediction, sigma_data=sigma_data, guidance_scale=guidance_scale
        )

    @property
    def parameterization(self) -> Parameterization:
        return Parameterization(self.config.prediction, float(self.config.sigma_data))

    @property
    def native_size(self) -> int:
        return MODEL_SIZE

    @property
    def latent_shape(self) -> tuple[int, int]:
        """(channels, side) of one latent frame."""
        if self.vae is None:
            return LATENT_CHANNELS, MODEL_SIZE // UNSHUFFLE
        return self.vae.config.latent_channels, MODEL_SIZE // AE_DOWNSCALE

    def pack(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, 3, F, H, W] pixels -> [B, C, F, h, w] latents: pixel-unshuffled, or the
        autoencoder's scaled latents frame by frame (`_encode_frames`)."""
        if self.vae is None:
            return pack(frames)
        return _per_frame(frames, self._encode_frames)

    def _encode_frames(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, C, h, w]. An all-zero frame (no frame yet: the history before
        a video starts, the prefix of an opening chunk) packs to zero latents, as the served
        history starts; only the real frames go through the encoder."""
        channels, side = self.latent_shape
        out = x.new_zeros(x.shape[0], channels, side, side)
        real = x.flatten(1).abs().amax(1) > 0
        if real.any():
            out[real] = self.vae.encoder(x[real]).to(out.dtype) * self.vae.config.scaling_factor
        return out

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, F, h, w] latents -> [B, 3, F, H, W] pixels (not clamped)."""
        if self.vae is None:
            return unpack(latents)
        return _per_frame(latents, lambda z: self.vae.decoder(z / self.vae.config.scaling_factor))

    def encode_prompt(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        do_classifier_free_guidance: bool = False,
        device=None,
        **_ignored,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prompt embeddings [B, 16, D], negative ones with guidance else None), the shape
        `HeliosPipeline.encode_prompt` returns; padding positions are zeroed, as Helios does."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        embeds = self._encode(prompts, device)
        negative = None
        if do_classifier_free_guidance:
            negs = negative_prompt or ""
            negs = [negs] * len(prompts) if isinstance(negs, str) else list(negs)
            negative = self._encode(negs, device)
        return embeds, negative

    def _encode(self, prompts: list[str], device) -> torch.Tensor:
        return encode_prompts(self.tokenizer, self.text_encoder, prompts, device)

    def velocity(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        history: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The flow (noise - clean) at `timestep` [B] (sigma * 1000) from the transformer's
        clean-chunk prediction."""
        clean = predict_clean(
            self.transformer, latents, timestep, embeds, history, self.parameterization
        )
        sigma = (timestep.float() / 1000.0).clamp(min=MIN_SIGMA)
        return (latents - clean) / sigma.view(-1, 1, 1, 1, 1).to(clean.dtype)


def _per_frame(x: torch.Tensor, fn) -> torch.Tensor:
    """Apply an image map `fn` to every frame of [B, C, F, H, W]."""
    b, _, f = x.shape[:3]
    y = fn(x.permute(0, 2, 1, 3, 4).reshape(b * f, *x.shape[1:2], *x.shape[3:]))
    return y.view(b, f, *y.shape[1:]).permute(0, 2, 1, 3, 4)


def with_coords(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, F, h, w] -> [B, C + 4, F, h, w]: the latents with the torus coordinates of each
    latent pixel appended (sin and cos of x, then of y, over one turn of the frame).

    Helios places tokens by rotary embeddings, which tell attention only how far apart two
    tokens are. A chunk that continues history is placed by that history; the first chunk of
    a video has none, and without absolute coordinates every token would look alike, so the
    model could not draw the shape where the world puts it (the centre) and would average
    over places instead."""
    b, _, f, h, w = latents.shape
    ax = (torch.arange(w, device=latents.device, dtype=torch.float32) + 0.5) * (2 * torch.pi / w)
    ay = (torch.arange(h, device=latents.device, dtype=torch.float32) + 0.5) * (2 * torch.pi / h)
    grid = torch.stack(
        [
            ax.sin().expand(h, w),
            ax.cos().expand(h, w),
            ay.sin()[:, None].expand(h, w),
            ay.cos()[:, None].expand(h, w),
        ]
    )
    grid = grid.to(latents.dtype).view(1, COORD_CHANNELS, 1, h, w).expand(b, -1, f, -1, -1)
    return torch.cat([latents, grid], dim=1)


def predict_clean(
    transformer: HeliosTransformer3DModel,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    embeds: torch.Tensor,
    history: dict[str, torch.Tensor],
    param: Parameterization = Parameterization(),
) -> torch.Tensor:
    """The clean-chunk prediction [B, C, F, h, w] for noisy `latents` at `timestep` [B]
    (sigma * 1000), the history windows (`history_inputs`) and prompt embeddings: the
    transformer's output turned into the clean chunk by `param`. Coordinates are appended to
    the chunk and to every history window (serving and training both call this)."""
    inputs = {
        k: with_coords(v) if k.startswith("latents_history") else v for k, v in history.items()
    }
    out = transformer(
        hidden_states=with_coords(latents),
        timestep=timestep,
        encoder_hidden_states=embeds,
        return_dict=False,
        **inputs,
    )[0]
    return param.clean(out, latents, timestep.float() / 1000.0)


def encode_prompts(
    tokenizer, text_encoder: T5EncoderModel, prompts: list[str], device=None
) -> torch.Tensor:
    """Prompt embeddings [B, 16, D] with padding positions zeroed (serving, and training with
    its own or the EMA's text encoder)."""
    toks = tokenizer(
        prompts,
        padding="max_length",
        max_length=MAX_PROMPT_TOKENS,
        truncation=True,
        return_tensors="pt",
    )
    device = device or text_encoder.device
    mask = toks.attention_mask.to(device)
    emb = text_encoder(toks.input_ids.to(device), attention_mask=mask)[0]
    return emb * mask.unsqueeze(-1).to(emb.dtype)


def history_indices(batch: int) -> dict[str, torch.Tensor]:
    """Frame positions of the prefix, the history windows and the chunk, laid out as
    diffusers' Helios does with keep_first_frame."""
    sizes = [1, *HISTORY_SIZES, FRAMES_PER_CHUNK]
    prefix, long, mid, one, chunk = torch.arange(sum(sizes)).split(sizes)
    short = torch.cat([prefix, one])
    out = {
        "indices_hidden_states": chunk,
        "indices_latents_history_short": short,
        "indices_latents_history_mid": mid,
        "indices_latents_history_long": long,
    }
    return {k: v.unsqueeze(0).expand(batch, -1) for k, v in out.items()}


def history_inputs(history: torch.Tensor, prefix: torch.Tensor) -> dict[str, torch.Tensor]:
    """The transformer's history arguments from the last sum(HISTORY_SIZES) latent frames
    [B, C, 19, h, w] and the video's first frame [B, C, 1, h, w]."""
    h_long, h_mid, h_1x = history.split(list(HISTORY_SIZES), dim=2)
    return {
        "latents_history_long": h_long,
        "latents_history_mid": h_mid,
        "latents_history_short": torch.cat([prefix, h_1x], dim=2),
        **history_indices(history.shape[0]),
    }


def build_stream_pipeline(
    vae: AutoencoderTiny | None = None,
    param: Parameterization = Parameterization(),
    guidance_scale: float = 1.0,
) -> ShapesStreamPipeline:
    """A fresh (untrained) shapes-stream pipeline: in pixel space, or in the latent space of
    a trained autoencoder `vae` (kept frozen); its transformer's output means `param`, and
    it serves with `guidance_scale` by default."""
    tokenizer = build_tokenizer()
    text_encoder = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=TEXT_DIM,
            d_kv=TEXT_DIM // 2,
            d_ff=2 * TEXT_DIM,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    transformer = HeliosTransformer3DModel(
        **(TRANSFORMER_CONFIG if vae is None else LATENT_TRANSFORMER_CONFIG)
    )
    scheduler = HeliosScheduler(
        stages=1, stage_range=[0, 1], scheduler_type="euler", use_dynamic_shifting=False, shift=1.0
    )
    return ShapesStreamPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        prediction=param.kind,
        sigma_data=param.sigma_data,
        guidance_scale=guidance_scale,
    )


def build_tiny_shapes_stream() -> ShapesStreamPipeline:
    """The `tiny-shapes-stream` row: the architecture with the torch seed's weights."""
    return build_stream_pipeline()
