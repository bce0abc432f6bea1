// genserve::int8_gemv: aten::_weight_int8pack_mm for one bfloat16 row on an AVX-512 CPU, with
// the same arithmetic in the same order (bit-identical outputs), and a software prefetch of the
// weight rows a few blocks ahead. Built at run time by genserve/srt/layers/int8_gemv.py.
//
// The aten kernel reads four weight rows at a time, prefetching one cache line ahead within
// each: at batch 1 every row is read once per step, from memory, in runs of a few hundred
// bytes, too short for the hardware prefetcher to follow. Asking for the rows of the blocks
// ahead keeps the loads in flight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

constexpr int kBlockN = 4;  // weight rows per block, as in aten's kernel
constexpr int kAheadBlocks = 4;  // blocks prefetched ahead

inline float bf16_to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Output rows [n0, n0 + rows) of y = (a * (w * scale)).sum(-1): per row, sixteen float32 lanes
// accumulate a[k] * (w[n, k] * scale[n]) with a fused multiply-add for k = lane (mod 16) in
// increasing k, then `_mm512_reduce_add_ps` sums the lanes and the sum is rounded to bfloat16
// (aten's `tinygemm_kernel`, AVX-512 branch).
template <int ROWS>
inline void block(const float* a, const int8_t* w, const c10::BFloat16* scale,
                  c10::BFloat16* y, int64_t n0, int64_t n_end, int64_t k_dim) {
  __m512 acc[ROWS];
  __m512 sc[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_setzero_ps();
    sc[r] = _mm512_set1_ps(bf16_to_float(scale[n0 + r]));
  }
  const int8_t* rows = w + n0 * k_dim;
  const int64_t ahead = n0 + kAheadBlocks * kBlockN;
  const int8_t* next = w + ahead * k_dim;
  const int64_t next_bytes = ahead < n_end ? std::min<int64_t>(ROWS, n_end - ahead) * k_dim : 0;
  for (int64_t k = 0; k < k_dim; k += 16) {
    // One cache line of the block ahead per 64 columns of each of this block's rows, into
    // L2 (_MM_HINT_T1; prefetching into L1, T0, ran slower).
    if ((k & 63) == 0) {
      for (int r = 0; r < ROWS; ++r) {
        const int64_t off = r * k_dim + k;
        if (off < next_bytes) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
      }
    }
    const __m512 va = _mm512_loadu_ps(a + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m128i b8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + r * k_dim + k));
      __m512 vb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b8));
      vb = _mm512_mul_ps(vb, sc[r]);
      acc[r] = _mm512_fmadd_ps(va, vb, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    y[n0 + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r]));
  }
}

at::Tensor int8_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(a.dim() == 2 && a.size(0) == 1 && a.scalar_type() == at::kBFloat16,
              "int8_gemv: a must be [1, K] bfloat16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) == a.size(1),
              "int8_gemv: w must be [N, K] int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) &&
                  scale.scalar_type() == at::kBFloat16,
              "int8_gemv: scale must be [N] bfloat16");
  TORCH_CHECK(a.size(1) % 16 == 0, "int8_gemv: K must be a multiple of 16");
  TORCH_CHECK(a.is_contiguous() && w.is_contiguous() && scale.is_contiguous(),
              "int8_gemv: inputs must be contiguous");
  const int64_t n_dim = w.size(0), k_dim = w.size(1);
  at::Tensor y = at::empty({1, n_dim}, a.options());
  std::vector<float> af(k_dim);  // the row widened to float32 once (exact)
  const auto* a_ptr = a.const_data_ptr<c10::BFloat16>();
  for (int64_t k = 0; k < k_dim; ++k) af[k] = bf16_to_float(a_ptr[k]);
  const auto* w_ptr = w.const_data_ptr<int8_t>();
  const auto* s_ptr = scale.const_data_ptr<c10::BFloat16>();
  auto* y_ptr = y.data_ptr<c10::BFloat16>();
  const int64_t blocks = (n_dim + kBlockN - 1) / kBlockN;
  at::parallel_for(0, blocks, 0, [&](int64_t begin, int64_t end) {
    const int64_t n_end = std::min(end * kBlockN, n_dim);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlockN;
      switch (std::min<int64_t>(kBlockN, n_dim - n0)) {
        case 4: block<4>(af.data(), w_ptr, s_ptr, y_ptr, n0, n_end, k_dim); break;
        case 3: block<3>(af.data(), w_ptr, s_ptr, y_ptr, n0, n_end, k_dim); break;
        case 2: block<2>(af.data(), w_ptr, s_ptr, y_ptr, n0, n_end, k_dim); break;
        default: block<1>(af.data(), w_ptr, s_ptr, y_ptr, n0, n_end, k_dim); break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(genserve_cpu, m) {
  m.def("int8_gemv(Tensor a, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve_cpu, CPU, m) { m.impl("int8_gemv", &int8_gemv); }
