// Small-M GEMM on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), for CPU decode and verification:
// y[M, N] = x[M, K] @ W^T (+ bias), W never materialised in fp32.
//
// GGUF stores each output row in blocks of 32 inputs: Q4_0 w = d * (q - 8), Q4_1 w = d * q + m
// (q in 0..15), Q8_0 w = d * q (q in -128..127), with one fp16 d (and m) per block. At load the
// blocks are repacked, unchanged, into column tiles of 32 outputs: per tile and input k the 32
// quantized values (16 bytes of nibbles for Q4: byte j holds outputs j and j + 16; 32 int8 for Q8),
// and per tile and block of 32 inputs the 32 scales and 32 offsets as fp32 (Q4_0's offset is -8d).
// A call reads each tile once and applies it to every input row, so verifying several tokens costs
// little more than decoding one (see tile_kernel for the arithmetic). Each output is accumulated in
// a fixed order whatever the number of rows: a row's result never depends on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 32;       // output columns per tile
constexpr int64_t kMaxGroup = 128;  // largest quantisation group (inputs sharing one scale)

enum Format : int64_t { kQ4 = 4, kQ8 = 8 };

// q of one input k of a tile as floats (exact: 0..15 or -128..127).
template <int FMT>
inline void unpack_values(const uint8_t* __restrict qk, float* __restrict v) {
  if constexpr (FMT == kQ4) {
#pragma GCC ivdep
    for (int j = 0; j < kTile / 2; ++j) {
      v[j] = static_cast<float>(qk[j] & 15);
      v[j + kTile / 2] = static_cast<float>(qk[j] >> 4);
    }
  } else {
    const int8_t* __restrict qs = reinterpret_cast<const int8_t*>(qk);
#pragma GCC ivdep
    for (int j = 0; j < kTile; ++j) v[j] = static_cast<float>(qs[j]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 versions of the two group dot products below: the same FMAs in the same order (lane j of
// vector c holds output 8c + j), so they give bit-identical results, only faster.
inline __m256 unpack8(const uint8_t* qk, int c, std::integral_constant<int, kQ4>) {
  // outputs 0..15 are the low nibbles of bytes 0..15, outputs 16..31 the high nibbles
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qk + (c % 2) * 8));
  const __m128i nib = c < 2 ? _mm_and_si128(bytes, _mm_set1_epi8(15))
                            : _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
}
inline __m256 unpack8(const uint8_t* qk, int c, std::integral_constant<int, kQ8>) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qk + c * 8));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

inline void group_dot_unpacked(const float* __restrict xm, const float* __restrict v, int64_t group,
                               float* __restrict part) {
  __m256 p0[4], p1[4];
  for (int c = 0; c < 4; ++c) p0[c] = p1[c] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < group; kk += 2) {
    const __m256 xa = _mm256_set1_ps(xm[kk]), xb = _mm256_set1_ps(xm[kk + 1]);
    const float* va = v + kk * kTile;
    for (int c = 0; c < 4; ++c) {
      p0[c] = _mm256_fmadd_ps(xa, _mm256_load_ps(va + 8 * c), p0[c]);
      p1[c] = _mm256_fmadd_ps(xb, _mm256_load_ps(va + kTile + 8 * c), p1[c]);
    }
  }
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(part + 8 * c, _mm256_add_ps(p0[c], p1[c]));
}

template <int FMT>
inline void group_dot_packed(const float* __restrict xm, const uint8_t* __restrict qg, int64_t group,
                             float* __restrict part) {
  constexpr int64_t bytes = FMT == kQ4 ? kTile / 2 : kTile;
  __m256 p0[4], p1[4];
  for (int c = 0; c < 4; ++c) p0[c] = p1[c] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < group; kk += 2) {
    const __m256 xa = _mm256_set1_ps(xm[kk]), xb = _mm256_set1_ps(xm[kk + 1]);
    const uint8_t* qa = qg + kk * bytes;
    const uint8_t* qb = qa + bytes;
    for (int c = 0; c < 4; ++c) {
      p0[c] = _mm256_fmadd_ps(xa, unpack8(qa, c, std::integral_constant<int, FMT>{}), p0[c]);
      p1[c] = _mm256_fmadd_ps(xb, unpack8(qb, c, std::integral_constant<int, FMT>{}), p1[c]);
    }
  }
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(part + 8 * c, _mm256_add_ps(p0[c], p1[c]));
}
#else
// part[j] = sum over the group of x_k * q_kj, from values unpacked to floats (v [group, 32]).
// Two chains (even and odd k) summed at the end; the same order as group_dot_packed.
inline void group_dot_unpacked(const float* __restrict xm, const float* __restrict v, int64_t group,
                               float* __restrict part) {
  float p0[kTile], p1[kTile];
  for (int j = 0; j < kTile; ++j) p0[j] = p1[j] = 0.0f;
  for (int64_t kk = 0; kk < group; kk += 2) {
    const float xa = xm[kk], xb = xm[kk + 1];
    const float* __restrict va = v + kk * kTile;
    const float* __restrict vb = va + kTile;
    for (int j = 0; j < kTile; ++j) {
      p0[j] = __builtin_fmaf(xa, va[j], p0[j]);
      p1[j] = __builtin_fmaf(xb, vb[j], p1[j]);
    }
  }
  for (int j = 0; j < kTile; ++j) part[j] = p0[j] + p1[j];
}

