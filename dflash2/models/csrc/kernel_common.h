// Helpers shared by the project's CPU linear kernels (dflash2/models/csrc/*.cpp); built into each
// kernel's library, so a change here rebuilds them all (dflash2/models/cpu_kernels.py hashes it).
#pragma once

#include <ATen/core/Tensor.h>

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

}  // namespace dflash2_kernels
