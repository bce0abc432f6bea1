"""`--quantization fp8`: an FP8 checkpoint's float8 weights kept as stored, multiplied by
`torch._scaled_mm` with activations quantized per token (the CPU build runs the same op).

- the fp8 linear against the same math in float32 torch ops (`fp8_linear_ref`);
- tiny fp8 per-tensor and compressed-tensors fp8 channel checkpoints: the decoder layers keep
  float8 weights, and their greedy tokens track the dequantize-once path (teacher-forced);
- refusals: a full-precision or block-wise checkpoint under fp8; `auto` picks fp8 on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from genserve import Engine
from genserve.srt.layers.fp8_linear import (
    FP8,
    fp8_linear,
    fp8_linear_ref,
    pad_to_16,
)
from genserve.srt.layers.prequantized.base import FP8_CLASS
from genserve.srt.layers.quantization import WeightOnlyLinear, choose_quantization
from tests.srt import prequant_checkpoints as pc
from tests.srt.test_engine import prompt
from tests.srt.test_prequantized import CASES, _load
from tests.srt.test_quantization import (
    agreement_and_drift,
    greedy_continuations,
    teacher_forced,
    teacher_forced_metas,
)

PROMPTS = [prompt(i, 24) for i in range(4)]
# Reference top-1 margins (nats) under which fp8 activations may flip the greedy token.
NEAR_TIE = 0.5


def _scores_and_margins(engine: Engine, seqs: list[list[int]]):
    """`teacher_forced` scores of `seqs` and, per scored position, the margin of the top-1 token
    over the second (log p1 - log p2)."""
    metas = teacher_forced_metas(engine, PROMPTS, seqs, top=2)
    scores = [
        (
            [t[0][1] for t in m["input_top_logprobs"][1:]],
            [lp for lp, _ in m["input_token_logprobs"][1:]],
        )
        for m in metas
    ]
    margins = [[t[0][0] - t[1][0] for t in m["input_top_logprobs"][1:]] for m in metas]
    return scores, margins


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from tests.srt.conftest import make_tiny_model_dir

    made: dict[str, object] = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_tiny_model_dir(tmp_path_factory.mktemp(f"fp8-{arch}"), arch)
        return made[arch]

    return get


# (tokens, in, out): aligned, padded on both widths (27 rows, 40 columns), 3-D input, no tokens.
@pytest.mark.parametrize("shape", [(5, 64, 48), (3, 40, 27), ((2, 3), 32, 16), (0, 32, 16)])
def test_fp8_linear_matches_the_same_math_in_float32(shape):
    tokens, inn, out = shape
    lead = tokens if isinstance(tokens, tuple) else (tokens,)
    torch.manual_seed(0)
    w = torch.randn(out, inn)
    scale = w.abs().amax(dim=1) / pc.FP8_MAX
    q = (w / scale[:, None]).to(FP8)
    x = torch.randn(*lead, inn) * 3
    x[..., 0] = 0  # a zero column: the scales come from the others
    qweight, qscale = pad_to_16(q, scale)
    assert qweight.shape[0] % 16 == 0 and qweight.shape[1] % 16 == 0
    assert qscale.shape == (1, qweight.shape[0]) and qscale.dtype == torch.float32
    got = fp8_linear(x, qweight, qscale, out)
    want = fp8_linear_ref(x, q, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, out) == want.shape
    if got.numel():
        # Only the output's rounding to bfloat16 (half a step: 2**-9 relative) and the order of
        # the float32 sums differ.
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-5 * want.abs().max())
        # And the activation quantization is close to the unquantized product (e4m3 keeps 3
        # mantissa bits: each activation within 2**-4 relative).
        exact = x @ (q.float() * scale[:, None]).t()
        assert ((got.float() - exact).norm() / exact.norm()).item() < 0.05


def test_a_zero_token_row_stays_zero():
    q = torch.ones(16, 16).to(FP8)
    qweight, qscale = pad_to_16(q, torch.ones(16))
    y = fp8_linear(torch.zeros(2, 16), qweight, qscale, 16)
    assert torch.equal(y, torch.zeros(2, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("case", ["fp8-tensor", "ct-fp8"])
def test_fp8_checkpoint_keeps_float8_weights_and_tracks_dequantized(case, plain, tmp_path):
    """Every decoder linear layer holds the checkpoint's float8 integers and per-row scales as
    stored (checked against the file's values); greedy tokens track the dequantize-once path
    (`--quantization none`), teacher-forced on its greedy continuations. Per-token e4m3
    activations keep 3 mantissa bits (each rounded by up to 2**-4 relative, where int8wo's
    bfloat16 activations keep 8), so exact equality cannot hold and the tiny random models'
    many near-ties (half their top-1 margins are under 0.4 nats) flip more often than under
    int8wo's 90% bar. The bar: >= 80% agreement, every flipped position a near-tie of the
    reference (margin < NEAR_TIE), mean |d log p| < 0.25. A wrong scale or shard layout flips
    confident positions and drops agreement towards chance (1 / 256)."""
    arch, quantize, qconfig, _ = CASES[case]
    quantized, _ = pc.write_pair(plain(arch), tmp_path, qconfig, quantize, dense=False)
    ref = Engine(str(quantized), dtype="float32", max_total_tokens=2048, quantization="none")
    fp8 = Engine(str(quantized), dtype="float32", max_total_tokens=2048, quantization="fp8")
    try:
        assert fp8.model_info()["quantization"] == "fp8"
        model = fp8.runtime.runner.model
        kept = {
            n: m
            for n, m in model.named_modules()
            if isinstance(m, WeightOnlyLinear) and m.mode == "fp8"
        }
        decoder = [
            n
            for n, m in model.named_modules()
            if ".layers." in f".{n}" and isinstance(m, torch.nn.Linear | WeightOnlyLinear)
        ]
        assert decoder and sorted(kept) == sorted(decoder)
        assert {m.qweight.dtype for m in kept.values()} == {torch.float8_e4m3fn}
        # The float8 values are the file's (no requantization): dequantized they are the
        # reference model's weights, exactly.
        ref_model = ref.runtime.runner.model
        for name, m in kept.items():
            w = (
                m.qweight[: m.out_features, : m.in_features].float()
                * m.scale[0, : m.out_features, None]
            )
            torch.testing.assert_close(
                w, ref_model.get_submodule(name).weight.float(), rtol=0, atol=0
            )
        seqs = greedy_continuations(ref, PROMPTS, 16)
        want, margins = _scores_and_margins(ref, seqs)
        got = teacher_forced(fp8, PROMPTS, seqs)
        agreement, drift = agreement_and_drift(want, got)
        print(f"{case} fp8: top-1 agreement {agreement:.3f}, mean |d log p| {drift:.4f}")
        assert agreement >= 0.8, agreement
        assert drift < 0.25, drift
        flipped = [
            m
            for (a, _), (b, _), ms in zip(want, got, margins, strict=True)
            for x, y, m in zip(a, b, ms, strict=True)
            if x != y
        ]
        assert all(m < NEAR_TIE for m in flipped), flipped
        fp8.check_integrity()
    finally:
        ref.shutdown()
        fp8.shutdown()


def test_fp8_on_a_full_precision_checkpoint_is_refused(plain):
    with pytest.raises(ValueError, match="--quantization fp8 keeps a checkpoint's float8"):
        Engine(str(plain("llama")), dtype="float32", max_total_tokens=512, quantization="fp8")


def test_fp8_on_a_block_wise_checkpoint_is_refused(plain, tmp_path):
    from genserve.srt.layers.prequantized import precision_class

    arch, quantize, qconfig, _ = CASES["fp8-block"]
    quantized, _ = pc.write_pair(plain(arch), tmp_path, qconfig, quantize, dense=False)
    assert precision_class(quantized) == "int8"  # block-wise: dequantized once, as before
    with pytest.raises(ValueError, match="block-wise fp8 is dequantized once"):
        Engine(str(quantized), dtype="float32", max_total_tokens=512, quantization="fp8")


def test_auto_picks_fp8_on_cuda_only(plain, tmp_path):
    from genserve.srt.layers.prequantized import precision_class

    arch, quantize, qconfig, _ = CASES["fp8-tensor"]
    quantized, _ = pc.write_pair(plain(arch), tmp_path, qconfig, quantize, dense=False)
    assert precision_class(quantized) == FP8_CLASS
    model = _load(plain(arch), load_format="dummy")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_quantization("auto", FP8_CLASS, model, cuda).mode == "fp8"
    assert choose_quantization("auto", FP8_CLASS, model, cpu).mode == "int8wo"
    assert choose_quantization("fp8", FP8_CLASS, model, cpu).mode == "fp8"
    # Block-wise fp8 and other 8-bit checkpoints stay int8wo on CUDA too.
    assert choose_quantization("auto", "int8", model, cuda).mode == "int8wo"
    with pytest.raises(ValueError, match="precision class int8"):
        choose_quantization("fp8", "int8", model, cuda)


def test_fp8_is_refused_under_tensor_parallelism():
    from genserve.srt.server_args import EngineArgs

    with pytest.raises(ValueError, match="fp8 is not supported with --tp > 1"):
        EngineArgs(tp_size=2, quantization="fp8")
