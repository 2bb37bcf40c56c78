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
// With int8 activations (format flag kInt8Inputs, --weights native-int8) the rounding is to int8
// (s = max|x| / 127, as llama.cpp does: 256 times coarser, about 3e-2 of the largest logit on the
// embedded model) and the integer products are summed four at a time: vpdpbusd (VNNI) multiplies
// 64 byte pairs per instruction where vpdpwssd multiplies 32 int16 pairs, so a verification window
// or a batch costs about a third fewer multiply-add instructions. Everything else is the same.
//
// Layout (made by pack_quantized, weights unchanged): tiles of 32 outputs; per tile and pair of inputs
// (k, k + 1) one "unit" of 16-bit lanes, lane 2p + e holding q[j, k + e] for output j = 8f + p, where
// f = 0..3 picks the field: Q4 packs the four fields as the four nibbles of each lane (32 bytes per
// unit), Q8 as the low and high bytes of two 32-byte halves (64 bytes per unit). vpmaddwd of field f
// with the broadcast pair (xq_k, xq_k+1) then yields the 8 partial sums of outputs 8f..8f+7. Scales
// and offsets are fp32 [tiles, groups, 32]. For int8 activations a unit holds a quad of inputs
// (k .. k + 3): byte 4i + e is input k + e of output i (Q4: low nibble; high nibble: output 16 + i;
// Q8: outputs 16..31 in a second 64 bytes), so a 512-bit register is 16 outputs x 4 inputs.
//
// Integer sums are exact, and the float epilogue runs in the same order for every row, so a row's
// result never depends on how many other rows share the call (batch-invariant by construction), and
// every instruction set gives identical results. The inner loops (quant_gemm_tiles.inc) are compiled
// for portable C++, AVX2, AVX-512 and AVX-512 VNNI whatever the build machine's flags, and the best
// one this CPU runs is picked once at run time (quant_linear_isa runs a named one, for tests).
#include "forward_parts.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 32;        // output columns per tile
constexpr int64_t kMaxGroup = 128;   // largest quantisation group (inputs sharing one scale)

// The format of a packed weight: its bits, plus kInt8Inputs when the activations are rounded to
// int8 rather than int16 (the weights are then packed by input quads, see pack_quantized).
constexpr int64_t kInt8Inputs = 16;
enum Format : int64_t { kQ4 = 4, kQ8 = 8, kQ4i8 = kQ4 | kInt8Inputs, kQ8i8 = kQ8 | kInt8Inputs };

bool known_format(int64_t format) { return format == kQ4 || format == kQ8 || format == kQ4i8 || format == kQ8i8; }

template <int FMT>
constexpr bool int8_inputs() { return (FMT & kInt8Inputs) != 0; }

template <int FMT>
constexpr bool q4() { return (FMT & ~kInt8Inputs) == kQ4; }

// Inputs per unit (a pair of int16 activations, or a quad of int8 ones) and the unit's bytes.
template <int FMT>
constexpr int64_t unit_inputs() { return int8_inputs<FMT>() ? 4 : 2; }

template <int FMT>
constexpr int64_t unit_bytes() { return int8_inputs<FMT>() ? (q4<FMT>() ? 64 : 128) : (q4<FMT>() ? 32 : 64); }

template <int FMT>
constexpr int32_t kCentre = q4<FMT>() ? 8 : 0;  // c: the weights' integer zero

// A row's rounded activations.
template <int FMT>
using Act = std::conditional_t<int8_inputs<FMT>(), int8_t, int16_t>;

// The activations of unit i (an int16 pair or an int8 quad) as one int32, for broadcasting.
template <typename A>
inline int32_t input_unit(const A* xq, int64_t i) {
  int32_t v;
  std::memcpy(&v, xq + i * (4 / static_cast<int64_t>(sizeof(A))), sizeof v);
  return v;
}

// q of output 8f + p, input k + e, from an int16-input unit (portable path; lane = 2p + e).
template <int FMT>
inline int32_t unit_value(const uint8_t* unit, int f, int lane) {
  if constexpr (q4<FMT>()) {
    const uint16_t v = static_cast<uint16_t>(unit[2 * lane] | (unit[2 * lane + 1] << 8));
    return (v >> (4 * f)) & 15;
  } else {
    return static_cast<int8_t>(unit[(f / 2) * 32 + 2 * lane + (f % 2)]);
  }
}

// q of output j (0..31), input 4 kq + e, from an int8-input unit (portable path).
template <int FMT>
inline int32_t quad_value(const uint8_t* unit, int j, int e) {
  if constexpr (q4<FMT>()) return (unit[4 * (j % 16) + e] >> (4 * (j / 16))) & 15;
  else return static_cast<int8_t>(unit[(j / 16) * 64 + 4 * (j % 16) + e]);
}

