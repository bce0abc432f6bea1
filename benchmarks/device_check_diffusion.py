"""Steps of benchmarks/device_check.py on the diffusion path: a FLUX.1-shaped transformer through
genserve's pipeline vs plain diffusers, a Helios-shaped streaming video model's frames per second,
and the memory plan of an 8B LLM beside a FLUX-sized DiT. Weights are random, built on the device
at the real shapes; the text encoders and (for FLUX) the VAE are small stand-ins with the right
output widths, since they do not run per step. A dry run takes toy shapes on the CPU."""

from __future__ import annotations

import time

from device_check_llm import (
    Context,
    default_dtype,
    error_line,
    gib,
    llama_8b_parameters,
    row,
    write_llm_config,
)

# FLUX.1 [dev]'s transformer config (diffusers FluxTransformer2DModel) and a toy of the same kind.
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_TOY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
# FLUX.1's scheduler config (flow matching with a resolution-dependent shift).
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                      max_shift=1.15, shift=3.0, use_dynamic_shifting=True)
# Helios: diffusers' HeliosTransformer3DModel defaults are the 14B checkpoints' shape; Wan 2.1's
# VAE defaults likewise. The toys are tiny-helios's.
HELIOS_TOY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32,
                  num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  rope_dim=(4, 4, 4), has_multi_term_memory_patch=True,
                  guidance_cross_attn=True, zero_history_timestep=True)
WAN_VAE_TOY = dict(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                   temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                   latents_std=[1.0] * 4)
PROMPT = "a red cat on a blue sea"
CARD_80GB = 85_029_158_912  # about what torch reports for an H100 80GB (79.2 GiB)


def diffusers_model(cls, config: dict, ctx: Context):
    """`cls(**config)` with random weights, made on the device in bf16 (no float32 copy of a
    12B model first), then left as `from_pretrained(torch_dtype=...)` leaves a checkpoint: the
    class's `_keep_in_fp32_modules` in float32, buffers as they were built."""
    import torch

    with default_dtype(torch.bfloat16), ctx.device:
        model = cls(**config)
    if ctx.dtype != torch.bfloat16:
        model = model.to(ctx.dtype)
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    for name, param in model.named_parameters():
        if any(part in name for part in keep):
            param.data = param.data.float()
    return model.eval()


def flux_transformer(ctx: Context):
    from diffusers import FluxTransformer2DModel

    return diffusers_model(FluxTransformer2DModel, FLUX_TOY if ctx.dry_run else FLUX_DEV, ctx)


def flux_pipeline(ctx: Context):
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from genserve.multimodal_gen.embedded import (
        _tiny_clip_encoder,
        _tiny_image_vae,
        _tiny_t5_encoder,
        text_tokenizer,
    )

    shape = FLUX_TOY if ctx.dry_run else FLUX_DEV
    torch.manual_seed(0)
    vae = _tiny_image_vae(latent_channels=shape["in_channels"] // 4, use_quant_conv=False,
                          use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611)
    parts = dict(vae=vae, text_encoder=_tiny_clip_encoder(shape["pooled_projection_dim"]),
                 text_encoder_2=_tiny_t5_encoder(shape["joint_attention_dim"]))
    parts = {k: v.to(device=ctx.device, dtype=ctx.dtype) for k, v in parts.items()}
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
                        tokenizer=text_tokenizer(), tokenizer_2=text_tokenizer(bos=False),
                        transformer=flux_transformer(ctx), **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def resolved_request(model: str, size: tuple[int, int], frames: int, steps: int,
                     guidance: float, seed: int = 0):
    from genserve.multimodal_gen.messages import ResolvedRequest, StepCacheConfig

    width, height = size
    return ResolvedRequest(
        rid=f"device-check-{seed}", model=model, prompt=PROMPT, negative_prompt=None,
        width=width, height=height, num_frames=frames, fps=None, num_inference_steps=steps,
        guidance_scale=guidance, seeds=(seed,), step_cache=StepCacheConfig(), preview=False,
        preview_decode_every=0, init_image=None, strength=None, submitted_at=time.time(),
        progress=False)


