// dflash2::quant_linear — y = x · Wᵀ (+ bias) for weight-only quantized W on x86 CPUs with AVX2, FMA
// and F16C. Built and loaded by dflash2/models/cpu_kernels.py; the format is dflash2/models/quant.py's.
//
// W is held group-wise: output feature n, inputs k of group g = k / G have
//     w[n][k] = s[n][g] · q[n][k] + o[n][g]        (o = 0 when the format has no offsets)
// with q a 4-bit unsigned code (0 … 15, G = 32) or an 8-bit signed one (−128 … 127, G = 16 or 32) and
// s, o float16 or float32. This holds GGUF's Q4_0, Q4_1, Q8_0, the K-quants' sub-blocks and
// round-to-nearest int4/int8 exactly (dflash2/models/gguf_quants.py). Activations stay float32: every
// weight is dequantized in registers as fma(q, s, o) — the same float32 value the file's own
// dequantization gives — and multiplied into float32 sums. Nothing else is rounded.
//
// Layout (packed once, at load): blocks of 8 output features. qweight [⌈N/8⌉, K/G, 8, G·bits/8]
// bytes; scales and offsets [⌈N/8⌉, K/G, 8]. Within one feature's group of 32 4-bit codes, byte j
// holds code j in its low nibble and code j + 16 in its high one; 8-bit codes are one byte each, in
// order. So the block is one sequential stream: group after group, the 8 features' codes side by side.
//
// The work per call is reading the bytes of W once and, for every row, one multiply-add per weight.
// Inputs run along the vector lanes: 8 consecutive codes of one feature are widened to 8 float32
// weights, which every row of the register tile multiplies with its 8 inputs (the load folds into the
// multiply-add). A tile is up to 4 rows × 8 features (1 row × 8, 2 × 4 or 4 × 2: at most 8
// accumulators); each (row, feature) has one accumulator of 8 lanes that takes the groups in order
// g = 0, 1, … and ends in a fixed horizontal sum, so a row's result does not depend on the other rows,
// their number or its place among them. Threads split the blocks of output features.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 8;      // output features per packed block
constexpr int64_t kRowChunk = 32;  // rows per pass over the weights (their float32 copy stays in L1/L2)

// The fixed-order horizontal sum of 8 lanes: ((0+4) + (2+6)) + ((1+5) + (3+7)).
inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

template <typename S>
inline float scalar(const S* p, int64_t i);
template <>
inline float scalar<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
inline float scalar<uint16_t>(const uint16_t* p, int64_t i) {
  return _cvtsh_ss(p[i]);
}

// The 8 float32 weights of codes [8v, 8v + 8) of one feature's group, dequantized: fma(q, s, o).
template <int Bits, int G>
inline __m256 weights(const uint8_t* codes, int v, __m256 s, __m256 o) {
  __m256i q;
  if constexpr (Bits == 4) {
    // Codes 0–15 in the low nibbles of bytes 0–15, codes 16–31 in the high ones.
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * (v & 1)));
    const __m128i nibbles = v < 2 ? bytes : _mm_srli_epi16(bytes, 4);
    q = _mm256_and_si256(_mm256_cvtepu8_epi32(nibbles), _mm256_set1_epi32(0x0F));
  } else {
    q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * v)));
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, o);
}

// Rows [0, MR) of x (float32, row stride K) times features [f0, f0 + NR) of one packed block → acc.
template <int Bits, int G, int MR, int NR, typename S>
inline void tile(const float* x, int64_t K, const uint8_t* block, const S* scales, const S* offsets, int f0,
                 float (*out)[kBlock]) {
  constexpr int kBytes = G * Bits / 8;  // bytes per feature per group
  constexpr int kVectors = G / 8;
  const int64_t groups = K / G;
  __m256 acc[MR][NR];
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 8") for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = block + g * kBlock * kBytes;
    const S* gs = scales + g * kBlock;
    const S* go = offsets ? offsets + g * kBlock : nullptr;
    const float* xg = x + g * G;
    _Pragma("GCC unroll 8") for (int n = 0; n < NR; ++n) {
      const __m256 s = _mm256_set1_ps(scalar(gs, f0 + n));
      const __m256 o = go ? _mm256_set1_ps(scalar(go, f0 + n)) : _mm256_setzero_ps();
      const uint8_t* fc = codes + (f0 + n) * kBytes;
      _Pragma("GCC unroll 4") for (int v = 0; v < kVectors; ++v) {
        const __m256 w = weights<Bits, G>(fc, v, s, o);
        _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
          acc[m][n] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + m * K + 8 * v), acc[m][n]);
        }
      }
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MR; ++m) {
    _Pragma("GCC unroll 8") for (int n = 0; n < NR; ++n) out[m][f0 + n] = hsum(acc[m][n]);
  }
}

