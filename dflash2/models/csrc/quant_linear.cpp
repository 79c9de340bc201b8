// dflash2::quant_linear — y = x · Wᵀ (+ bias) for weight-only quantized W on x86 CPUs with AVX2, FMA
// and F16C. Built and loaded by dflash2/models/cpu_kernels.py; the format is dflash2/models/quant.py's.
//
// W is held group-wise: output feature n, inputs k of group g = k / G have
//     w[n][k] = s[n][g] · q[n][k] + o[n][g]        (o = 0 when the format has no offsets)
// with q a 4-bit unsigned code (0 … 15, G = 32) or an 8-bit signed one (−128 … 127, G = 16 or 32) and
// s, o float16 or float32. This holds GGUF's Q4_0, Q4_1, Q8_0, the K-quants' sub-blocks and
// round-to-nearest int4/int8 exactly (dflash2/models/gguf_quants.py). Activations are not quantized:
//     y[m][n] = Σ_g s[n][g] · (Σ_{k∈g} q[n][k] · x[m][k]) + Σ_g o[n][g] · (Σ_{k∈g} x[m][k])
// in float32, the codes converted to float32 exactly.
//
// Layout (packed once, at load): blocks of 8 output features, group after group, so a block is one
// sequential stream. In a group, one 32-byte vector holds a step of inputs for the 8 features, one
// 32-bit lane per feature: 4-bit codes, 4 vectors per group of 32, vector t lane n = the 8 codes of
// feature n for inputs 8t … 8t + 7 (input 8t + i in bits 4i … 4i + 3); 8-bit codes, G/4 vectors, vector
// t lane n = the codes of feature n for inputs 4t … 4t + 3 (input 4t + i in byte i). Scales and offsets
// [⌈N/8⌉, K/G, 8].
//
// Why this shape (measured on a 2-core AVX2 EPYC, scripts/quant_kernels.py): with AVX2 and float32
// activations a product is bound by the vector instructions per weight, not by the memory. Features
// in the lanes let one shuffle (vpshufb) move a code of each of 8 features into its lane, so a weight
// costs a shuffle, a conversion and a multiply-add (¼ of a mask and a shift for 4-bit codes), and
// each input is one broadcast value multiplied into 8 features; scales apply once per group and the
// offsets through the inputs' group sums. Inputs in the lanes (one feature's 8 codes widened per
// step) ran 1.7× slower: every widening crosses 128-bit lanes and every feature needs its own
// horizontal sum.
//
// Each row has its own accumulators (even and odd input steps of a group, and the running total)
// that take the groups in order g = 0, 1, …, so a row's result does not depend on the other rows,
// their number or its place among them. Threads split the blocks of output features.
#include <immintrin.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace dflash2_kernels;

constexpr int64_t kBlock = 8;        // output features per packed block (one float32 vector)
constexpr int64_t kMaxRowTile = 5;   // rows per register tile (3 accumulators each; the totals may spill)
constexpr int64_t kRowChunk = 32;    // rows per pass over a thread's blocks (their inputs stay in L2)

// Byte i of every 32-bit lane moved to that lane's lowest byte (4-bit codes, already masked to a
// nibble per byte) or its highest byte (8-bit codes, then shifted down with their sign); zeros elsewhere.
inline __m256i pick_low(int i) {
  const char b = static_cast<char>(i), z = static_cast<char>(0x80);
  return _mm256_setr_epi8(b, z, z, z, b + 4, z, z, z, b + 8, z, z, z, b + 12, z, z, z, b, z, z, z, b + 4, z, z, z,
                          b + 8, z, z, z, b + 12, z, z, z);
}
inline __m256i pick_high(int i) {
  const char b = static_cast<char>(i), z = static_cast<char>(0x80);
  return _mm256_setr_epi8(z, z, z, b, z, z, z, b + 4, z, z, z, b + 8, z, z, z, b + 12, z, z, z, b, z, z, z, b + 4, z,
                          z, z, b + 8, z, z, z, b + 12);
}

template <typename S>
inline __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// Input k of row m as 8 equal lanes: from `x` laid out wide (each input stored 8 times, row stride 8K
// floats: a plain load that folds into the multiply-add) or compact (row stride K: a broadcast load).
template <bool Wide>
inline __m256 input(const float* x, int64_t K, int m, int64_t k) {
  if constexpr (Wide) {
    return _mm256_load_ps(x + (m * K + k) * 8);
  } else {
    return _mm256_broadcast_ss(x + m * K + k);
  }
}

