// genserve_cpu::int8_gemv: aten::_weight_int8pack_mm for a few bfloat16 rows on an AVX-512
// CPU, with the same arithmetic in the same order (bit-identical outputs), and a software
// prefetch of the weight rows a few blocks ahead. Built at run time by int8_gemv.py.
//
// The aten kernel reads four weight rows at a time, prefetching one cache line ahead within
// each; with a few activation rows every weight is used a few times per read from memory, and
// the kernel waits on those reads. Asking for the rows of the blocks ahead keeps them in flight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int kBlockN = 4;  // weight rows per block, as in aten's kernel
constexpr int kAheadBlocks = 4;  // blocks prefetched ahead

// Output columns [n0, n0 + COLS) of rows [m0, m0 + ROWS) of y = a @ (w * scale).T: per output,
// sixteen float32 lanes accumulate a[m, k] * (w[n, k] * scale[n]) with a fused multiply-add for
// k = lane (mod 16) in increasing k, then `_mm512_reduce_add_ps` sums the lanes and the sum is
// rounded to bfloat16 (aten's `tinygemm_kernel`, AVX-512 branch). `prefetch_end`: the weights
// of blocks ahead up to this row are prefetched (0: none, for a block's second row chunk).
template <int ROWS, int COLS, typename Out>
inline void block(const float* a, const int8_t* w, const c10::BFloat16* scale, Out* y, int64_t m0, int64_t n0, int64_t n_dim, int64_t k_dim,
                  int64_t prefetch_end) {
  __m512 acc[ROWS][COLS];
  __m512 sc[COLS];
  for (int c = 0; c < COLS; ++c) {
    sc[c] = _mm512_set1_ps(static_cast<float>(scale[n0 + c]));
    for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_setzero_ps();
  }
  const int8_t* cols = w + n0 * k_dim;
  const int64_t ahead = n0 + kAheadBlocks * kBlockN;
  const int8_t* next = w + ahead * k_dim;
  const int64_t next_bytes =
      ahead < prefetch_end ? std::min<int64_t>(COLS, prefetch_end - ahead) * k_dim : 0;
  for (int64_t k = 0; k < k_dim; k += 16) {
    // One cache line of the block ahead per 64 columns of each of this block's rows, into
    // L2 (_MM_HINT_T1; prefetching into L1, T0, ran slower).
    if ((k & 63) == 0) {
      for (int c = 0; c < COLS; ++c) {
        const int64_t off = c * k_dim + k;
        if (off < next_bytes) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
      }
    }
    __m512 va[ROWS];
    for (int r = 0; r < ROWS; ++r) va[r] = _mm512_load_ps(a + (m0 + r) * k_dim + k);
    for (int c = 0; c < COLS; ++c) {
      const __m128i b8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cols + c * k_dim + k));
      __m512 vb = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b8));
      vb = _mm512_mul_ps(vb, sc[c]);
      for (int r = 0; r < ROWS; ++r) acc[r][c] = _mm512_fmadd_ps(va[r], vb, acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < COLS; ++c) {
      // Rounded to bfloat16 as aten rounds; a float32 output holds that bfloat16 exactly.
      y[(m0 + r) * n_dim + n0 + c] =
          static_cast<Out>(static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r][c])));
    }
  }
}

template <int ROWS, typename Out>
inline void row_block(const float* a, const int8_t* w, const c10::BFloat16* scale, Out* y, int64_t m0, int64_t n0, int64_t n_dim, int64_t k_dim,
                      int64_t prefetch_end) {
  switch (std::min<int64_t>(kBlockN, n_dim - n0)) {
    case 4: block<ROWS, 4, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, prefetch_end); break;
    case 3: block<ROWS, 3, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, prefetch_end); break;
    case 2: block<ROWS, 2, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, prefetch_end); break;
    default: block<ROWS, 1, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, prefetch_end); break;
  }
}

// Five to eight rows of `a` in one pass over a block of four weight rows, two weight rows at a
// time: each weight is widened and scaled once for every row (two passes of four-row chunks
// widened it twice), and ROWS x 2 accumulators, ROWS rows of `a` and two weights fit in the 32
// vector registers. Every output's arithmetic is the same as in any other blocking.
template <int ROWS, typename Out>
inline void wide_block(const float* a, const int8_t* w, const c10::BFloat16* scale, Out* y, int64_t n0, int64_t n_dim, int64_t k_dim,
                       int64_t prefetch_end) {
  for (int64_t n = n0; n < std::min(n0 + kBlockN, n_dim); n += 2) {
    if (n_dim - n >= 2) {
      block<ROWS, 2, Out>(a, w, scale, y, 0, n, n_dim, k_dim, prefetch_end);
    } else {
      block<ROWS, 1, Out>(a, w, scale, y, 0, n, n_dim, k_dim, prefetch_end);
    }
  }
}

