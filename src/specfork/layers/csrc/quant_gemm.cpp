// Small-M GEMM on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), for CPU decode and verification:
// y[M, N] = x[M, K] @ W^T (+ bias), W never materialised in fp32.
//
// GGUF stores each output row in blocks of 32 inputs: Q4_0 w = d * (q - 8), Q4_1 w = d * q + m
// (q in 0..15), Q8_0 w = d * q (q in -128..127), with one fp16 d (and m) per block. Within a group of
// inputs sharing d and o, write w = d * (q - c) + o' with c = 8 for Q4 (o' = o + 8d: 0 for Q4_0) and
// c = 0 for Q8 (o' = 0); then
//   sum_k x_k w_k = d * sum_k x_k (q_k - c) + o' * sum_k x_k,
// so the inner loop only needs the integer q. The activations of each row and group are rounded to
// int16 (x ~ s * xq, s = max|x| / 32767, relative error <= 2^-16 of the group's largest input; llama.cpp
// rounds them to int8, 256 times coarser), which turns the inner loop into exact integer
// multiply-adds: AVX2's vpmaddwd does 16 of them per instruction where a float FMA does 8, and needs
// no int->float conversion of the weights. Per group the exact int32 sum is scaled once:
//   y += (d * s) * float(sum_k xq_k q_k - c * sum_k xq_k) + o' * sum_k x_k
// (the last sum over the float inputs). Centring on c halves the rounding error for Q4: each input's
// error (at most s / 2) is multiplied by |q - c| <= 8 instead of q <= 15.
//
// Layout (made by pack_quantized, weights unchanged): tiles of 32 outputs; per tile and pair of inputs
// (k, k + 1) one "unit" of 16-bit lanes, lane 2p + e holding q[j, k + e] for output j = 8f + p, where
// f = 0..3 picks the field: Q4 packs the four fields as the four nibbles of each lane (32 bytes per
// unit), Q8 as the low and high bytes of two 32-byte halves (64 bytes per unit). vpmaddwd of field f
// with the broadcast pair (xq_k, xq_k+1) then yields the 8 partial sums of outputs 8f..8f+7. Scales
// and offsets are fp32 [tiles, groups, 32].
//
// Integer sums are exact, and the float epilogue runs in the same order for every row, so a row's
// result never depends on how many other rows share the call (batch-invariant by construction), and
// every instruction set gives identical results. The inner loops (quant_gemm_tiles.inc) are compiled
// for portable C++, AVX2, AVX-512 and AVX-512 VNNI whatever the build machine's flags, and the best
// one this CPU runs is picked once at run time (quant_linear_isa runs a named one, for tests).
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 32;        // output columns per tile
constexpr int64_t kMaxGroup = 128;   // largest quantisation group (inputs sharing one scale)
constexpr float kInt16Max = 32767.0f;

enum Format : int64_t { kQ4 = 4, kQ8 = 8 };

template <int FMT>
constexpr int64_t unit_bytes() { return FMT == kQ4 ? 32 : 64; }

template <int FMT>
constexpr int32_t kCentre = FMT == kQ4 ? 8 : 0;  // c: the weights' integer zero

// The int16 pair (xq[2kp], xq[2kp + 1]) as one int32, for broadcasting.
inline int32_t input_pair(const int16_t* xq, int64_t kp) {
  int32_t v;
  std::memcpy(&v, xq + 2 * kp, sizeof v);
  return v;
}

// q of output 8f + p, input k + e, from a unit (portable path; lane = 2p + e).
template <int FMT>
inline int32_t unit_value(const uint8_t* unit, int f, int lane) {
  if constexpr (FMT == kQ4) {
    const uint16_t v = static_cast<uint16_t>(unit[2 * lane] | (unit[2 * lane + 1] << 8));
    return (v >> (4 * f)) & 15;
  } else {
    return static_cast<int8_t>(unit[(f / 2) * 32 + 2 * lane + (f % 2)]);
  }
}

// One call's operands (rows already rounded to int16, see quant_linear).
struct Gemm {
  const int16_t* xq;
  const int32_t* xqsum;
  const float* xscale;
  const float* xsum;
  int64_t M, K, groups, group;
  const uint8_t* units;
  const float* scales;
  const float* offsets;
  float* y;
  int64_t n_out;
  const float* bias;
  int64_t format;
};

}  // namespace

// The inner loops once per instruction set (quant_gemm_tiles.inc), each in its own namespace.
#define QG_ISA 0
namespace qg_portable {
#include "quant_gemm_tiles.inc"
}
#undef QG_ISA
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define QG_ISA 1
namespace qg_avx2 {
#include "quant_gemm_tiles.inc"
}
#undef QG_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
#define QG_ISA 2
namespace qg_avx512 {
#include "quant_gemm_tiles.inc"
}
#undef QG_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#define QG_ISA 3
namespace qg_avx512_vnni {
#include "quant_gemm_tiles.inc"
}
#undef QG_ISA
#pragma GCC pop_options
#endif

