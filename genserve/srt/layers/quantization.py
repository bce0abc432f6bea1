"""Weight-only quantization of a loaded model's linear layers with torchao.

Modes: `none` (the serving dtype), `int8wo` (int8 weights, one scale per output row) and `int4wo`
(4-bit weights in groups along the input dimension, a scale and a zero per group). Activations
stay in the model's dtype between layers; each quantized matmul runs in bfloat16 (float16 for
float16 models on CUDA), the activation dtype torch's packed-weight kernels are fast in, and its
output goes back to the model's dtype.

torchao does the quantization math (`Int8Tensor.from_hp`, the int4 configs). The matmuls are
torch's packed-weight kernels: `aten._weight_int8pack_mm` for int8 (on an AVX-512 CPU, matmuls
of a few rows run `int8_gemv.py`'s bit-identical copy of it that prefetches), and for int4 the
torchao tensor whose linear calls `aten._weight_int4pack_mm_for_cpu` (CPU,
`PrototypeInt4WeightOnlyConfig`) or tinygemm's `aten._weight_int4pack_mm` (CUDA, the
tile-packed format).

`auto` runs a quantized GGUF (Q4 / Q5 / Q6 / Q8) or a pre-quantized checkpoint (FP8,
compressed-tensors, GPTQ, AWQ: dequantized on load) as int8wo and leaves full-precision checkpoints
as they are (their outputs then match Hugging Face's token for token). It decides from the
checkpoint's precision class alone, so every start of the same model runs the same mode. A 4-bit
GGUF does not run as int4wo under `auto`: re-quantizing its de-quantized weights to int4wo kept
97% teacher-forced top-1 agreement on SmolLM2 but changed its greedy answer to "What is the
capital of France?" (tests/srt/test_quantization.py), where int8wo keeps it; int4wo stays
available on request. The exception is a checkpoint whose 4-bit groups int4wo holds as stored
(`EXACT_INT4`: GPTQ without act-order, AWQ, compressed-tensors int4 in groups of a multiple
of 32): on a CPU its layers are repacked, not requantized (`prequantized/int4_repack.py`), so
int4wo serves the checkpoint's own weights and `auto` picks it (tests/srt/test_gptq_repack.py
holds it to the agreement bar, against int8wo; tests/srt/test_int4_repack_formats.py checks
AWQ and compressed-tensors).

`fp8` keeps an FP8 checkpoint's float8 weights with per-tensor or per-channel scales as stored
(`prequantized/fp8_keep.py`; `_scaled_mm` with per-token float8 activations,
`fp8_linear.py`); the layers it has no float8 weights for stay in the serving dtype. `auto`
picks it for such a checkpoint on CUDA; on a CPU torch's `_scaled_mm` is far slower than
int8wo's kernel, so `auto` keeps int8wo there. Block-wise FP8 is refused under `fp8` (its
scales vary along the input, row-wise scales cannot hold them) and dequantized under `auto`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.layers import int8_gemv
from genserve.srt.layers.fp8_linear import fp8_linear, pad_to_16, scaled_mm_refusal
from genserve.srt.layers.prequantized.base import EXACT_INT4, FP8_CLASS
from genserve.srt.server_args import QUANTIZATIONS

logger = logging.getLogger(__name__)

# int4 group sizes tried from the smallest (most exact; a Q4 GGUF's own groups are 32 wide).
_INT4_GROUP_SIZES = (32, 64, 128)
_INT8_ROWS_PER_CHUNK = 2048


@dataclass(frozen=True)
class QuantizationChoice:
    """The mode a model runs in and why (the reason goes to the start-up log)."""

    mode: str  # none | int8wo | int4wo | fp8
    reason: str


def _act_dtype(weight: torch.Tensor) -> torch.dtype:
    if weight.device.type == "cuda" and weight.dtype == torch.float16:
        return torch.float16
    return torch.bfloat16


def int4_group_size(in_features: int) -> int | None:
    """The int4 group size for a layer `in_features` wide, or None when none divides it."""
    for g in _INT4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    return None


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weight is stored quantized (int8 per row, int4 per group, or a
    checkpoint's float8 with a scale per row: `fp8_stored`); the bias, if any, stays in the
    model's dtype."""

    def __init__(self, linear: nn.Linear, mode: str, *, quantize: bool = True) -> None:
        """quantize=False: only the layer's shape, bias and activation dtype (`int4_packed`
        fills in its weight)."""
        super().__init__()
        from torchao.quantization import quantize_

        weight = linear.weight.detach()
        self.mode = mode
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.act_dtype = _act_dtype(weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)
        # A fused layer's shard layout (LoRA reads it, whichever form the layer is in).
        self.shard_offsets = dict(getattr(linear, "shard_offsets", None) or {})
        self.gemv = False  # see the int8wo branch
        if not quantize:
            return
        if mode == "int8wo":
            from torchao.quantization import PerRow
            from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

            # Rows quantize independently (one scale each): a few at a time bound the float32
            # copy (a large vocabulary's lm_head would otherwise double the loading peak).
            chunks = [Int8Tensor.from_hp(rows.float(), granularity=PerRow())
                      for rows in weight.split(_INT8_ROWS_PER_CHUNK)]
            qdata = torch.cat([q.qdata for q in chunks])
            scale = torch.cat([q.scale.reshape(-1) for q in chunks])
            self.register_buffer("qweight", qdata.contiguous())  # [out, in] int8
            self.register_buffer("scale", scale.to(self.act_dtype))  # [out]
            # Matmuls of a few rows (decode steps, verifies) run the prefetching kernel on a CPU.
            self.gemv = self.act_dtype == torch.bfloat16 and int8_gemv.usable(self.qweight)
            return
        if mode != "int4wo":
            raise ValueError(f"WeightOnlyLinear mode must be int8wo or int4wo, got {mode!r}")
        group = int4_group_size(self.in_features)
        if group is None:
            raise ValueError(
                f"int4wo needs layer widths divisible by {_INT4_GROUP_SIZES[0]}; this layer "
                f"has in_features={self.in_features}"
            )
        inner = nn.Linear(
            self.in_features,
            self.out_features,
            bias=False,
            device=weight.device,
            dtype=torch.bfloat16,
        )
        with torch.no_grad():
            inner.weight.copy_(weight)
        quantize_(inner, _int4_config(weight.device, group))
        self.qweight = inner.weight  # a torchao tensor subclass: F.linear runs the int4 kernel

    @classmethod
    def int4_packed(cls, linear: nn.Linear, qdata: torch.Tensor, scale_and_zero: torch.Tensor,
                    group: int) -> WeightOnlyLinear:
        """An int4wo layer (CPU) from weights already in the kernel's layout, its own weight
        never read: qdata [out, in / 2] from `aten._convert_weight_to_int4pack_for_cpu`,
        scale_and_zero [in / group, out, 2], each weight (q - 8) * scale + zero; the kernel
        takes them in the activation dtype, to which they are rounded here."""
        from torchao.prototype.quantization.int4 import Int4OpaqueTensor

        layer = cls(linear, "int4wo", quantize=False)
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int4 weights in the CPU layout on {linear.weight.device.type}")
        shape = torch.Size([layer.out_features, layer.in_features])
        scale_and_zero = scale_and_zero.to(layer.act_dtype).contiguous()
        weight = Int4OpaqueTensor(qdata, scale_and_zero, [1, group], shape)
        layer.qweight = nn.Parameter(weight, requires_grad=False)
        return layer

    @classmethod
    def fp8_stored(cls, linear: nn.Linear, weight: torch.Tensor,
                   scale: torch.Tensor) -> WeightOnlyLinear:
        """An fp8 layer from a checkpoint's float8_e4m3fn weight [out, in] and its float32
        scale per output row [out], kept as stored (`layers/fp8_linear.py`); the linear's own
        weight is never read."""
        layer = cls(linear, "fp8", quantize=False)
        device = linear.weight.device
        qweight, qscale = pad_to_16(weight.to(device), scale.to(device))
        layer.register_buffer("qweight", qweight)  # [out, in] float8, padded to 16
        layer.register_buffer("scale", qscale)  # [1, out] float32, padded to 16
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fp8":
            y = fp8_linear(x, self.qweight, self.scale, self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.mode == "int8wo":
            flat = x.reshape(-1, self.in_features)
            rows = flat.shape[0]  # a plain int, or a symbol in a graph compiled dynamic
            if (
                self.gemv
                and isinstance(rows, int)
                and rows <= int8_gemv.MAX_ROWS
                and flat.is_cpu
                and x.dtype in (torch.float32, torch.bfloat16)
            ):
                # Eager, float32 rows go in as they are: the op rounds them to bfloat16 and
                # returns float32 values of its bfloat16 results (the two casts without their
                # ops). A compiled graph keeps the casts, which Inductor fuses into its kernels.
                if torch.compiler.is_compiling():
                    flat = flat.to(self.act_dtype)
                y = int8_gemv.int8_gemv(flat, self.qweight, self.scale)
            else:
                flat = flat.to(self.act_dtype)
                y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x.to(self.act_dtype), self.qweight)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}"


