// Small-M GEMM on GGUF block-quantized weights (4-, 5-, 6- and 8-bit values: Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0 and the k-quants as layers/gguf_blocks.py unpacks them; IQ4_NL / IQ4_XS's 4-bit indices into
// a table of 16 int8 values), for CPU decode and verification:
// y[M, N] = x[M, K] @ W^T (+ bias), W never materialised in fp32.
//
// GGUF stores each output row in blocks of 32 inputs: Q4_0 w = d * (q - 8), Q4_1 w = d * q + m
// (q in 0..15), Q5_0 / Q5_1 the same with q in 0..31, Q8_0 w = d * q (q in -128..127), with one fp16 d
// (and m) per block (Q6_K's 6-bit values in groups of 16 come as Q6, q in 0..63). Within a group of
// inputs sharing d and o, write w = d * (q - c) + o' with c = 8 for Q4 (o' = o + 8d: 0 for Q4_0), 16
// for Q5, 32 for Q6 and c = 0 for Q8 (o' = 0); then
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
// d and offsets o are fp16 [tiles, groups, 32], as GGUF stores them (2 + 2 bytes per 32 weights
// where fp32 took 8: a decode step streams its weights, so 16% fewer bytes for Q4_1); the kernel
// widens them and forms o' = o + c d in fp32 once per group, and a weight whose every o' is zero
// (Q4_0, Q8_0) has no offsets at all. For int8 activations a unit holds a quad of inputs
// (k .. k + 3): byte 4i + e is input k + e of output i (Q4: low nibble; high nibble: output 16 + i;
// Q8: outputs 16..31 in a second 64 bytes), so a 512-bit register is 16 outputs x 4 inputs. Q5 and
// Q6 are Q4's unit followed by one or two planes of the values' higher bits (unit_bytes_of), which
// the unpacking adds under a mask: 40 or 48 bytes per 64 weights (5 or 6 bits) where the same
// values as Q8 took 64. IQ4 packs its indices as Q4 packs its values and looks each one up in the
// table (kIQ4Values) as it unpacks a unit (AVX-512: vpermw / vpshufb; AVX2: vpshufb), giving
// signed values centred on 0 as Q8's: 4 bits a weight where the same values as Q8 took 8.
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
#include <memory>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 32;        // output columns per tile
constexpr int64_t kMaxGroup = 128;   // largest quantisation group (inputs sharing one scale)

// The format of a packed weight: its bits (kIQ4: 4-bit indices into kIQ4Values), plus kInt8Inputs
// when the activations are rounded to int8 rather than int16 (the weights are then packed by input
// quads, see pack_quantized).
constexpr int64_t kInt8Inputs = 16;
enum Format : int64_t {
  kQ4 = 4, kQ5 = 5, kQ6 = 6, kQ8 = 8, kIQ4 = 12,
  kQ4i8 = kQ4 | kInt8Inputs, kQ5i8 = kQ5 | kInt8Inputs, kQ6i8 = kQ6 | kInt8Inputs, kQ8i8 = kQ8 | kInt8Inputs,
  kIQ4i8 = kIQ4 | kInt8Inputs
};

// IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl; layers/quantized.py IQ4_VALUES).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

bool known_format(int64_t format) {
  const int64_t bits = format & ~kInt8Inputs;
  return (format & ~(kInt8Inputs | 15)) == 0 &&
         (bits == kQ4 || bits == kQ5 || bits == kQ6 || bits == kQ8 || bits == kIQ4);
}

template <int FMT>
constexpr bool int8_inputs() { return (FMT & kInt8Inputs) != 0; }

template <int FMT>
constexpr bool q4() { return (FMT & ~kInt8Inputs) == kQ4; }

// Q4, Q5 and Q6 keep q's low 4 bits as nibbles (unsigned); Q5 adds a plane of its fifth bits, Q6
// a plane of its fifth and one of its sixth. IQ4 keeps its indices as nibbles, and its values are
// the table's (signed, as Q8's). (Functions of a runtime format, which the templates below and the
// packing share.)
constexpr bool nibbles_of(int64_t format) { return (format & ~kInt8Inputs) != kQ8; }

constexpr bool table_of(int64_t format) { return (format & ~kInt8Inputs) == kIQ4; }