// Weight blocks [begin, end) (four rows each) against every row of `a`. Every size is passed
// by value: one thread calls it directly, since the loop ran slower as a lambda capturing them
// by reference inside at::parallel_for.
template <typename Out>
void weight_blocks(const float* a, const int8_t* w, const c10::BFloat16* scale, Out* y,
                   int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t begin, int64_t end) {
  const int64_t n_end = std::min(end * kBlockN, n_dim);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t n0 = b * kBlockN;
    if (m_dim > 4 && m_dim <= 8) {
      switch (m_dim) {
        case 5: wide_block<5, Out>(a, w, scale, y, n0, n_dim, k_dim, n_end); break;
        case 6: wide_block<6, Out>(a, w, scale, y, n0, n_dim, k_dim, n_end); break;
        case 7: wide_block<7, Out>(a, w, scale, y, n0, n_dim, k_dim, n_end); break;
        default: wide_block<8, Out>(a, w, scale, y, n0, n_dim, k_dim, n_end); break;
      }
      continue;
    }
    for (int64_t m0 = 0; m0 < m_dim; m0 += 4) {
      const int64_t pf = m0 == 0 ? n_end : 0;
      switch (std::min<int64_t>(4, m_dim - m0)) {
        case 4: row_block<4, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, pf); break;
        case 3: row_block<3, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, pf); break;
        case 2: row_block<2, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, pf); break;
        default: row_block<1, Out>(a, w, scale, y, m0, n0, n_dim, k_dim, pf); break;
      }
    }
  }
}

template <typename Out>
void run(const float* af, const at::Tensor& w, const at::Tensor& scale, Out* y, int64_t m_dim) {
  const int64_t n_dim = w.size(0), k_dim = w.size(1);
  const auto* w_ptr = w.const_data_ptr<int8_t>();
  const auto* s_ptr = scale.const_data_ptr<c10::BFloat16>();
  const int64_t blocks = (n_dim + kBlockN - 1) / kBlockN;
  if (at::get_num_threads() == 1 || at::in_parallel_region()) {
    weight_blocks<Out>(af, w_ptr, s_ptr, y, m_dim, n_dim, k_dim, 0, blocks);
  } else {
    at::parallel_for(0, blocks, 0, [=](int64_t begin, int64_t end) {
      weight_blocks<Out>(af, w_ptr, s_ptr, y, m_dim, n_dim, k_dim, begin, end);
    });
  }
}

// a [M, K] bfloat16 or float32 (M a few rows: a decode batch or a speculative verify), w [N, K]
// int8, scale [N] bfloat16 -> [M, N] in a's dtype. Each block of four weight rows is read from
// memory once and applied to every row of `a`. A float32 `a` is rounded to bfloat16 first and
// the bfloat16 result widened back, so int8_gemv(a) == aten(a.to(bf16), w, scale).float()
// without the two casts as ops of their own (an eager forward dispatches them per matmul).
at::Tensor int8_gemv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& scale) {
  const bool f32 = a.scalar_type() == at::kFloat;
  TORCH_CHECK(a.dim() == 2 && (f32 || a.scalar_type() == at::kBFloat16),
              "int8_gemv: a must be [M, K] bfloat16 or float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) == a.size(1),
              "int8_gemv: w must be [N, K] int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) &&
                  scale.scalar_type() == at::kBFloat16,
              "int8_gemv: scale must be [N] bfloat16");
  TORCH_CHECK(a.size(1) % 16 == 0, "int8_gemv: K must be a multiple of 16");
  TORCH_CHECK(a.is_contiguous() && w.is_contiguous() && scale.is_contiguous(),
              "int8_gemv: inputs must be contiguous");
  const int64_t m_dim = a.size(0), n_dim = w.size(0), k_dim = w.size(1);
  at::Tensor y = at::empty({m_dim, n_dim}, a.options());
  // The rows as float32 values of bfloat16s (exact), 64-byte aligned by torch's allocator:
  // with K a multiple of 16 every 16-float load is one aligned cache line.
  // (A loop here: a.to(kFloat) through the dispatcher cost more than the conversion.)
  at::Tensor af = at::empty({m_dim, k_dim}, a.options().dtype(at::kFloat));
  float* af_ptr = af.data_ptr<float>();
  if (f32) {
    const auto* a_ptr = a.const_data_ptr<float>();
    for (int64_t i = 0; i < m_dim * k_dim; ++i) {
      af_ptr[i] = static_cast<float>(static_cast<c10::BFloat16>(a_ptr[i]));
    }
    run<float>(af_ptr, w, scale, y.data_ptr<float>(), m_dim);
  } else {
    const auto* a_ptr = a.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < m_dim * k_dim; ++i) af_ptr[i] = static_cast<float>(a_ptr[i]);
    run<c10::BFloat16>(af_ptr, w, scale, y.data_ptr<c10::BFloat16>(), m_dim);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(genserve_cpu, m) {
  m.def("int8_gemv(Tensor a, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve_cpu, CPU, m) { m.impl("int8_gemv", &int8_gemv); }