namespace {

const char* const kIsaNames[] = {"portable", "avx2", "avx512", "avx512-vnni"};
constexpr int64_t kNumIsas = 4;

bool isa_supported(int64_t isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 2: return isa_supported(1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl");
    case 3: return isa_supported(2) && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
#else
  return isa == 0;
#endif
}

// The best set this CPU runs, found once.
int64_t best_isa() {
  static const int64_t best = [] {
    int64_t b = 0;
    for (int64_t i = 1; i < kNumIsas; ++i)
      if (isa_supported(i)) b = i;
    return b;
  }();
  return best;
}

void run_isa(int64_t isa, const Gemm& a, int64_t t0, int64_t t1) {
  switch (isa) {
#if defined(__x86_64__)
    case 1: qg_avx2::run(a, t0, t1); return;
    case 2: qg_avx512::run(a, t0, t1); return;
    case 3: qg_avx512_vnni::run(a, t0, t1); return;
#endif
    default: qg_portable::run(a, t0, t1); return;
  }
}

}  // namespace

// q [N, K] quantised values (uint8 0..15 for Q4, int8 for Q8), scale/offset [N, K / G] fp32 for groups of G
// inputs -> (units [tiles, K / 2, 32 or 64] uint8, scales [tiles, K / G, 32], offsets [tiles, K / G, 32]).
std::vector<torch::Tensor> pack_quantized(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& offset,
                                          int64_t format) {
  TORCH_CHECK(format == kQ4 || format == kQ8, "pack_quantized: format must be 4 or 8");
  TORCH_CHECK(q.device().is_cpu() && q.element_size() == 1, "pack_quantized: q must be a CPU uint8/int8 tensor");
  TORCH_CHECK(q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 && q.size(1) % scale.size(1) == 0,
              "pack_quantized: q must be [N, K] and scale [N, K / G]");
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1);
  TORCH_CHECK(k % 2 == 0 && (k / groups) % 2 == 0, "pack_quantized: groups must have an even number of inputs");
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(scale.size(0) == n && offset.sizes() == scale.sizes(), "pack_quantized: scale and offset must be [N, K / G]");
  // One pass of plain loops, parallel over tiles (a model's worth of weights packs in well under a
  // second; the same layout built from tensor permutations took seconds).
  const auto qc = q.contiguous();
  const auto sc = scale.to(torch::kFloat32).contiguous();
  const auto oc = offset.to(torch::kFloat32).contiguous();
  const uint8_t* qv = reinterpret_cast<const uint8_t*>(qc.data_ptr());  // Q4: 0..15, Q8: int8 bits
  const float* sv = sc.data_ptr<float>();
  const float* ov = oc.data_ptr<float>();
  const int64_t ub = format == kQ4 ? unit_bytes<kQ4>() : unit_bytes<kQ8>();
  auto units = torch::zeros({tiles, k / 2, ub}, torch::kUInt8);
  auto s = torch::zeros({tiles, groups, kTile}, torch::kFloat32);
  auto o = torch::zeros({tiles, groups, kTile}, torch::kFloat32);
  uint8_t* uv = units.data_ptr<uint8_t>();
  float* sp = s.data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // Rows past n stay zero (scale, offset and values): padding outputs that are never read.
      const int64_t rows = std::min(kTile, n - t * kTile);
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t row = t * kTile + j;
        for (int64_t g = 0; g < groups; ++g) {
          const float d = sv[row * groups + g];
          sp[(t * groups + g) * kTile + j] = d;
          op[(t * groups + g) * kTile + j] = format == kQ4 ? ov[row * groups + g] + 8.0f * d  // o' = o + 8d
                                                           : ov[row * groups + g];
        }
      }
      // Value of output 8f + p (of this tile), input i; zero past the last row.
      auto value = [&](int64_t f, int64_t p, int64_t i) -> uint8_t {
        const int64_t row = t * kTile + 8 * f + p;
        return row < n ? qv[row * k + i] : 0;
      };
      uint8_t* tile_units = uv + t * (k / 2) * ub;
      for (int64_t kp = 0; kp < k / 2; ++kp) {
        uint8_t* unit = tile_units + kp * ub;
        for (int64_t p = 0; p < 8; ++p) {
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t lane = 2 * p + e, i = 2 * kp + e;
            if (format == kQ4) {  // little-endian 16-bit lane: nibbles f = 0, 1 in the low byte, 2, 3 in the high
              unit[2 * lane] = static_cast<uint8_t>(value(0, p, i) | (value(1, p, i) << 4));
              unit[2 * lane + 1] = static_cast<uint8_t>(value(2, p, i) | (value(3, p, i) << 4));
            } else {  // field f at byte (f / 2) * 32 + 2 lane + f % 2
              for (int64_t f = 0; f < 4; ++f) unit[(f / 2) * 32 + 2 * lane + (f % 2)] = value(f, p, i);
            }
          }
        }
      }
    }
  });
  return {units, s, o};
}

