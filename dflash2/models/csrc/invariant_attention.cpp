// dflash2::invariant_attention — masked grouped-query attention in bfloat16 whose every output depends
// only on its own query, its mask row and the keys that row lets it see: not on the other queries,
// heads or rows of the call, nor on how many masked keys there are or where the call's keys end.
// The attention of deterministic mode on CPU (dflash2/models/layers.py, invariant_attention); built
// into the AVX512-BF16 kernel's library by dflash2/models/cpu_kernels.py.
//
// One thread computes one (row, query, head) output from start to end, in a fixed order (the heads
// that share a key/value head are computed together, each in its own accumulators):
//   scores  s_t = (q · k_t) · scale over the visible keys t = 0, 1, … (masked keys are skipped); each
//           dot product is 16 float32 lanes accumulated over the head dimension in order, then one
//           horizontal sum (always the same sequence of shuffles);
//   softmax p_t = exp(s_t − max s) in float32, their sum in key order;
//   output  o = (Σ_t p_t · v_t) / Σ_t p_t, 16 lanes of the head dimension accumulated in key order,
//           rounded once to bfloat16 (nearest even).
// Library GEMMs were not row-invariant here: on CPUs with AMX, oneDNN's bfloat16 product gave one
// query other bits in a call of 3 rows than in one of 6.
#include <immintrin.h>

#include "kernel_common.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;     // float32 lanes of one AVX-512 register
constexpr int64_t kMaxChunks = 16;  // head dimension up to 256

// 16 bfloat16 values → 16 float32 (a bfloat16 is the float32's upper half).
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

at::Tensor invariant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3,
              "invariant_attention: expected q [R, nh, L, d], k and v [R, nkv, T, d], mask [R, L, T]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kBool,
              "invariant_attention: q, k, v must be bfloat16 and mask bool");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "invariant_attention: CPU tensors only");
  const int64_t R = q.size(0), nh = q.size(1), L = q.size(2), d = q.size(3);
  const int64_t nkv = k.size(1), T = k.size(2);
  TORCH_CHECK(d % kLanes == 0 && d / kLanes <= kMaxChunks, "invariant_attention: head dim must be a multiple of 16, ≤ 256");
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "invariant_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(k.size(0) == R && v.size(0) == R && v.size(1) == nkv && v.size(2) == T && k.size(3) == d && v.size(3) == d,
              "invariant_attention: k and v must be [R, nkv, T, d] matching q");
  TORCH_CHECK(mask.size(0) == R && mask.size(1) == L && mask.size(2) == T, "invariant_attention: mask must be [R, L, T]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "invariant_attention: the head dimension must be contiguous");
  at::Tensor out = at::empty({R, L, nh * d}, q.options());
  if (R * L * nh == 0) return out;
  const int64_t group = nh / nkv, chunks = d / kLanes;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const bool* mp = mask.data_ptr<bool>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float fscale = static_cast<float>(scale);

  // One task per (row, query, key/value head): the group's query heads share each key's and value's loads.
  at::parallel_for(0, R * L * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * T));  // [head of the group][visible key]
    std::vector<int64_t> keys(static_cast<size_t>(T));
    std::vector<__m512> qv(static_cast<size_t>(group * chunks)), acc(static_cast<size_t>(group * chunks));
    std::vector<float> highest(static_cast<size_t>(group)), total(static_cast<size_t>(group));
    for (int64_t index = begin; index < end; ++index) {
      const int64_t r = index / (L * nkv), l = (index / nkv) % L, kvh = index % nkv;
      const bool* visible = mp + r * mask.stride(0) + l * mask.stride(1);
      int64_t count = 0;
      for (int64_t t = 0; t < T; ++t) {
        if (visible[t * mask.stride(2)]) keys[count++] = t;
      }
      for (int64_t j = 0; j < group; ++j) {
        const uint16_t* query = qp + r * q.stride(0) + (kvh * group + j) * q.stride(1) + l * q.stride(2);
        for (int64_t c = 0; c < chunks; ++c) qv[j * chunks + c] = load_bf16(query + c * kLanes);
        highest[j] = -std::numeric_limits<float>::infinity();
        total[j] = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) acc[j * chunks + c] = _mm512_setzero_ps();
      }
      for (int64_t i = 0; i < count; ++i) {
        const uint16_t* key = kp + r * k.stride(0) + kvh * k.stride(1) + keys[i] * k.stride(2);
        __m512 kv[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) kv[c] = load_bf16(key + c * kLanes);
        for (int64_t j = 0; j < group; ++j) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) dot = _mm512_fmadd_ps(qv[j * chunks + c], kv[c], dot);
          const float score = _mm512_reduce_add_ps(dot) * fscale;
          scores[j * T + i] = score;
          highest[j] = score > highest[j] ? score : highest[j];
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        for (int64_t i = 0; i < count; ++i) {
          scores[j * T + i] = std::exp(scores[j * T + i] - highest[j]);
          total[j] += scores[j * T + i];
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        const uint16_t* value = vp + r * v.stride(0) + kvh * v.stride(1) + keys[i] * v.stride(2);
        __m512 vv[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) vv[c] = load_bf16(value + c * kLanes);
        for (int64_t j = 0; j < group; ++j) {
          const __m512 weight = _mm512_set1_ps(scores[j * T + i]);
          for (int64_t c = 0; c < chunks; ++c) acc[j * chunks + c] = _mm512_fmadd_ps(weight, vv[c], acc[j * chunks + c]);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        uint16_t* dst = op + (r * L + l) * nh * d + (kvh * group + j) * d;
        if (count == 0) {  // a padding query that sees nothing: zeros, like a product with no terms
          for (int64_t i = 0; i < d; ++i) dst[i] = 0;
          continue;
        }
        const __m512 norm = _mm512_set1_ps(total[j]);
        for (int64_t c = 0; c < chunks; ++c) {
          const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_div_ps(acc[j * chunks + c], norm));  // nearest even
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * kLanes), reinterpret_cast<const __m256i&>(rounded));
        }
      }
    }
  });
  return out;
}

}  // namespace

DFLASH2_CPU_OP(invariant_attention, "(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")
