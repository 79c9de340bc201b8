// What the project's CPU kernels (dflash2/models/csrc/*.cpp) share: the checks and the set-up of a
// linear op's call (x, bias, output), x and the bias in the forms the kernels read, the split of a
// weight's blocks among threads and the op's registration. Each kernel keeps its own weight layout,
// its own checks of it and its inner loops. Built into each kernel's library, so a change here
// rebuilds them all (dflash2/models/cpu_kernels.py hashes it into their build folders).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace dflash2_kernels {

// A float32 copy of a (bfloat16 or float32) tensor's elements, in row-major order.
inline std::vector<float> to_float(const at::Tensor& t) {
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

// Checks that a packed weight of `num_blocks` blocks of `block` output features holds
// `out_features` (N > 0) of them.
inline void check_blocks(const char* op, int64_t out_features, int64_t block, int64_t num_blocks) {
  TORCH_CHECK(out_features > 0 && (out_features + block - 1) / block == num_blocks, op,
              ": out_features does not match packed");
}

// One call of a linear op y = x · Wᵀ (+ bias), once x and the bias are checked: x [..., K] bfloat16
// or float32 on CPU, the bias (optional) N bfloat16 or float32 values.
struct LinearCall {
  int64_t rows;              // M: x's rows, the product of all its dimensions but the last
  at::Tensor y;              // [..., N], x's dtype, uninitialised
  std::vector<float> bias;   // the bias in float32; empty without one
  const float* bias_data() const { return bias.empty() ? nullptr : bias.data(); }
};

// Checks x (and `weight`, only for its device) and the bias against K = in_features and
// N = out_features, allocates y and copies the bias to float32. Errors name `op`.
inline LinearCall start_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t out_features) {
  const int64_t K = in_features, N = out_features;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, ": x's last dimension must be ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == N && (bias->scalar_type() == at::kBFloat16 ||
                                                   bias->scalar_type() == at::kFloat)),
              op, ": bias must hold out_features bfloat16 or float32 values");
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  LinearCall call{x.numel() / K, at::empty(out_sizes, x.options()), {}};
  if (has_bias) call.bias = to_float(*bias);
  return call;
}

// Calls `run` with the data of y (float32 or bfloat16): `float*` for float32, `BF16*` for bfloat16
// (at::BFloat16, or uint16_t for a kernel that stores the bits).
template <typename BF16 = at::BFloat16, typename Run>
inline void with_output(const at::Tensor& y, Run&& run) {
  if (y.scalar_type() == at::kFloat) {
    run(y.data_ptr<float>());
  } else {
    run(reinterpret_cast<BF16*>(y.data_ptr<at::BFloat16>()));
  }
}

// Threads split a weight's `num_blocks` blocks of output features: `run(b0, b1)` on each share.
template <typename Run>
inline void parallel_blocks(int64_t num_blocks, const Run& run) {
  at::parallel_for(0, num_blocks, 1, run);
}

// x's M rows of K inputs as bfloat16 bits, rows `width` ≥ K values apart: x's own memory when it is
// bfloat16 and width == K (`xc` must be contiguous and outlive the result), otherwise `copy`, the
// values rounded to bfloat16 (nearest even) and each row zero-padded from K to width.
inline const uint16_t* bf16_rows(const at::Tensor& xc, int64_t M, int64_t K, int64_t width,
                                 std::vector<uint16_t>& copy) {
  if (xc.scalar_type() == at::kBFloat16 && width == K) {
    return reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  }
  copy.assign(static_cast<size_t>(M * width), 0);
  if (xc.scalar_type() == at::kFloat) {
    const float* xf = xc.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) copy[m * width + k] = at::BFloat16(xf[m * K + k]).x;
  } else {
    const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) copy[m * width + k] = xb[m * K + k].x;
  }
  return copy.data();
}

}  // namespace dflash2_kernels

// Registers `name`, a function of the including file, as the CPU op dflash2::name with the schema's
// arguments and result, e.g. DFLASH2_CPU_OP(bf16_linear, "(Tensor x, ...) -> Tensor").
#define DFLASH2_CPU_OP(name, signature)                          \
  TORCH_LIBRARY_FRAGMENT(dflash2, m) { m.def(#name signature); } \
  TORCH_LIBRARY_IMPL(dflash2, CPU, m) { m.impl(#name, &name); }