// Rows [0, MR) times one packed block: out[m][0..8) = Σ_g s·(Σ q·x) + Σ_g o·sx, with `x` wide or compact
// (see input) and `sx` each row's group sums (row stride K/G).
template <int Bits, int G, int MR, bool Wide, typename S>
inline void block_tile(const float* x, const float* sx, int64_t K, const uint8_t* block, const S* scales,
                       const S* offsets, float* out, int64_t ldo) {
  constexpr int kVectors = Bits == 4 ? G / 8 : G / 4;  // 32-byte code vectors per group
  const int64_t groups = K / G;
  __m256 total[MR];
  _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) total[m] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i* codes = reinterpret_cast<const __m256i*>(block + g * kVectors * 32);
    const int64_t k0 = g * G;
    __m256 even[MR], odd[MR];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) {
      even[m] = _mm256_setzero_ps();
      odd[m] = _mm256_setzero_ps();
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < kVectors; ++t) {
      const __m256i v = _mm256_loadu_si256(codes + t);
      if constexpr (Bits == 4) {
        const __m256i low = _mm256_and_si256(v, nibble);                         // inputs 8t + 2i
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);  // inputs 8t + 2i + 1
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
          const __m256 w0 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(low, pick_low(i)));
          const __m256 w1 = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(high, pick_low(i)));
          const int64_t k = k0 + 8 * t + 2 * i;
          _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) {
            even[m] = _mm256_fmadd_ps(w0, input<Wide>(x, K, m, k), even[m]);
            odd[m] = _mm256_fmadd_ps(w1, input<Wide>(x, K, m, k + 1), odd[m]);
          }
        }
      } else {
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
          const __m256 w = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(v, pick_high(i)), 24));
          const int64_t k = k0 + 4 * t + i;
          _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) {
            if (i % 2 == 0) {
              even[m] = _mm256_fmadd_ps(w, input<Wide>(x, K, m, k), even[m]);
            } else {
              odd[m] = _mm256_fmadd_ps(w, input<Wide>(x, K, m, k), odd[m]);
            }
          }
        }
      }
    }
    const __m256 s = load8(scales + g * kBlock);
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) {
      total[m] = _mm256_fmadd_ps(s, _mm256_add_ps(even[m], odd[m]), total[m]);
    }
  }
  if (offsets) {
    __m256 shift[MR];
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) shift[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 o = load8(offsets + g * kBlock);
      _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) {
        shift[m] = _mm256_fmadd_ps(o, _mm256_set1_ps(sx[m * groups + g]), shift[m]);
      }
    }
    _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) total[m] = _mm256_add_ps(total[m], shift[m]);
  }
  _Pragma("GCC unroll 4") for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + m * ldo, total[m]);
}

template <typename Out>
inline void store(Out* y, const float* tile_out, const float* bias, int64_t columns) {
  for (int64_t j = 0; j < columns; ++j) {
    const float v = bias ? tile_out[j] + bias[j] : tile_out[j];
    if constexpr (std::is_same_v<Out, float>) {
      y[j] = v;
    } else {
      y[j] = at::BFloat16(v);  // rounded once, to nearest even
    }
  }
}

// Rows [0, M) (inputs x, wide or compact; group sums sx) times blocks [b0, b1) → y [M, N].
template <int Bits, int G, bool Wide, typename S, typename Out>
void run_blocks(const float* x, const float* sx, const uint8_t* qweight, const S* scales, const S* offsets,
                const float* bias, int64_t M, int64_t N, int64_t K, Out* y, int64_t b0, int64_t b1) {
  const int64_t groups = K / G;
  const int64_t block_bytes = groups * kBlock * (G * Bits / 8);
  const int64_t block_scales = groups * kBlock;
  alignas(32) float out[kMaxRowTile][kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = qweight + b * block_bytes;
    const S* bs = scales + b * block_scales;
    const S* bo = offsets ? offsets + b * block_scales : nullptr;
    const int64_t n0 = b * kBlock, columns = std::min<int64_t>(kBlock, N - n0);
    const float* block_bias = bias ? bias + n0 : nullptr;
    for (int64_t m = 0; m < M; m += kMaxRowTile) {
      const int64_t rows = std::min(kMaxRowTile, M - m);
      const float* xm = x + m * K * (Wide ? 8 : 1);
      const float* sm = sx + m * groups;
      if (rows == 5) block_tile<Bits, G, 5, Wide, S>(xm, sm, K, block, bs, bo, out[0], kBlock);
      if (rows == 4) block_tile<Bits, G, 4, Wide, S>(xm, sm, K, block, bs, bo, out[0], kBlock);
      if (rows == 3) block_tile<Bits, G, 3, Wide, S>(xm, sm, K, block, bs, bo, out[0], kBlock);
      if (rows == 2) block_tile<Bits, G, 2, Wide, S>(xm, sm, K, block, bs, bo, out[0], kBlock);
      if (rows == 1) block_tile<Bits, G, 1, Wide, S>(xm, sm, K, block, bs, bo, out[0], kBlock);
      for (int64_t r = 0; r < rows; ++r) store(y + (m + r) * N + n0, out[r], block_bias, columns);
    }
  }
}

