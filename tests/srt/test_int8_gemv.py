"""The batch-1 int8 kernel (`genserve/srt/layers/int8_gemv.py`) against aten's: bit-identical."""

from __future__ import annotations

import pytest
import torch

from genserve.srt.layers import int8_gemv
from genserve.srt.layers.quantization import WeightOnlyLinear
from tests import needs

if not int8_gemv.cpu_has_avx512():
    pytest.skip("the kernel is for AVX-512 CPUs", allow_module_level=True)
if not int8_gemv.available():  # CI installs ninja (requirements) and has a C++ compiler
    needs.missing("a C++ compiler and ninja to build int8_gemv", module_level=True)


# SmolLM2's projections and lm_head widths, and row counts that leave a partial block of 4.
@pytest.mark.parametrize(
    "out_features,in_features", [(960, 576), (576, 1536), (49152, 576), (7, 32), (1, 16), (130, 64)]
)
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_int8_gemv_is_bit_identical_to_aten(out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features)
    w = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scale = (torch.rand(out_features, generator=g) / 50).to(torch.bfloat16)
    a = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    expected = torch.ops.aten._weight_int8pack_mm(a, w, scale)
    assert torch.equal(int8_gemv.int8_gemv(a, w, scale), expected)


@pytest.mark.parametrize("rows", [1, 5])
def test_float32_rows_give_the_bfloat16_result_widened(rows):
    """Float32 rows are rounded to bfloat16 inside the op and the result comes back as float32
    values of aten's bfloat16 result, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randint(-128, 128, (130, 64), dtype=torch.int8, generator=g)
    scale = (torch.rand(130, generator=g) / 50).to(torch.bfloat16)
    a = torch.randn(rows, 64, generator=g)
    expected = torch.ops.aten._weight_int8pack_mm(a.to(torch.bfloat16), w, scale).float()
    got = int8_gemv.int8_gemv(a, w, scale)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_a_decode_row_of_a_quantized_layer_matches_its_row_in_a_prefill():
    """A decode step (a few rows, the gemv) and a prefill (many rows, aten's kernel) give a
    token's row the same bits."""
    torch.manual_seed(0)
    layer = WeightOnlyLinear(torch.nn.Linear(64, 200, bias=False), "int8wo")
    assert layer.gemv
    x = torch.randn(int8_gemv.MAX_ROWS + 4, 64)
    prefill = layer(x)
    for i in range(3):
        assert torch.equal(layer(x[i : i + 1]), prefill[i : i + 1])
    assert torch.equal(layer(x[:5]), prefill[:5])