// The same sum straight from the packed values (one row: nothing to reuse).
template <int FMT>
inline void group_dot_packed(const float* __restrict xm, const uint8_t* __restrict qg, int64_t group,
                             float* __restrict part) {
  constexpr int64_t bytes = FMT == kQ4 ? kTile / 2 : kTile;
  float p0[kTile], p1[kTile];
  for (int j = 0; j < kTile; ++j) p0[j] = p1[j] = 0.0f;
  for (int64_t kk = 0; kk < group; kk += 2) {
    alignas(64) float va[kTile], vb[kTile];
    unpack_values<FMT>(qg + kk * bytes, va);
    unpack_values<FMT>(qg + (kk + 1) * bytes, vb);
    const float xa = xm[kk], xb = xm[kk + 1];
    for (int j = 0; j < kTile; ++j) {
      p0[j] = __builtin_fmaf(xa, va[j], p0[j]);
      p1[j] = __builtin_fmaf(xb, vb[j], p1[j]);
    }
  }
  for (int j = 0; j < kTile; ++j) part[j] = p0[j] + p1[j];
}
#endif

// One tile (32 outputs) for MB rows. Within a group of inputs sharing d and o,
//   sum_k x_k (q_k d + o) = d * sum_k x_k q_k + o * sum_k x_k,
// so the inner loop is one convert and one FMA per weight, and the scales are applied once per
// group. For several rows the converted values of a group are kept in an L1 buffer and reused.
// The order of operations is the same for every MB, so a row's result never depends on the others.
template <int MB, int FMT>
void tile_kernel(const float* __restrict x, int64_t ldx, const float* __restrict xsum, int64_t groups,
                 const uint8_t* __restrict q, const float* __restrict scale, const float* __restrict offset, int64_t K,
                 int64_t group, float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias) {
  constexpr int64_t bytes = FMT == kQ4 ? kTile / 2 : kTile;
  float acc[MB][kTile];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kTile; ++j) acc[m][j] = 0.0f;
  alignas(64) float v[kMaxGroup * kTile];
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* __restrict qg = q + g * group * bytes;
    const float* __restrict d = scale + g * kTile;
    const float* __restrict o = offset + g * kTile;
    const int64_t k0 = g * group;
    if constexpr (MB > 1) {
      for (int64_t kk = 0; kk < group; ++kk) unpack_values<FMT>(qg + kk * bytes, v + kk * kTile);
    }
    for (int m = 0; m < MB; ++m) {
      alignas(64) float part[kTile];
      if constexpr (MB > 1) {
        group_dot_unpacked(x + m * ldx + k0, v, group, part);
      } else {
        group_dot_packed<FMT>(x + m * ldx + k0, qg, group, part);
      }
      const float xs = xsum[m * groups + g];
#pragma GCC ivdep
      for (int j = 0; j < kTile; ++j) acc[m][j] = __builtin_fmaf(o[j], xs, __builtin_fmaf(d[j], part[j], acc[m][j]));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int64_t j = 0; j < ncols; ++j) y[m * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.0f);
}

using Kernel = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, const float*, const float*,
                        int64_t, int64_t, float*, int64_t, int64_t, const float*);

template <int FMT>
constexpr Kernel kKernels[8] = {tile_kernel<1, FMT>, tile_kernel<2, FMT>, tile_kernel<3, FMT>, tile_kernel<4, FMT>,
                                tile_kernel<5, FMT>, tile_kernel<6, FMT>, tile_kernel<7, FMT>, tile_kernel<8, FMT>};

}  // namespace

