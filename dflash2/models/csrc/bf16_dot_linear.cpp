// dflash2::bf16_dot_linear — y = x · Wᵀ (+ bias) for bfloat16 weights on x86 CPUs with native
// bfloat16 dot products (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids and
// later). Built and loaded by dflash2/models/cpu_kernels.py.
//
// Decoding multiplies a few rows (1 token, a verify block of up to 16, a small batch) by every weight
// matrix, so the work is reading the weights once, at the memory's speed. `vdpbf16ps`
// (_mm512_dpbf16_ps) multiplies 16 pairs of bfloat16 values by 16 other pairs and adds each pair's two
// products to one float32 lane. The weights are packed once, at load, into blocks of 32 output
// features: block b holds, for each pair of inputs p = 0 … ⌈K/2⌉ − 1, 64 values —
// [h][i][j] = W[32b + 16h + i][2p + j] (h, j < 2; i < 16) — so one 64-byte load holds the pairs of
// 16 outputs and the block is one sequential stream of ⌈K/2⌉ · 128 bytes. Each row's pair
// (x[m][2p], x[m][2p + 1]) is broadcast to all 16 lanes from one 32-bit load. A register tile of up to
// 8 rows × 32 outputs is 16 accumulators; larger row counts run several tiles over a block that is
// then in L2. Every output is one float32 sum over p = 0, 1, … in that order (each step adds the
// products of inputs 2p and 2p + 1), whatever the number of rows or the row's place among them, so a
// row's result does not depend on the batch. Threads split the blocks of output features.
#include <immintrin.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace dflash2_kernels;

constexpr int64_t kBlock = 32;       // output features per packed block (two vectors of 16)
constexpr int64_t kPairValues = 64;  // bfloat16 values per input pair in a block (32 outputs × 2 inputs)
constexpr int64_t kRowTile = 8;      // rows per register tile (16 accumulators)
// No software prefetch: each thread reads its blocks as one sequential stream, which the hardware
// prefetchers follow; prefetching 4–32 pairs ahead was 4–12 % slower over SmolLM2's 121 linears.

// Rows [0, MB) of x (pairs of bfloat16 as 32-bit words, `pairs` per row) times one packed block
// (+ bias) → y (row stride ldy); `columns` ≤ 32 of the block's outputs are stored.
template <int MB, typename Out>
inline void tile_rows(const uint32_t* x, int64_t pairs, const uint16_t* block, const float* bias, Out* y,
                      int64_t ldy, int64_t columns) {
  __m512 low[MB], high[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    low[m] = _mm512_setzero_ps();
    high[m] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = block + p * kPairValues;
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32));
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(x[m * pairs + p])));
      low[m] = _mm512_dpbf16_ps(low[m], b, w0);
      high[m] = _mm512_dpbf16_ps(high[m], b, w1);
    }
  }
  const __mmask16 mask0 = static_cast<__mmask16>(columns >= 16 ? 0xFFFF : (1u << columns) - 1);
  const __mmask16 mask1 = static_cast<__mmask16>(columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : (1u << (columns - 16)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (bias) {
    bias0 = _mm512_maskz_loadu_ps(mask0, bias);
    bias1 = _mm512_maskz_loadu_ps(mask1, bias + 16);
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    const __m512 v0 = _mm512_add_ps(low[m], bias0), v1 = _mm512_add_ps(high[m], bias1);
    Out* out = y + m * ldy;
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(out, mask0, v0);
      _mm512_mask_storeu_ps(out + 16, mask1, v1);
    } else {  // rounded once to bfloat16, to nearest even
      _mm256_mask_storeu_epi16(out, mask0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v0)));
      _mm256_mask_storeu_epi16(out + 16, mask1, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v1)));
    }
  }
}

// Rows [0, M) of x times blocks [b0, b1) → y [M, N].
template <typename Out>
void run_blocks(const uint32_t* x, const uint16_t* packed, const float* bias, int64_t M, int64_t N, int64_t pairs,
                Out* y, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* block = packed + b * pairs * kPairValues;
    const int64_t n0 = b * kBlock, columns = std::min<int64_t>(kBlock, N - n0);
    const float* block_bias = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + kRowTile <= M; m += kRowTile)
      tile_rows<kRowTile>(x + m * pairs, pairs, block, block_bias, y + m * N + n0, N, columns);
    const uint32_t* xr = x + m * pairs;
    Out* yr = y + m * N + n0;
    switch (M - m) {
      case 7: tile_rows<7>(xr, pairs, block, block_bias, yr, N, columns); break;
      case 6: tile_rows<6>(xr, pairs, block, block_bias, yr, N, columns); break;
      case 5: tile_rows<5>(xr, pairs, block, block_bias, yr, N, columns); break;
      case 4: tile_rows<4>(xr, pairs, block, block_bias, yr, N, columns); break;
      case 3: tile_rows<3>(xr, pairs, block, block_bias, yr, N, columns); break;
      case 2: tile_rows<2>(xr, pairs, block, block_bias, yr, N, columns); break;
      case 1: tile_rows<1>(xr, pairs, block, block_bias, yr, N, columns); break;
      default: break;
    }
  }
}

at::Tensor bf16_dot_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t in_features, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % kPairValues == 0 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "bf16_dot_linear: packed must be a contiguous bfloat16 [N/32, 64·⌈K/2⌉] tensor");
  const int64_t N = out_features, K = in_features, pairs = packed.size(1) / kPairValues;
  TORCH_CHECK(K > 0 && (K + 1) / 2 == pairs, "bf16_dot_linear: in_features does not match packed");
  check_blocks("bf16_dot_linear", N, kBlock, packed.size(0));
  const LinearCall call = start_linear("bf16_dot_linear", x, packed, bias, K, N);
  const int64_t M = call.rows;
  if (M == 0) return call.y;

  // x as bfloat16 pairs: used in place when it is bfloat16, contiguous and K is even; otherwise a
  // copy (float32 rounded to bfloat16, an odd K padded with a zero).
  const at::Tensor xc = x.contiguous();
  std::vector<uint16_t> copy;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(bf16_rows(xc, M, K, 2 * pairs, copy));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = call.bias_data();
  with_output<uint16_t>(call.y, [&](auto* yp) {
    parallel_blocks(packed.size(0), [&](int64_t b0, int64_t b1) { run_blocks(xp, wp, bp, M, N, pairs, yp, b0, b1); });
  });
  return call.y;
}

}  // namespace

DFLASH2_CPU_OP(bf16_dot_linear, "(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features) -> Tensor")