constexpr int planes_of(int64_t format) {
  return nibbles_of(format) && !table_of(format) ? static_cast<int>(format & ~kInt8Inputs) - 4 : 0;
}

// c: the weights' integer zero (8, 16, 32 for Q4, Q5, Q6; 0 for Q8 and IQ4, whose values are signed).
constexpr int32_t centre_of(int64_t format) {
  return nibbles_of(format) && !table_of(format) ? 1 << (planes_of(format) + 3) : 0;
}

template <int FMT>
constexpr int planes() { return planes_of(FMT); }

template <int FMT>
constexpr bool nibbles() { return nibbles_of(FMT); }

template <int FMT>
constexpr bool table() { return table_of(FMT); }

// The values unpacked are unsigned (Q4, Q5, Q6: 0..63), not signed (Q8, IQ4: -128..127).
template <int FMT>
constexpr bool unsigned_values() { return nibbles<FMT>() && !table<FMT>(); }

// Inputs per unit (a pair of int16 activations, or a quad of int8 ones) and the unit's bytes.
template <int FMT>
constexpr int64_t unit_inputs() { return int8_inputs<FMT>() ? 4 : 2; }

// Each plane of high bits follows the nibbles (bit 4 first, then bit 5): 8 bytes a pair unit (bit l
// of 16-bit word f: lane l of field f), 16 bytes a quad unit (bit b of its first 8 bytes: byte b's
// low nibble, of the next 8: its high nibble).
constexpr int64_t unit_bytes_of(int64_t format) {
  const bool quads = format & kInt8Inputs;
  const int64_t nibble_bytes = quads ? 64 : 32, plane_bytes = quads ? 16 : 8;
  return nibbles_of(format) ? nibble_bytes + planes_of(format) * plane_bytes : (quads ? 128 : 64);
}

template <int FMT>
constexpr int64_t unit_bytes() { return unit_bytes_of(FMT); }

template <int FMT>
constexpr int32_t kCentre = centre_of(FMT);

// The largest group a format's int32 sums allow: with the nibble formats' odd fields held as 16 q
// (see quant_gemm_tiles.inc) a partial sum may reach 16 * (c + q_max) * 32767 per input, within 2^31
// for 128 inputs of Q4, 64 of Q5, 32 of Q6 (Q8 and IQ4: 128 * 32767 per input, any group up to 128).
// (The vector sets' adds wrap, so only their final centred sums must fit; the portable loop's int32
// adds must never overflow at all, C++'s signed overflow being undefined. GGUF's groups are 32 and 16.)
int64_t max_group(int64_t format) {
  const int64_t bits = format & ~kInt8Inputs;
  return bits == kQ5 ? 64 : bits == kQ6 ? 32 : kMaxGroup;
}

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
  if constexpr (nibbles<FMT>()) {
    const uint16_t v = static_cast<uint16_t>(unit[2 * lane] | (unit[2 * lane + 1] << 8));
    int32_t q = (v >> (4 * f)) & 15;
    if constexpr (table<FMT>()) return kIQ4Values[q];
    for (int p = 0; p < planes<FMT>(); ++p) q |= ((unit[32 + 8 * p + 2 * f + lane / 8] >> (lane % 8)) & 1) << (4 + p);
    return q;
  } else {
    return static_cast<int8_t>(unit[(f / 2) * 32 + 2 * lane + (f % 2)]);
  }
}

