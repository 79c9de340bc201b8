// dflash2::bf16_amx_linear — y = x · Wᵀ (+ bias) for bfloat16 weights on x86 CPUs with AMX (Intel
// Sapphire Rapids and later: AMX-TILE and AMX-BF16). Built and loaded by dflash2/models/cpu_kernels.py.
//
// Same packed weight as dflash2::bf16_dot_linear (bf16_dot_linear.cpp): blocks of 32 output features,
// for each pair of inputs p 64 values [h][i][j] = W[32b + 16h + i][2p + j]. Read 16 pairs at a time with
// a row stride of 128 bytes, half h of a block is exactly the "VNNI" B operand of `tdpbf16ps`: 16 rows
// (input pairs) × 16 columns (outputs) × 2 bfloat16. So one tile instruction multiplies up to 16 rows of
// x by 32 inputs of 16 outputs (8192 products) where `vdpbf16ps` does 32: with AMX a verify block of 16
// rows costs about what one row does — reading the weights — instead of growing with the rows.
//
// Per block of 32 outputs and per tile of up to 16 rows: two float32 accumulator tiles (C0, C1), and for
// each chunk of 32 inputs one A tile (the rows' 32 inputs, loaded from x in place) and two B tiles (the
// block's halves). Every output is one float32 sum over the chunks in order, each chunk's 32 products
// summed by the tile unit the same way for any row: a row's result does not depend on the other rows or
// on how many there are. Threads split the blocks of output features; each configures its own tiles.
//
// Needs K (in_features) a multiple of 32; cpu_kernels.py sends other layers to bf16_dot_linear.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace dflash2_kernels;

constexpr int64_t kBlock = 32;       // output features per packed block
constexpr int64_t kPairValues = 64;  // bfloat16 values per input pair in a block
constexpr int64_t kChunk = 32;       // inputs per tile step (16 pairs)
constexpr int64_t kRowTile = 16;     // rows per tile

// The tile configuration (palette 1): tiles 0 and 1 accumulate (rows × 16 float32), tile 2 holds x's
// rows (rows × 32 bfloat16), tiles 3 and 4 the block's halves (16 pairs × 16 outputs × 2).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles(int rows) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < 3; ++t) {  // C0, C1, A
    config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[t] = 64;
  }
  for (int t = 3; t < 5; ++t) {  // B0, B1
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Linux hands AMX's tile state to a process only when it asks (once per process).
bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// `rows` (≤ 16) rows of x (bfloat16, row stride K) times block `block` (+ bias) → y (row stride ldy);
// `columns` ≤ 32 of the block's outputs are stored. The tiles are configured for `rows` rows.
template <typename Out>
void tile_block(const uint16_t* x, int64_t K, const uint16_t* block, const float* bias, Out* y, int64_t ldy,
                int rows, int64_t columns) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const uint16_t* b = block + (k0 / 2) * kPairValues;
    _tile_loadd(2, x + k0, K * 2);
    _tile_loadd(3, b, kPairValues * 2);
    _tile_loadd(4, b + kPairValues / 2, kPairValues * 2);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  alignas(64) float c[2][kRowTile][16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  const __mmask16 mask0 = static_cast<__mmask16>(columns >= 16 ? 0xFFFF : (1u << columns) - 1);
  const __mmask16 mask1 = static_cast<__mmask16>(columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : (1u << (columns - 16)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (bias) {
    bias0 = _mm512_maskz_loadu_ps(mask0, bias);
    bias1 = _mm512_maskz_loadu_ps(mask1, bias + 16);
  }
  for (int m = 0; m < rows; ++m) {
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c[0][m]), bias0);
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c[1][m]), bias1);
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

// Rows [0, M) of x times blocks [b0, b1) → y [M, N], row tile by row tile.
template <typename Out>
void run_blocks(const uint16_t* x, const uint16_t* packed, const float* bias, int64_t M, int64_t N, int64_t K,
                Out* y, int64_t b0, int64_t b1) {
  const int64_t block_values = (K / 2) * kPairValues;
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - m0));
    configure_tiles(rows);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      tile_block(x + m0 * K, K, packed + b * block_values, bias ? bias + n0 : nullptr, y + m0 * N + n0, N, rows,
                 std::min<int64_t>(kBlock, N - n0));
    }
  }
  _tile_release();
}

at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t in_features, int64_t out_features) {
  static const bool permitted = request_amx();
  TORCH_CHECK(permitted, "bf16_amx_linear: the kernel refused this process AMX's tile state (arch_prctl)");
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % kPairValues == 0 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "bf16_amx_linear: packed must be a contiguous bfloat16 [N/32, 64·K/2] tensor");
  const int64_t N = out_features, K = in_features;
  TORCH_CHECK(K > 0 && K % kChunk == 0 && K / 2 == packed.size(1) / kPairValues,
              "bf16_amx_linear: in_features must be a multiple of 32 that matches packed");
  check_blocks("bf16_amx_linear", N, kBlock, packed.size(0));
  const LinearCall call = start_linear("bf16_amx_linear", x, packed, bias, K, N);
  const int64_t M = call.rows;
  if (M == 0) return call.y;

  // x as bfloat16: used in place when it is bfloat16 and contiguous, else a copy rounded to nearest even.
  const at::Tensor xc = x.contiguous();
  std::vector<uint16_t> copy;
  const uint16_t* xp = bf16_rows(xc, M, K, K, copy);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = call.bias_data();
  with_output<uint16_t>(call.y, [&](auto* yp) {
    parallel_blocks(packed.size(0), [&](int64_t b0, int64_t b1) { run_blocks(xp, wp, bp, M, N, K, yp, b0, b1); });
  });
  return call.y;
}

}  // namespace

DFLASH2_CPU_OP(bf16_amx_linear, "(Tensor x, Tensor packed, Tensor? bias, int in_features, int out_features) -> Tensor")
