// dflash2::bf16_linear — y = x · Wᵀ (+ bias) for bfloat16 weights on x86 CPUs with AVX2 and FMA but
// without native bfloat16 arithmetic (no AVX512-BF16, no AMX), where oneDNN and ATen fall back to
// slow generic code for bfloat16 matrices. Built and loaded by dflash2/models/cpu_kernels.py.
//
// Decoding multiplies a few rows (1 token, or a verify block of up to 16) by every weight matrix:
// the work is reading the weights, and from about 5 rows on, the multiply-adds. The weights are
// packed once, at load, into blocks of 24 output features. Block b holds K × 16 "pairs" followed by
// K × 8 "singles": pairs[k][2i] = W[24b + i][k], pairs[k][2i + 1] = W[24b + 8 + i][k] and
// singles[k][i] = W[24b + 16 + i][k] (i < 8). One 32-byte load then holds 16 weights of one k;
// shifting each 32-bit lane left by 16 gives the first eight as float32 and masking off its low half
// the next eight (a bfloat16 is the top half of a float32); a 16-byte load, widened and shifted,
// gives the last eight. Each row's x[m][k] is broadcast and multiplied into three accumulators of 8
// outputs: a register tile of up to 4 rows × 24 outputs is 12 accumulators, enough independent
// multiply-adds to hide their latency (16 outputs, 8 accumulators, ran about 10 % slower at 7–8 rows
// on Zen 2). Every output is one float32 sum in the order k = 0, 1, … K − 1, whatever the number of
// rows or the row's place among them, so a row's result does not depend on the batch. Threads split
// the blocks of output features.
#include <immintrin.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace dflash2_kernels;

constexpr int64_t kBlock = 24;       // output features per packed block (16 as pairs, 8 single)
constexpr int64_t kRowTile = 4;      // rows per register tile
constexpr int64_t kRowChunk = 32;    // rows per pass over the weights (their float32 copy stays in L2)
constexpr int64_t kPrefetch = 64;    // k steps ahead (2 KiB of pairs, 1 KiB of singles) for the software prefetch

inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 high_half(__m256i v, __m256i mask) { return _mm256_castsi256_ps(_mm256_and_si256(v, mask)); }

// One row's ≤ 24 outputs, plus the bias (float32), rounded once to the output type.
inline void store_block(float* y, const float* tile, const float* bias, int64_t columns) {
  for (int64_t j = 0; j < columns; ++j) y[j] = bias ? tile[j] + bias[j] : tile[j];
}

inline void store_block(at::BFloat16* y, const float* tile, const float* bias, int64_t columns) {
  for (int64_t j = 0; j < columns; ++j) y[j] = at::BFloat16(bias ? tile[j] + bias[j] : tile[j]);  // round to nearest even
}

// Rows [0, MB) of x (float32, row stride K) times one packed block (+ bias) → y (row stride ldy),
// `columns` ≤ 24.
template <int MB, typename Out>
inline void tile_rows(const float* x, const uint16_t* block, int64_t K, const float* bias, Out* y, int64_t ldy,
                      int64_t columns) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* pairs = block;
  const uint16_t* singles = block + 16 * K;
  __m256 first[MB], second[MB], third[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    first[m] = _mm256_setzero_ps();
    second[m] = _mm256_setzero_ps();
    third[m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(pairs + (k + kPrefetch) * 16), _MM_HINT_T0);
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(singles + (k + kPrefetch) * 8), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + k * 16));
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(singles + k * 8)));
    const __m256 w0 = low_half(v), w1 = high_half(v, mask);
    const __m256 w2 = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * K + k);
      first[m] = _mm256_fmadd_ps(b, w0, first[m]);
      second[m] = _mm256_fmadd_ps(b, w1, second[m]);
      third[m] = _mm256_fmadd_ps(b, w2, third[m]);
    }
  }
  alignas(32) float out[MB][kBlock];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    _mm256_store_ps(out[m], first[m]);
    _mm256_store_ps(out[m] + 8, second[m]);
    _mm256_store_ps(out[m] + 16, third[m]);
  }
  for (int m = 0; m < MB; ++m) store_block(y + m * ldy, out[m], bias, columns);
}

// Rows [0, M) of x times blocks [b0, b1) → y [M, N].
template <typename Out>
void run_blocks(const float* x, const uint16_t* packed, const float* bias, int64_t M, int64_t N, int64_t K, Out* y,
                int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* block = packed + b * K * kBlock;
    const int64_t n0 = b * kBlock, columns = std::min<int64_t>(kBlock, N - n0);
    const float* block_bias = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + kRowTile <= M; m += kRowTile)
      tile_rows<kRowTile>(x + m * K, block, K, block_bias, y + m * N + n0, N, columns);
    switch (M - m) {
      case 3: tile_rows<3>(x + m * K, block, K, block_bias, y + m * N + n0, N, columns); break;
      case 2: tile_rows<2>(x + m * K, block, K, block_bias, y + m * N + n0, N, columns); break;
      case 1: tile_rows<1>(x + m * K, block, K, block_bias, y + m * N + n0, N, columns); break;
      default: break;
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % kBlock == 0 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "bf16_linear: packed must be a contiguous bfloat16 [N/24, 24·K] tensor");
  const int64_t N = out_features, K = packed.size(1) / kBlock;
  check_blocks("bf16_linear", N, kBlock, packed.size(0));
  const LinearCall call = start_linear("bf16_linear", x, packed, bias, K, N);
  const int64_t M = call.rows;
  const std::vector<float> xf = to_float(x);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = call.bias_data();
  with_output(call.y, [&](auto* yp) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, M - m0);
      parallel_blocks(packed.size(0), [&](int64_t b0, int64_t b1) {
        run_blocks(xf.data() + m0 * K, wp, bp, rows, N, K, yp + m0 * N, b0, b1);
      });
    }
  });
  return call.y;
}

}  // namespace

DFLASH2_CPU_OP(bf16_linear, "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