// q of output j (0..31), input 4 kq + e, from an int8-input unit (portable path).
template <int FMT>
inline int32_t quad_value(const uint8_t* unit, int j, int e) {
  if constexpr (nibbles<FMT>()) {
    const int b = 4 * (j % 16) + e;  // the byte holding it (outputs 16..31: high nibbles)
    int32_t q = (unit[b] >> (4 * (j / 16))) & 15;
    if constexpr (table<FMT>()) return kIQ4Values[q];
    for (int p = 0; p < planes<FMT>(); ++p) q |= ((unit[64 + 16 * p + 8 * (j / 16) + b / 8] >> (b % 8)) & 1) << (4 + p);
    return q;
  }
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
  const uint16_t* scales;   // fp16 bits
  const uint16_t* offsets;  // fp16 bits; nullptr when every o' is zero
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
#pragma GCC target("avx2,fma,f16c")
#define QG_ISA 1
namespace qg_avx2 {
#include "quant_gemm_tiles.inc"
}
#undef QG_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
#define QG_ISA 2
namespace qg_avx512 {
#include "quant_gemm_tiles.inc"
}
#undef QG_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
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
constexpr int64_t kIsaAvx2 = 1;  // this and every later set has AVX2

bool isa_supported(int64_t isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
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

// q [N, K] quantised values (uint8 0..15 / 0..31 / 0..63 for Q4 / Q5 / Q6, int8 for Q8; IQ4: its
// indices 0..15), scale/offset
// [N, K / G] for groups of G inputs, every value an fp16 one -> (units [tiles, K / 2 or K / 4,
// unit_bytes] uint8, scales [tiles, K / G, 32]
// fp16, offsets [tiles, K / G, 32] fp16, or [0] when every o' = o + c d is zero).
std::vector<torch::Tensor> pack_quantized(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& offset,
                                          int64_t format) {
  TORCH_CHECK(known_format(format), "pack_quantized: format must be 4, 5, 6, 8 or 12 (IQ4), plus 16 for int8 inputs");
  const bool quads = format & kInt8Inputs, is_nib = nibbles_of(format);
  const int64_t planes = planes_of(format), top = (1 << (4 + planes)) - 1;
  TORCH_CHECK(q.device().is_cpu() && q.element_size() == 1, "pack_quantized: q must be a CPU uint8/int8 tensor");
  TORCH_CHECK(q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 && q.size(1) % scale.size(1) == 0,
              "pack_quantized: q must be [N, K] and scale [N, K / G]");
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1);
  const int64_t per_unit = quads ? 4 : 2;
  TORCH_CHECK(k % per_unit == 0 && (k / groups) % per_unit == 0, "pack_quantized: groups must hold a multiple of ",
              per_unit, " inputs");
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(scale.size(0) == n && offset.sizes() == scale.sizes(), "pack_quantized: scale and offset must be [N, K / G]");
  if (is_nib && n > 0 && k > 0)
    TORCH_CHECK(q.max().item<uint8_t>() <= top, "pack_quantized: ",
                table_of(format) ? std::string("IQ4 indices") : "Q" + std::to_string(4 + planes) + " values",
                " must be 0..", top);
  // One pass of plain loops, parallel over tiles (a model's worth of weights packs in well under a
  // second; the same layout built from tensor permutations took seconds).
  const auto qc = q.contiguous();
  const auto sc = scale.to(torch::kFloat32).contiguous();
  const auto oc = offset.to(torch::kFloat32).contiguous();
  const auto sh = sc.to(torch::kHalf), oh = oc.to(torch::kHalf);
  TORCH_CHECK(torch::equal(sh.to(torch::kFloat32), sc) && torch::equal(oh.to(torch::kFloat32), oc),
              "pack_quantized: scales and offsets must be fp16 values (GGUF's are; quantize_int4 rounds to them)");
  // o' = o + c d in fp32, as the kernel forms it: no offsets when all are zero.
  const bool offsets = !torch::equal(oc + static_cast<float>(centre_of(format)) * sc, torch::zeros_like(oc));
  const uint8_t* qv = reinterpret_cast<const uint8_t*>(qc.data_ptr());  // Q4: 0..15, Q8: int8 bits
  const int64_t ub = unit_bytes_of(format);
  auto units = torch::zeros({tiles, k / per_unit, ub}, torch::kUInt8);
  auto s = torch::zeros({tiles, groups, kTile}, torch::kHalf);
  auto o = offsets ? torch::zeros({tiles, groups, kTile}, torch::kHalf) : torch::zeros({0}, torch::kHalf);
  uint8_t* uv = units.data_ptr<uint8_t>();
  const at::Half* shv = sh.data_ptr<at::Half>();
  const at::Half* ohv = oh.data_ptr<at::Half>();
  at::Half* sp = s.data_ptr<at::Half>();
  at::Half* op = offsets ? o.data_ptr<at::Half>() : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // Rows past n stay zero (scale, offset and values): padding outputs that are never read.
      const int64_t rows = std::min(kTile, n - t * kTile);
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t row = t * kTile + j;
        for (int64_t g = 0; g < groups; ++g) {
          sp[(t * groups + g) * kTile + j] = shv[row * groups + g];
          if (op) op[(t * groups + g) * kTile + j] = ohv[row * groups + g];
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
              if (is_nib) {
                const uint8_t low = value(0, i, 4 * kq + e), high = value(2, i, 4 * kq + e);
                const int64_t b = 4 * i + e;
                unit[b] = static_cast<uint8_t>((low & 15) | ((high & 15) << 4));
                for (int64_t pl = 0; pl < planes; ++pl) {  // plane pl: the low nibbles' bits, then the high nibbles'
                  unit[64 + 16 * pl + b / 8] |= static_cast<uint8_t>(((low >> (4 + pl)) & 1) << (b % 8));
                  unit[72 + 16 * pl + b / 8] |= static_cast<uint8_t>(((high >> (4 + pl)) & 1) << (b % 8));
                }
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
            if (is_nib) {  // little-endian 16-bit lane: nibbles f = 0, 1 in the low byte, 2, 3 in the high
              unit[2 * lane] = static_cast<uint8_t>((value(0, p, i) & 15) | ((value(1, p, i) & 15) << 4));
              unit[2 * lane + 1] = static_cast<uint8_t>((value(2, p, i) & 15) | ((value(3, p, i) & 15) << 4));
              for (int64_t pl = 0; pl < planes; ++pl)  // plane pl: bit lane of field f's 16-bit word at 32 + 8 pl + 2 f
                for (int64_t f = 0; f < 4; ++f)
                  unit[32 + 8 * pl + 2 * f + lane / 8] |= static_cast<uint8_t>(((value(f, p, i) >> (4 + pl)) & 1) << (lane % 8));
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
  TORCH_CHECK(known_format(format), "quant_linear: format must be 4, 5, 6, 8 or 12 (IQ4), plus 16 for int8 inputs");
  const bool quads = format & kInt8Inputs;
  const int64_t per_unit = quads ? 4 : 2;
  const int64_t bytes = unit_bytes_of(format);
  TORCH_CHECK(units.dim() == 3 && units.size(2) == bytes && units.is_contiguous() && units.scalar_type() == torch::kUInt8,
              "quant_linear: packed weight is ", units.sizes());
  const int64_t K = units.size(1) * per_unit, tiles = units.size(0);
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && offsets.is_contiguous() && scales.size(0) == tiles &&
                  scales.size(2) == kTile && (offsets.numel() == 0 || offsets.sizes() == scales.sizes()) &&
                  K % scales.size(1) == 0 && scales.scalar_type() == torch::kHalf && offsets.scalar_type() == torch::kHalf,
              "quant_linear: bad scales");
  TORCH_CHECK(n_out <= tiles * kTile, "quant_linear: n_out too large");
  const int64_t groups = scales.size(1), group = K / groups;
  TORCH_CHECK(group % per_unit == 0 && group <= max_group(format), "quant_linear: groups of ", group,
              " inputs are not supported");
  const float* bp = nullptr;
  if (bias != nullptr) {
    TORCH_CHECK(bias->numel() == n_out && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "quant_linear: bad bias");
    bp = bias->data_ptr<float>();
  }
  const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  return {units.data_ptr<uint8_t>(), bits(scales), offsets.numel() ? bits(offsets) : nullptr, bp, n_out, format, K,
          tiles, groups, group};
}

// 32-bit words holding M rows of rounded values (int16, or int8 with int8 inputs).
static int64_t value_words(const QuantWeight& w, int64_t M) { return (M * w.K * ((w.format & kInt8Inputs) ? 1 : 2) + 3) / 4; }

int64_t rounded_words(const QuantWeight& w, int64_t M) { return value_words(w, M) + 3 * M * w.groups; }

RoundedRows rounded_rows_in(float* words, const QuantWeight& w, int64_t M) {
  float* stats = words + value_words(w, M);
  return {words, reinterpret_cast<int32_t*>(stats), stats + M * w.groups, stats + 2 * M * w.groups};
}

namespace {

// What rounding one group of inputs needs: the largest magnitude, whether all are finite, and their
// float sum. The sum runs in kLanes fixed lanes (input kk adds into lane kk % kLanes, in order)
// folded by a fixed tree, so it is the same on every instruction set, for any batch or split.
constexpr int64_t kLanes = 8;
struct GroupStats {
  float amax, sum;
  bool finite;
};

float fold_lanes(const float* s) { return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])); }

GroupStats group_stats(const float* xg, int64_t n) {
  float sums[kLanes] = {}, amax = 0.0f;
  bool finite = true;
  for (int64_t kk = 0; kk < n; ++kk) {
    amax = std::max(amax, std::fabs(xg[kk]));
    sums[kk % kLanes] += xg[kk];
    finite = finite && std::isfinite(xg[kk]);
  }
  return {amax, fold_lanes(sums), finite};
}

// Rounded to the nearest integer (ties to even, as nearbyint in the default rounding mode).
template <typename Q>
int32_t round_group(const float* xg, int64_t n, float inv, Q* qg) {
  int32_t qsum = 0;
  for (int64_t kk = 0; kk < n; ++kk) {
    qg[kk] = static_cast<Q>(std::nearbyint(xg[kk] * inv));
    qsum += qg[kk];
  }
  return qsum;
}

#if defined(__x86_64__)
// group_stats and round_group<int16_t> of n inputs (a multiple of kLanes) in AVX2 registers, the
// lanes one register (GCC leaves the plain loops scalar or folds per group): the same float adds in
// each lane and the same tree, a maximum and integer sums that no order changes.
__attribute__((target("avx2"))) GroupStats group_stats_avx2(const float* xg, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 top = _mm256_setzero_ps(), sum = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < n; kk += kLanes) {
    const __m256 v = _mm256_loadu_ps(xg + kk), a = _mm256_andnot_ps(sign, v);
    top = _mm256_max_ps(a, top);
    sum = _mm256_add_ps(sum, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // inf or NaN
  }
  // the tree of fold_lanes: lanes j + 4, then j + 2, then j + 1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return {_mm_cvtss_f32(m), _mm_cvtss_f32(s), _mm256_movemask_ps(bad) == 0};
}

__attribute__((target("avx2"))) int32_t round_group_avx2(const float* xg, int64_t n, float inv, int16_t* qg) {
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i total = _mm256_setzero_si256();
  for (int64_t kk = 0; kk < n; kk += kLanes) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + kk), scale));
    total = _mm256_add_epi32(total, q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + kk),
                     _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}