// One call's operands (rows already rounded, see quant_linear).
struct Gemm {
  const void* xq;
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
  TORCH_CHECK(known_format(format), "pack_quantized: format must be 4 or 8, plus 16 for int8 inputs");
  const bool quads = format & kInt8Inputs, is_q4 = (format & ~kInt8Inputs) == kQ4;
  TORCH_CHECK(q.device().is_cpu() && q.element_size() == 1, "pack_quantized: q must be a CPU uint8/int8 tensor");
  TORCH_CHECK(q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 && q.size(1) % scale.size(1) == 0,
              "pack_quantized: q must be [N, K] and scale [N, K / G]");
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1);
  const int64_t per_unit = quads ? 4 : 2;
  TORCH_CHECK(k % per_unit == 0 && (k / groups) % per_unit == 0, "pack_quantized: groups must hold a multiple of ",
              per_unit, " inputs");
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
  const int64_t ub = quads ? (is_q4 ? unit_bytes<kQ4i8>() : unit_bytes<kQ8i8>())
                           : (is_q4 ? unit_bytes<kQ4>() : unit_bytes<kQ8>());
  auto units = torch::zeros({tiles, k / per_unit, ub}, torch::kUInt8);
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
          op[(t * groups + g) * kTile + j] = is_q4 ? ov[row * groups + g] + 8.0f * d  // o' = o + 8d
                                                   : ov[row * groups + g];
        }
      }
      // Value of output 8f + p (of this tile), input i; zero past the last row.
      auto value = [&](int64_t f, int64_t p, int64_t i) -> uint8_t {
        const int64_t row = t * kTile + 8 * f + p;
        return row < n ? qv[row * k + i] : 0;
      };
      uint8_t* tile_units = uv + t * (k / per_unit) * ub;
      if (quads) {  // byte 4 i + e of a unit: input 4 kq + e of output i (Q4: low nibble) and 16 + i (high)
        for (int64_t kq = 0; kq < k / 4; ++kq) {
          uint8_t* unit = tile_units + kq * ub;
          for (int64_t i = 0; i < 16; ++i)
            for (int64_t e = 0; e < 4; ++e) {
              if (is_q4) {
                unit[4 * i + e] = static_cast<uint8_t>(value(0, i, 4 * kq + e) | (value(2, i, 4 * kq + e) << 4));
              } else {  // Q8: outputs 0..15 in the first 64 bytes, 16..31 in the next
                unit[4 * i + e] = value(0, i, 4 * kq + e);
                unit[64 + 4 * i + e] = value(2, i, 4 * kq + e);
              }
            }
        }
        continue;
      }
      for (int64_t kp = 0; kp < k / 2; ++kp) {
        uint8_t* unit = tile_units + kp * ub;
        for (int64_t p = 0; p < 8; ++p) {
          for (int64_t e = 0; e < 2; ++e) {
            const int64_t lane = 2 * p + e, i = 2 * kp + e;
            if (is_q4) {  // little-endian 16-bit lane: nibbles f = 0, 1 in the low byte, 2, 3 in the high
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

int64_t best_isa_index() { return best_isa(); }

int64_t isa_index(const std::string& name) {
  int64_t isa = -1;
  for (int64_t i = 0; i < kNumIsas; ++i)
    if (name == kIsaNames[i]) isa = i;
  TORCH_CHECK(isa >= 0, "unknown instruction set ", name);
  TORCH_CHECK(isa_supported(isa), "this CPU does not run ", name);
  return isa;
}

torch::Tensor quant_linear_isa(const torch::Tensor& x_in, const torch::Tensor& units, const torch::Tensor& scales,
                               const torch::Tensor& offsets, int64_t n_out, int64_t format,
                               const c10::optional<torch::Tensor>& bias, const std::string& isa_name) {
  return quant_linear_impl(x_in, units, scales, offsets, n_out, format, bias, isa_index(isa_name));
}

namespace parts {

QuantWeight quant_weight(const torch::Tensor& units, const torch::Tensor& scales, const torch::Tensor& offsets,
                         int64_t n_out, int64_t format, const torch::Tensor* bias) {
  TORCH_CHECK(known_format(format), "quant_linear: format must be 4 or 8, plus 16 for int8 inputs");
  const bool quads = format & kInt8Inputs, is_q4 = (format & ~kInt8Inputs) == kQ4;
  const int64_t per_unit = quads ? 4 : 2;
  const int64_t bytes = quads ? (is_q4 ? unit_bytes<kQ4i8>() : unit_bytes<kQ8i8>())
                              : (is_q4 ? unit_bytes<kQ4>() : unit_bytes<kQ8>());
  TORCH_CHECK(units.dim() == 3 && units.size(2) == bytes && units.is_contiguous() && units.scalar_type() == torch::kUInt8,
              "quant_linear: packed weight is ", units.sizes());
  const int64_t K = units.size(1) * per_unit, tiles = units.size(0);
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && offsets.is_contiguous() && scales.size(0) == tiles &&
                  scales.size(2) == kTile && offsets.sizes() == scales.sizes() && K % scales.size(1) == 0 &&
                  scales.scalar_type() == torch::kFloat32 && offsets.scalar_type() == torch::kFloat32,
              "quant_linear: bad scales");
  TORCH_CHECK(n_out <= tiles * kTile, "quant_linear: n_out too large");
  const int64_t groups = scales.size(1), group = K / groups;
  TORCH_CHECK(group % per_unit == 0 && group <= kMaxGroup, "quant_linear: groups of ", group,
              " inputs are not supported");
  const float* bp = nullptr;
  if (bias != nullptr) {
    TORCH_CHECK(bias->numel() == n_out && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "quant_linear: bad bias");
    bp = bias->data_ptr<float>();
  }
  return {units.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), bp, n_out, format, K,
          tiles, groups, group};
}

// 32-bit words holding M rows of rounded values (int16, or int8 with int8 inputs).
static int64_t value_words(const QuantWeight& w, int64_t M) { return (M * w.K * ((w.format & kInt8Inputs) ? 1 : 2) + 3) / 4; }

int64_t rounded_words(const QuantWeight& w, int64_t M) { return value_words(w, M) + 3 * M * w.groups; }

RoundedRows rounded_rows_in(float* words, const QuantWeight& w, int64_t M) {
  float* stats = words + value_words(w, M);
  return {words, reinterpret_cast<int32_t*>(stats), stats + M * w.groups, stats + 2 * M * w.groups};
}

// Per row and group: the activations rounded to int16 (or int8), their scale, the sum of the
// rounded values and the sum of the float inputs (sequential, so the same for any batch). A group
// holding inf or NaN gets a NaN scale, so it propagates.
void round_rows(const QuantWeight& w, const float* x, const RoundedRows& r, int64_t i0, int64_t i1) {
  const int64_t K = w.K, groups = w.groups, group = w.group;
  const auto run = [&](auto* xq, float top) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const float* xg = x + m * K + g * group;
      float amax = 0.0f, total = 0.0f;
      bool finite = true;
      for (int64_t kk = 0; kk < group; ++kk) {
        amax = std::max(amax, std::fabs(xg[kk]));
        total += xg[kk];
        finite = finite && std::isfinite(xg[kk]);
      }
      const float inv = amax > 0.0f && finite ? top / amax : 0.0f;
      auto* qg = xq + m * K + g * group;
      int32_t qsum = 0;
      for (int64_t kk = 0; kk < group; ++kk) {
        qg[kk] = static_cast<std::remove_pointer_t<decltype(xq)>>(std::nearbyint(xg[kk] * inv));
        qsum += qg[kk];
      }
      r.xqsum[i] = qsum;
      r.xscale[i] = finite ? amax / top : std::numeric_limits<float>::quiet_NaN();
      r.xsum[i] = total;
    }
  };
  if (w.format & kInt8Inputs) run(static_cast<int8_t*>(r.xq), 127.0f);
  else run(static_cast<int16_t*>(r.xq), 32767.0f);
}

void project_tiles(int64_t isa, const QuantWeight& w, const RoundedRows& r, int64_t M, float* y, int64_t t0,
                   int64_t t1) {
  const Gemm gemm{r.xq, r.xqsum, r.xscale, r.xsum, M, w.K, w.groups, w.group, w.units,
                  w.scales, w.offsets, y, w.n_out, w.bias, w.format};
  run_isa(isa, gemm, t0, t1);
}

}  // namespace parts