def _int4_config(device: torch.device, group: int):
    if device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
    from torchao.quantization import Int4WeightOnlyConfig

    return Int4WeightOnlyConfig(
        group_size=group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
    )


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every plain linear layer (attention and MLP projections, lm_head); MoE expert stacks
    are not nn.Linear and stay in the serving dtype."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def unsupported_reason(mode: str, model: nn.Module, device: torch.device) -> str | None:
    """Why this model/device cannot run `mode` (naming what works), None when it can."""
    if mode == "none":
        return None
    if mode == "fp8":
        why = scaled_mm_refusal(device)
        return None if why is None else f"--quantization fp8: {why}; use --quantization int8wo"
    works = "--quantization none" + (" or int8wo" if mode == "int4wo" else "")
    if device.type not in ("cpu", "cuda"):
        return f"--quantization {mode} runs on cpu and cuda, not {device.type}"
    op = (
        "_weight_int8pack_mm"
        if mode == "int8wo"
        else ("_weight_int4pack_mm_for_cpu" if device.type == "cpu" else "_weight_int4pack_mm")
    )
    if not hasattr(torch.ops.aten, op):
        return (f"--quantization {mode} needs torch's aten.{op} kernel, which this torch build "
                f"lacks; use {works}")
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        return f"--quantization {mode} needs torchao (pip install --no-deps torchao): {e}"
    if mode == "int4wo":
        bad = [
            (n, m.in_features)
            for n, m in quantizable_linears(model)
            if int4_group_size(m.in_features) is None
        ]
        if bad:
            return (f"--quantization int4wo needs every linear layer's input width divisible "
                    f"by {_INT4_GROUP_SIZES[0]}; {bad[0][0]} has {bad[0][1]}. Use {works}")
    return None