def step_flux(ctx: Context) -> list[dict]:
    """One image through plain diffusers `FluxPipeline.__call__`, then the same pipeline wrapped
    by genserve's `FluxFamily` (batch-invariant layers, kept RoPE tables...) and its
    `generate`: per-step time of each, best of two calls after a warm-up."""
    import torch

    from genserve.multimodal_gen.pipelines.flux import FluxFamily

    ctx.require_device()
    size, steps = (64, 2) if ctx.dry_run else (1024, 4)
    pipe = flux_pipeline(ctx)

    def plain(n_steps: int):
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        with torch.inference_mode():
            return pipe(prompt=PROMPT, height=size, width=size, num_inference_steps=n_steps,
                        guidance_scale=3.5, generator=gen).images[0]

    plain(1)
    plain_s = min(ctx.seconds(lambda: plain(steps)) for _ in range(2))
    shape = "toy FLUX" if ctx.dry_run else "FLUX.1-dev-shaped bf16"
    rows = [row(f"{shape}, {size}x{size}, {steps} steps: plain diffusers FluxPipeline",
                f"{1e3 * plain_s / steps:.0f} ms/step", f"{plain_s:.2f} s a call")]
    label = f"{shape}, {size}x{size}, {steps} steps: genserve FluxFamily.generate"
    try:
        model = FluxFamily("flux-shaped", pipe, "random weights")  # wraps the same modules
        req = resolved_request("flux-shaped", (size, size), 1, steps, 3.5)
        model.generate([resolved_request("flux-shaped", (size, size), 1, 1, 3.5)])
        ours_s = min(ctx.seconds(lambda: model.generate([req])) for _ in range(2))
    except Exception as exc:  # the plain figure above still stands
        return [*rows, row(label, "FAILED", error_line(exc))]
    rows.append(row(label, f"{1e3 * ours_s / steps:.0f} ms/step",
                    f"{ours_s:.2f} s a call; {plain_s / ours_s:.2f}x plain diffusers' speed"))
    return rows