// All 8 features of a block for rows [0, MR).
template <int Bits, int G, int MR, typename S>
inline void block_rows(const float* x, int64_t K, const uint8_t* block, const S* scales, const S* offsets,
                       float (*out)[kBlock]) {
  if constexpr (MR == 1) {
    tile<Bits, G, 1, 8, S>(x, K, block, scales, offsets, 0, out);
  } else if constexpr (MR == 2) {
    tile<Bits, G, 2, 4, S>(x, K, block, scales, offsets, 0, out);
    tile<Bits, G, 2, 4, S>(x, K, block, scales, offsets, 4, out);
  } else {
    _Pragma("GCC unroll 4") for (int f = 0; f < kBlock; f += 2) tile<Bits, G, MR, 2, S>(x, K, block, scales, offsets, f, out);
  }
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

// Rows [0, M) of x times blocks [b0, b1) → y [M, N].
template <int Bits, int G, typename S, typename Out>
void run_blocks(const float* x, const uint8_t* qweight, const S* scales, const S* offsets, const float* bias,
                int64_t M, int64_t N, int64_t K, Out* y, int64_t b0, int64_t b1) {
  const int64_t groups = K / G;
  const int64_t block_bytes = groups * kBlock * (G * Bits / 8);
  const int64_t block_scales = groups * kBlock;
  alignas(32) float out[4][kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* block = qweight + b * block_bytes;
    const S* bs = scales + b * block_scales;
    const S* bo = offsets ? offsets + b * block_scales : nullptr;
    const int64_t n0 = b * kBlock, columns = std::min<int64_t>(kBlock, N - n0);
    const float* block_bias = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      block_rows<Bits, G, 4, S>(x + m * K, K, block, bs, bo, out);
      for (int r = 0; r < 4; ++r) store(y + (m + r) * N + n0, out[r], block_bias, columns);
    }
    const int64_t rest = M - m;
    if (rest == 3) block_rows<Bits, G, 3, S>(x + m * K, K, block, bs, bo, out);
    if (rest == 2) block_rows<Bits, G, 2, S>(x + m * K, K, block, bs, bo, out);
    if (rest == 1) block_rows<Bits, G, 1, S>(x + m * K, K, block, bs, bo, out);
    for (int64_t r = 0; r < rest; ++r) store(y + (m + r) * N + n0, out[r], block_bias, columns);
  }
}

std::vector<float> to_float(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::vector<float> out(static_cast<size_t>(c.numel()));
  if (c.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), c.data_ptr<float>(), out.size() * sizeof(float));
  } else {
    const at::BFloat16* p = c.data_ptr<at::BFloat16>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(p[i]);
  }
  return out;
}

template <int Bits, int G, typename S>
void dispatch_out(const at::Tensor& x, const std::vector<float>& xf, const uint8_t* qw, const S* sp, const S* op,
                  const float* bp, int64_t M, int64_t N, int64_t K, at::Tensor& y) {
  const int64_t num_blocks = (N + kBlock - 1) / kBlock;
  auto run = [&](auto* yp) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, M - m0);
      at::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
        run_blocks<Bits, G, S>(xf.data() + m0 * K, qw, sp, op, bp, rows, N, K, yp + m0 * N, b0, b1);
      });
    }
  };
  if (x.scalar_type() == at::kFloat) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<at::BFloat16>());
  }
}

template <typename S>
void dispatch_format(int64_t bits, int64_t G, const at::Tensor& x, const std::vector<float>& xf, const uint8_t* qw,
                     const S* sp, const S* op, const float* bp, int64_t M, int64_t N, int64_t K, at::Tensor& y) {
  if (bits == 4 && G == 32) return dispatch_out<4, 32, S>(x, xf, qw, sp, op, bp, M, N, K, y);
  if (bits == 8 && G == 32) return dispatch_out<8, 32, S>(x, xf, qw, sp, op, bp, M, N, K, y);
  if (bits == 8 && G == 16) return dispatch_out<8, 16, S>(x, xf, qw, sp, op, bp, M, N, K, y);
  TORCH_CHECK(false, "quant_linear: no kernel for ", bits, "-bit codes in groups of ", G);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t bits,
                        int64_t group_size, int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 4 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(2) == kBlock && qweight.size(3) == group_size * bits / 8,
              "quant_linear: qweight must be a contiguous uint8 [N/8, K/G, 8, G·bits/8] tensor");
  const int64_t N = out_features, K = qweight.size(1) * group_size;
  TORCH_CHECK(N > 0 && (N + kBlock - 1) / kBlock == qweight.size(0), "quant_linear: out_features does not match");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == qweight.size(0) &&
                  scales.size(1) == qweight.size(1) && scales.size(2) == kBlock &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "quant_linear: scales must be a contiguous float16 or float32 [N/8, K/G, 8] tensor");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(!has_offsets || (offsets->sizes() == scales.sizes() && offsets->is_contiguous() &&
                               offsets->scalar_type() == scales.scalar_type()),
              "quant_linear: offsets must match scales in shape and dtype");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "quant_linear: x's last dimension must be ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "quant_linear: x must be bfloat16 or float32");
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "quant_linear: CPU tensors only");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == N && (bias->scalar_type() == at::kBFloat16 ||
                                                   bias->scalar_type() == at::kFloat)),
              "quant_linear: bias must hold out_features bfloat16 or float32 values");
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  const int64_t M = x.numel() / K;
  at::Tensor y = at::empty(out_sizes, x.options());
  if (M == 0) return y;
  const std::vector<float> xf = to_float(x);
  const std::vector<float> bf = has_bias ? to_float(*bias) : std::vector<float>();
  const float* bp = has_bias ? bf.data() : nullptr;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  if (scales.scalar_type() == at::kFloat) {
    dispatch_format<float>(bits, group_size, x, xf, qw, scales.data_ptr<float>(),
                           has_offsets ? offsets->data_ptr<float>() : nullptr, bp, M, N, K, y);
  } else {
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const auto* op = has_offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
    dispatch_format<uint16_t>(bits, group_size, x, xf, qw, sp, op, bp, M, N, K, y);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash2, m) {
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? offsets, Tensor? bias, int bits, int group_size, "
      "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash2, CPU, m) { m.impl("quant_linear", &quant_linear); }