def check_supported(mode: str, model: nn.Module, device: torch.device) -> None:
    """Raise ValueError naming the mode and what works when this model/device cannot run it."""
    reason = unsupported_reason(mode, model, device)
    if reason is not None:
        raise ValueError(reason)


def quantize_linear(model: nn.Module, name: str, mode: str) -> int:
    """Replace the linear layer `name` by its weight-only quantized form (in place); returns
    the number of weights quantized (0 when `name` is not a plain linear layer any more)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, attr)
    if not isinstance(linear, nn.Linear) or mode == "fp8":
        # fp8 keeps the checkpoint's float8 layers (the loader installs them); the rest stays
        # in the serving dtype.
        return 0
    # The output projection keeps 8 bits under int4wo (as GGUF files store it in Q6/Q8):
    # in 4 bits it moved SmolLM2's greedy tokens far more than all the other layers did.
    layer_mode = "int8wo" if mode == "int4wo" and name == "lm_head" else mode
    setattr(parent, attr, WeightOnlyLinear(linear, layer_mode))
    return linear.weight.numel()


def quantize_model(model: nn.Module, mode: str) -> int:
    """Replace the model's linear layers by weight-only quantized ones (in place). A lm_head
    tied to the input embedding gets its own quantized copy (int8 under int4wo too); the
    embedding keeps its dtype (a lookup reads one row per token). Layers already quantized
    (by the loader, layer by layer) are left as they are. Returns the number of weights
    quantized."""
    if mode in ("none", "fp8"):
        return 0
    return sum(quantize_linear(model, name, mode) for name, _ in quantizable_linears(model))


# Prequantized classes `auto` serves as stored on one device type, not re-rounded to int8wo:
# (mode, device type, why not on another device, why chosen). On CUDA the stored float8 weights
# run as they are (`_scaled_mm`), while a CPU keeps int8wo, its fast weight-only kernel, as for
# any 8-bit checkpoint. Exact 4-bit groups (integers, scales and zeros) are repacked into int4wo
# on a CPU, where int8wo would round them onto a new grid.
_KEPT_AS_STORED = {
    FP8_CLASS: ("fp8", "cuda", "fp8 is chosen on cuda only",
                "fp8 checkpoint on cuda: its float8 weights kept, torch._scaled_mm"),
    EXACT_INT4: ("int4wo", "cpu", "the repack into int4wo is for cpu",
                 "4-bit checkpoint: its groups repacked as stored into int4 weights"),
}


def choose_quantization(
    requested: str, source_class: str | None, model: nn.Module, device: torch.device
) -> QuantizationChoice:
    """Resolve `auto` (and check an explicit mode) for this model on this device.

    `source_class`: "int8" / "int4" for a GGUF or a pre-quantized checkpoint stored in that
    precision class, `EXACT_INT4` for 4-bit groups that int4wo holds as stored (GPTQ, AWQ,
    compressed-tensors int4: on a CPU the loader repacks them, `int4_repack`), `FP8_CLASS`
    for float8 weights with per-tensor or per-channel scales (kept as stored under fp8), None
    for a full-precision checkpoint."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {requested!r}")
    if requested == "fp8" and source_class != FP8_CLASS:
        what = ("a full-precision checkpoint" if source_class is None
                else f"a checkpoint of precision class {source_class}")
        raise ValueError(
            f"--quantization fp8 keeps a checkpoint's float8 weights with per-tensor or "
            f"per-channel scales (quant_method fp8 without weight_block_size, compressed-tensors "
            f"float-quantized tensor / channel); this is {what} (block-wise fp8 is dequantized "
            f"once: use --quantization auto, int8wo or none)"
        )
    if requested != "auto":
        check_supported(requested, model, device)
        return QuantizationChoice(requested, "requested")
    if source_class is None:
        return QuantizationChoice("none", "full-precision checkpoint: kept as is")
    why = f"quantized ({source_class}) checkpoint: int8 weights"
    kept = _KEPT_AS_STORED.get(source_class)
    if kept is not None:
        mode, device_type, off_device, chosen = kept
        why_not = (off_device if device.type != device_type
                   else unsupported_reason(mode, model, device))
        if why_not is None:
            return QuantizationChoice(mode, chosen)
        why += f" (not {mode}: {why_not})"
    check_supported("int8wo", model, device)
    return QuantizationChoice("int8wo", why)