namespace {

torch::Tensor quant_linear_impl(const torch::Tensor& x_in, const torch::Tensor& units, const torch::Tensor& scales,
                                const torch::Tensor& offsets, int64_t n_out, int64_t format,
                                const c10::optional<torch::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "quant_linear: 2-D float32 input");
  const auto x = x_in.contiguous();
  torch::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  const auto w = parts::quant_weight(units, scales, offsets, n_out, format, bias.has_value() ? &b : nullptr);
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == w.K, "quant_linear: input has ", x.size(1), " features, packed weight is ", units.sizes());
  auto y = torch::empty({M, n_out}, x.options());
  auto words = torch::empty({parts::rounded_words(w, M)}, x.options());
  const auto rows = parts::rounded_rows_in(words.data_ptr<float>(), w, M);
  const float* xp = x.data_ptr<float>();
  // Rows in parallel once there are many (batched decoding); each row's arithmetic is unchanged.
  at::parallel_for(0, M * w.groups, 8 * w.groups,
                   [&](int64_t i0, int64_t i1) { parts::round_rows(w, xp, rows, i0, i1); });
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.tiles, 4, [&](int64_t t0, int64_t t1) { parts::project_tiles(isa, w, rows, M, yp, t0, t1); });
  return y;
}

}  // namespace