namespace {
torch::Tensor quant_linear_impl(const torch::Tensor& x_in, const torch::Tensor& units, const torch::Tensor& scales,
                                const torch::Tensor& offsets, int64_t n_out, int64_t format,
                                const c10::optional<torch::Tensor>& bias, int64_t isa);
}  // namespace

// x [M, K] float32 -> y [M, n_out], on the best instruction set of this CPU.
torch::Tensor quant_linear(const torch::Tensor& x_in, const torch::Tensor& units, const torch::Tensor& scales,
                           const torch::Tensor& offsets, int64_t n_out, int64_t format,
                           const c10::optional<torch::Tensor>& bias) {
  return quant_linear_impl(x_in, units, scales, offsets, n_out, format, bias, best_isa());
}

std::string kernel_isa() { return kIsaNames[best_isa()]; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (int64_t i = 0; i < kNumIsas; ++i)
    if (isa_supported(i)) names.push_back(kIsaNames[i]);
  return names;
}

torch::Tensor quant_linear_isa(const torch::Tensor& x_in, const torch::Tensor& units, const torch::Tensor& scales,
                               const torch::Tensor& offsets, int64_t n_out, int64_t format,
                               const c10::optional<torch::Tensor>& bias, const std::string& isa_name) {
  int64_t isa = -1;
  for (int64_t i = 0; i < kNumIsas; ++i)
    if (isa_name == kIsaNames[i]) isa = i;
  TORCH_CHECK(isa >= 0, "quant_linear: unknown instruction set ", isa_name);
  TORCH_CHECK(isa_supported(isa), "quant_linear: this CPU does not run ", isa_name);
  return quant_linear_impl(x_in, units, scales, offsets, n_out, format, bias, isa);
}

namespace {

torch::Tensor quant_linear_impl(const torch::Tensor& x_in, const torch::Tensor& units, const torch::Tensor& scales,
                                const torch::Tensor& offsets, int64_t n_out, int64_t format,
                                const c10::optional<torch::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "quant_linear: 2-D float32 input");
  TORCH_CHECK(format == kQ4 || format == kQ8, "quant_linear: format must be 4 or 8");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = units.size(0);
  const int64_t bytes = format == kQ4 ? unit_bytes<kQ4>() : unit_bytes<kQ8>();
  TORCH_CHECK(units.dim() == 3 && units.size(1) * 2 == K && units.size(2) == bytes && units.is_contiguous(),
              "quant_linear: input has ", K, " features, packed weight is ", units.sizes());
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && offsets.is_contiguous() && scales.size(0) == tiles &&
                  scales.size(2) == kTile && offsets.sizes() == scales.sizes() && K % scales.size(1) == 0,
              "quant_linear: bad scales");
  TORCH_CHECK(n_out <= tiles * kTile, "quant_linear: n_out too large");
  const int64_t groups = scales.size(1), group = K / groups;
  TORCH_CHECK(group % 2 == 0 && group <= kMaxGroup, "quant_linear: groups of ", group, " inputs are not supported");
  auto y = torch::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  torch::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n_out && b.scalar_type() == torch::kFloat32, "quant_linear: bad bias");
    bp = b.data_ptr<float>();
  }
  // Per row and group: int16 activations, their scale, and the sum of the float inputs (sequential,
  // so the same for any batch). A group holding inf or NaN gets a NaN scale, so it propagates.
  auto xq_t = torch::empty({M, K}, x.options().dtype(torch::kInt16));
  auto stats = torch::empty({2, M, groups}, x.options());
  auto xqsum_t = torch::empty({M, groups}, x.options().dtype(torch::kInt32));
  int16_t* xq = xq_t.data_ptr<int16_t>();
  int32_t* xqsum = xqsum_t.data_ptr<int32_t>();
  float* xscale = stats.data_ptr<float>();
  float* xsum = xscale + M * groups;
  // Rows in parallel once there are many (batched decoding); each row's arithmetic is unchanged.
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = xp + m * K + g * group;
      float amax = 0.0f, total = 0.0f;
      bool finite = true;
      for (int64_t kk = 0; kk < group; ++kk) {
        amax = std::max(amax, std::fabs(xg[kk]));
        total += xg[kk];
        finite = finite && std::isfinite(xg[kk]);
      }
      const float inv = amax > 0.0f && finite ? kInt16Max / amax : 0.0f;
      int16_t* qg = xq + m * K + g * group;
      int32_t qsum = 0;
      for (int64_t kk = 0; kk < group; ++kk) {
        qg[kk] = static_cast<int16_t>(std::nearbyint(xg[kk] * inv));
        qsum += qg[kk];
      }
      xqsum[m * groups + g] = qsum;
      xscale[m * groups + g] = finite ? amax / kInt16Max : std::numeric_limits<float>::quiet_NaN();
      xsum[m * groups + g] = total;
    }
  });
  const Gemm gemm{xq, xqsum, xscale, xsum, M, K, groups, group, units.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                  offsets.data_ptr<float>(), y.data_ptr<float>(), n_out, bp, format};
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { run_isa(isa, gemm, t0, t1); });
  return y;
}

}  // namespace