def helios_pipeline(ctx: Context):
    import torch
    from diffusers import (
        AutoencoderKLWan,
        HeliosPipeline,
        HeliosScheduler,
        HeliosTransformer3DModel,
    )

    from genserve.multimodal_gen.embedded import _tiny_t5_encoder, text_tokenizer

    torch.manual_seed(0)
    transformer = diffusers_model(HeliosTransformer3DModel, HELIOS_TOY if ctx.dry_run else {}, ctx)
    vae = AutoencoderKLWan(**(WAN_VAE_TOY if ctx.dry_run else {}))
    text_encoder = _tiny_t5_encoder(transformer.config.text_dim, umt5=True)
    pipe = HeliosPipeline(
        tokenizer=text_tokenizer(bos=False),
        text_encoder=text_encoder.to(device=ctx.device, dtype=ctx.dtype),
        vae=vae.to(device=ctx.device, dtype=ctx.dtype), transformer=transformer,
        scheduler=HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def step_video(ctx: Context) -> list[dict]:
    """One continuous stream through genserve's `HeliosFamily` (the realtime path's chunk loop):
    a warm-up chunk, then timed chunks; final frames per second, denoise and decode split."""
    from genserve.multimodal_gen.pipelines.helios import HeliosFamily

    ctx.require_device()
    size, steps, chunks = ((64, 64), 2, 1) if ctx.dry_run else ((640, 384), 3, 2)
    model = HeliosFamily("helios-shaped", helios_pipeline(ctx), "random weights")
    req = resolved_request("helios-shaped", size, model.chunk_frames, steps, 1.0)
    stream = model.new_stream(0, *size)
    model.generate([req], streams=[stream])  # warm-up chunk
    frames, denoise_ms, decode_ms = 0, 0.0, 0.0
    ctx.sync()
    start = time.perf_counter()
    for _ in range(chunks):
        out = model.generate([req], streams=[stream])
        frames += len(out.frames[0])
        denoise_ms += out.timings["denoise"]
        decode_ms += out.timings["decode"]
    seconds = time.perf_counter() - start
    shape = "toy Helios" if ctx.dry_run else "Helios-shaped (14B) bf16"
    return [row(f"{shape} stream, {size[0]}x{size[1]}, {steps} steps a chunk, no CFG",
                f"{frames / seconds:.2f} frames/s",
                f"{chunks} timed chunk(s) of {model.chunk_frames} frames: "
                f"{denoise_ms / chunks / steps:.0f} ms a step, "
                f"{decode_ms / chunks:.0f} ms VAE decode a chunk")]


def flux_component_parameters() -> dict[str, int]:
    """Parameter counts of a real FLUX.1 pipeline's parts (built on the meta device): the
    transformer, T5-XXL's encoder, CLIP-L's text model and the VAE."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        parts = {
            "transformer": FluxTransformer2DModel(**FLUX_DEV),
            "t5_xxl": T5EncoderModel(T5Config(
                vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                num_heads=64, feed_forward_proj="gated-gelu")),
            "clip_l": CLIPTextModel(CLIPTextConfig(
                vocab_size=49408, hidden_size=768, intermediate_size=3072,
                num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77)),
            "vae": AutoencoderKL(
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                latent_channels=16, use_quant_conv=False, use_post_quant_conv=False),
        }
    return {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}


def dit_peak_bytes(ctx: Context, transformer, size: int) -> int:
    """Transient memory of one transformer forward at `size` x `size`, batch 1, 512 text
    tokens (0 on a CPU, where it is not measured)."""
    import torch

    cfg = transformer.config
    tokens, text = (size // 16) ** 2, 512
    dev, dt = ctx.device, ctx.dtype
    inputs = dict(
        hidden_states=torch.randn(1, tokens, cfg.in_channels, device=dev, dtype=dt),
        encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, device=dev,
                                          dtype=dt),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, device=dev, dtype=dt),
        timestep=torch.full((1,), 0.5, device=dev, dtype=dt),
        guidance=torch.full((1,), 3.5, device=dev, dtype=dt),
        img_ids=torch.zeros(tokens, 3, device=dev, dtype=dt),
        txt_ids=torch.zeros(text, 3, device=dev, dtype=dt), return_dict=False)
    if ctx.dry_run:
        with torch.inference_mode():
            transformer(**inputs)
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        transformer(**inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def step_memory_plan(ctx: Context) -> list[dict]:
    """The server's memory plan (genserve/memory_plan.py) for an 8B LLM beside a FLUX-sized DiT,
    fed what this card measures: the DiT's weights and its peak at 1024x1024 (the FLUX
    encoders' and VAE's weights, counted at their real shapes, held with the peak as one
    reserved block), and the 8B runner's weights and KV bytes per token (loaded with a small
    pool). The pool the plan gives is then allocated beside them, as `genserve serve` would,
    and the same plan is made for an 80 GB card from these bytes."""
    import torch

    from genserve import Engine
    from genserve.device_memory import device_memory
    from genserve.memory_plan import (
        DeviceMemory,
        DiffusionDemand,
        LLMDemand,
        MemoryPlanError,
        plan_memory,
    )

    ctx.require_device()
    counts = {"llama3_8b": llama_8b_parameters(ctx), **flux_component_parameters()}
    rows = [row("parameters at the real shapes (meta device)",
                ", ".join(f"{k} {v / 1e9:.2f} B" for k, v in counts.items()), "")]
    transformer = flux_transformer(ctx)
    dit_bytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
    size = 64 if ctx.dry_run else 1024
    peak = dit_peak_bytes(ctx, transformer, size)
    others = 2 * sum(counts[k] for k in ("t5_xxl", "clip_l", "vae"))  # bf16
    reserved = others + peak if not ctx.dry_run else 0
    block = torch.empty(reserved, dtype=torch.uint8, device=ctx.device)
    rows.append(row(f"DiT weights; its peak at {size}x{size}; T5-XXL + CLIP-L + VAE",
                    f"{gib(dit_bytes)}; {gib(peak) if not ctx.dry_run else 'not measured'}; "
                    f"{gib(others)}",
                    "peak and encoders held resident" if not ctx.dry_run else
                    "dry run: nothing reserved (CPU)"))
    small_pool = 4096
    try:
        engine = Engine(str(write_llm_config(ctx)), load_format="dummy",
                        dtype=str(ctx.dtype).removeprefix("torch."), device=ctx.device.type,
                        max_total_tokens=small_pool)
    except (ValueError, torch.cuda.OutOfMemoryError) as exc:
        rows.append(row("8B LLM beside them", "does not load", error_line(exc)))
        del block, transformer
        return rows
    runner = engine.runtime.runner
    llm = LLMDemand("llama3-8b", sum(p.numel() * p.element_size()
                                     for p in runner.model.parameters()),
                    runner.kv_bytes_per_token(), runner.context_length,
                    runner.activation_bytes())
    dit = DiffusionDemand("flux-dev-shaped", dit_bytes + others, peak,
                          "not measured" if ctx.dry_run else "measured", others,
                          f"{size}x{size}, batch 1")
    numbers = device_memory(runner.device)
    here = DeviceMemory(numbers["device"], numbers["total_bytes"], numbers["free_bytes"])
    for label, device in (("this device", here), ("an 80 GB card (computed)",
                                                  DeviceMemory("cuda:0", CARD_80GB))):
        try:
            plan = plan_memory(device, [llm], [dit])
        except MemoryPlanError as exc:
            rows.append(row(f"memory plan, {label}, no memory flag", "does not fit", str(exc)))
            continue
        tokens = plan.pools[llm.name]
        note = (f"{gib(device.total_bytes)} x {plan.fraction} - weights "
                f"{gib(plan.weights_bytes)} - DiT peak {gib(plan.diffusion_peak_bytes)} - "
                f"LLM activations {gib(plan.activation_bytes)}; headroom "
                f"{gib(plan.headroom_bytes)}")
        if device is here and not ctx.dry_run:
            # The planned pool beside everything else: the part the small pool does not hold.
            try:
                extra = torch.empty((tokens - small_pool) * llm.kv_bytes_per_token,
                                    dtype=torch.uint8, device=ctx.device)
                del extra
                note += "; allocated beside them"
            except torch.cuda.OutOfMemoryError as exc:
                note += f"; allocating it failed: {error_line(exc)}"
        rows.append(row(f"memory plan, {label}, no memory flag: KV pool",
                        f"{tokens} tokens ({gib(plan.pool_bytes(llm.name))})",
                        ("dry run, toy LLM and DiT: " if ctx.dry_run else "") + note))
    engine.shutdown()
    del block, transformer
    return rows