// q [N, K] quantised values (uint8 0..15 for Q4, int8 for Q8), scale/offset [N, K / G] fp32 for groups of G
// inputs -> (packed values [tiles, K, 16 or 32] uint8, scales [tiles, K / G, 32], offsets [tiles, K / G, 32]).
std::vector<torch::Tensor> pack_quantized(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& offset,
                                          int64_t format) {
  TORCH_CHECK(format == kQ4 || format == kQ8, "pack_quantized: format must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 && q.size(1) % scale.size(1) == 0,
              "pack_quantized: q must be [N, K] and scale [N, K / G]");
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1);
  const int64_t tiles = (n + kTile - 1) / kTile, padded_n = tiles * kTile;
  TORCH_CHECK(scale.size(0) == n && offset.sizes() == scale.sizes(), "pack_quantized: scale and offset must be [N, K / G]");
  auto pad = [&](const torch::Tensor& t) {
    auto out = torch::zeros({padded_n, t.size(1)}, t.options());
    out.narrow(0, 0, n).copy_(t);
    return out;
  };
  auto s = pad(scale.to(torch::kFloat32)).view({tiles, kTile, groups}).transpose(1, 2).contiguous();
  auto o = pad(offset.to(torch::kFloat32)).view({tiles, kTile, groups}).transpose(1, 2).contiguous();
  torch::Tensor values;
  if (format == kQ4) {
    auto v = pad(q.to(torch::kUInt8)).view({tiles, kTile, k}).transpose(1, 2).contiguous();  // [tiles, K, 32]
    auto lo = v.narrow(2, 0, kTile / 2), hi = v.narrow(2, kTile / 2, kTile / 2);
    values = lo.bitwise_or(hi.bitwise_left_shift(4)).contiguous();
  } else {
    values = pad(q.to(torch::kInt8)).view({tiles, kTile, k}).transpose(1, 2).contiguous().view(torch::kUInt8);
  }
  return {values, s, o};
}

// x [M, K] float32 -> y [M, n_out]
torch::Tensor quant_linear(const torch::Tensor& x_in, const torch::Tensor& values, const torch::Tensor& scales,
                           const torch::Tensor& offsets, int64_t n_out, int64_t format,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "quant_linear: 2-D float32 input");
  TORCH_CHECK(format == kQ4 || format == kQ8, "quant_linear: format must be 4 or 8");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = values.size(0);
  const int64_t bytes = format == kQ4 ? kTile / 2 : kTile;
  TORCH_CHECK(values.dim() == 3 && values.size(1) == K && values.size(2) == bytes && values.is_contiguous(),
              "quant_linear: input has ", K, " features, packed weight is ", values.sizes());
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && offsets.is_contiguous() && scales.size(0) == tiles &&
                  scales.size(2) == kTile && offsets.sizes() == scales.sizes() && K % scales.size(1) == 0,
              "quant_linear: bad scales");
  TORCH_CHECK(n_out <= tiles * kTile, "quant_linear: n_out too large");
  auto y = torch::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = values.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  torch::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n_out && b.scalar_type() == torch::kFloat32, "quant_linear: bad bias");
    bp = b.data_ptr<float>();
  }
  const Kernel* kernels = format == kQ4 ? kKernels<kQ4> : kKernels<kQ8>;
  const int64_t groups = scales.size(1), group = K / groups;
  TORCH_CHECK(group % 2 == 0 && group <= kMaxGroup, "quant_linear: groups of ", group, " inputs are not supported");
  // Per row and group, the sum of the inputs (sequential, so the same for any batch).
  auto xsum_t = torch::empty({M, groups}, x.options());
  float* xsum = xsum_t.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < group; ++kk) acc += xp[m * K + g * group + kk];
      xsum[m * groups + g] = acc;
    }
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t col = t * kTile;
      const int64_t ncols = std::min(kTile, n_out - col);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mb = std::min<int64_t>(8, M - m0);
        kernels[mb - 1](xp + m0 * K, K, xsum + m0 * groups, groups, qp + t * K * bytes, sp + t * groups * kTile,
                        op + t * groups * kTile, K, group, yp + m0 * n_out + col, n_out, ncols, bp ? bp + col : nullptr);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_quantized", &pack_quantized, "repack GGUF block-quantised rows into 32-column tiles");
  m.def("quant_linear", &quant_linear, "y = x @ W^T (+ bias) for few rows, W block-quantised (Q4 or Q8)");
}