template <int Bits, int G, typename S>
void dispatch_out(const std::vector<float>& xf, const uint8_t* qw, const S* sp, const S* op, const float* bp,
                  int64_t M, int64_t N, int64_t K, at::Tensor& y) {
  const int64_t num_blocks = (N + kBlock - 1) / kBlock, groups = K / G;
  std::vector<float> sx(static_cast<size_t>(M * groups));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {  // in input order, the same for every row
      float sum = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xf[r * K + k];
      sx[r * groups + g] = sum;
    }
  }
  // One row: its inputs stored 8 times (a plain load per multiply-add, 12 % faster than a broadcast);
  // more rows: a broadcast load each, from inputs compact enough to stay in L1 (stored wide they
  // would stream from L2 at every multiply-add, 1.4× slower at 8 rows). Either gives the same bits.
  std::vector<float> wide;
  const float* xw = nullptr;
  if (M == 1) {
    wide.resize(static_cast<size_t>(K * 8) + 8);
    float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wide.data()) + 31) & ~uintptr_t(31));
    for (int64_t k = 0; k < K; ++k) _mm256_store_ps(aligned + k * 8, _mm256_set1_ps(xf[k]));
    xw = aligned;
  }
  with_output(y, [&](auto* yp) {
    parallel_blocks(num_blocks, [&](int64_t b0, int64_t b1) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int64_t rows = std::min(kRowChunk, M - m0);
        if (xw) {
          run_blocks<Bits, G, true, S>(xw, sx.data(), qw, sp, op, bp, rows, N, K, yp, b0, b1);
        } else {
          run_blocks<Bits, G, false, S>(xf.data() + m0 * K, sx.data() + m0 * groups, qw, sp, op, bp, rows, N, K,
                                        yp + m0 * N, b0, b1);
        }
      }
    });
  });
}

template <typename S>
void dispatch_format(int64_t bits, int64_t G, const std::vector<float>& xf, const uint8_t* qw, const S* sp, const S* op,
                     const float* bp, int64_t M, int64_t N, int64_t K, at::Tensor& y) {
  if (bits == 4 && G == 32) return dispatch_out<4, 32, S>(xf, qw, sp, op, bp, M, N, K, y);
  if (bits == 8 && G == 32) return dispatch_out<8, 32, S>(xf, qw, sp, op, bp, M, N, K, y);
  if (bits == 8 && G == 16) return dispatch_out<8, 16, S>(xf, qw, sp, op, bp, M, N, K, y);
  TORCH_CHECK(false, "quant_linear: no kernel for ", bits, "-bit codes in groups of ", G);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t bits,
                        int64_t group_size, int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 4 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(3) == 32 && qweight.size(2) * 32 == group_size * bits,
              "quant_linear: qweight must be a contiguous uint8 [N/8, K/G, G·bits/32, 32] tensor");
  const int64_t N = out_features, K = qweight.size(1) * group_size;
  check_blocks("quant_linear", N, kBlock, qweight.size(0));
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == qweight.size(0) &&
                  scales.size(1) == qweight.size(1) && scales.size(2) == kBlock &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "quant_linear: scales must be a contiguous float16 or float32 [N/8, K/G, 8] tensor");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(!has_offsets || (offsets->sizes() == scales.sizes() && offsets->is_contiguous() &&
                               offsets->scalar_type() == scales.scalar_type()),
              "quant_linear: offsets must match scales in shape and dtype");
  LinearCall call = start_linear("quant_linear", x, qweight, bias, K, N);
  const int64_t M = call.rows;
  if (M == 0) return call.y;
  const std::vector<float> xf = to_float(x);
  const float* bp = call.bias_data();
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  if (scales.scalar_type() == at::kFloat) {
    dispatch_format<float>(bits, group_size, xf, qw, scales.data_ptr<float>(),
                           has_offsets ? offsets->data_ptr<float>() : nullptr, bp, M, N, K, call.y);
  } else {
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const auto* op = has_offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
    dispatch_format<uint16_t>(bits, group_size, xf, qw, sp, op, bp, M, N, K, call.y);
  }
  return call.y;
}

}  // namespace

DFLASH2_CPU_OP(quant_linear,
               "(Tensor x, Tensor qweight, Tensor scales, Tensor? offsets, Tensor? bias, int bits, int group_size, "
               "int out_features) -> Tensor")