#endif

// group_stats, or its AVX2 twin where avx2 (n a multiple of kLanes).
GroupStats stats_of(bool avx2, const float* xg, int64_t n) {
#if defined(__x86_64__)
  if (avx2) return group_stats_avx2(xg, n);
#endif
  (void)avx2;
  return group_stats(xg, n);
}

// round_group, or for int16 its AVX2 twin where avx2 (n a multiple of kLanes).
template <typename Q>
int32_t rounded_group(bool avx2, const float* xg, int64_t n, float inv, Q* qg) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<Q, int16_t>)
    if (avx2) return round_group_avx2(xg, n, inv, qg);
#endif
  (void)avx2;
  return round_group(xg, n, inv, qg);
}

}  // namespace

// Per row and group: the activations rounded to int16 (or int8), their scale, the sum of the
// rounded values and the sum of the float inputs (GroupStats). A group holding inf or NaN gets a
// NaN scale, so it propagates.
void round_rows(int64_t isa, const QuantWeight& w, const float* x, const RoundedRows& r, int64_t i0, int64_t i1) {
  const int64_t K = w.K, groups = w.groups, group = w.group;
  const bool avx2 = isa >= kIsaAvx2 && group % kLanes == 0;  // isa is 0 off x86
  const auto run = [&](auto* xq, float top) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const float* xg = x + m * K + g * group;
      auto* qg = xq + m * K + g * group;
      const GroupStats st = stats_of(avx2, xg, group);
      r.xqsum[i] = rounded_group(avx2, xg, group, st.amax > 0.0f && st.finite ? top / st.amax : 0.0f, qg);
      r.xscale[i] = st.finite ? st.amax / top : std::numeric_limits<float>::quiet_NaN();
      r.xsum[i] = st.sum;
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
                   [&](int64_t i0, int64_t i1) { parts::round_rows(isa, w, xp, rows, i0, i1); });
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.tiles, 4, [&](int64_t t0, int64_t t1) { parts::project_tiles(isa, w, rows, M, yp, t0, t1); });
  return y;
}

}  // namespace
