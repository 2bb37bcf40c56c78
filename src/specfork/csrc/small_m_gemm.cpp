// Small-M fp32 GEMM for CPU decode and verification: y[M, N] = x[M, K] @ W^T (+ bias).
//
// BLAS GEMM on this class of CPU packs the whole weight matrix on every call when M is small,
// which makes verifying a handful of speculative tokens cost several single-token decodes. Here
// the weight is packed once, at load time, into column blocks of 32 outputs laid out
// [num_blocks, K, 32], so each thread streams contiguous memory once per call, whatever M is.
// Each output element is accumulated over k in order with one FMA chain per row, so a row's
// result never depends on the other rows in the batch (batch-invariant by construction).
#include "kernels.h"
#include <ATen/Parallel.h>

namespace {

constexpr int64_t kBlock = 32;  // output columns per packed block

template <int MB>
void block_kernel(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                  float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias) {
  float acc[MB][kBlock];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kBlock; ++j) acc[m][j] = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float* __restrict wk = w + k * kBlock;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const float xv = x[m * ldx + k];
#pragma GCC ivdep
      for (int j = 0; j < kBlock; ++j) acc[m][j] = __builtin_fmaf(xv, wk[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int64_t j = 0; j < ncols; ++j) y[m * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.0f);
}

using Kernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*);
constexpr Kernel kKernels[8] = {block_kernel<1>, block_kernel<2>, block_kernel<3>, block_kernel<4>,
                                block_kernel<5>, block_kernel<6>, block_kernel<7>, block_kernel<8>};

}  // namespace

// weight [N, K] -> packed [ceil(N / 32), K, 32], zero-padded.
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack_weight: 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({blocks, kBlock, k}).transpose(1, 2).contiguous();
}

// x [M, K] float32, packed [blocks, K, 32] -> y [M, n_out]
torch::Tensor small_m_linear(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t n_out,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "small_m_linear: 2-D float32 input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.is_contiguous(), "small_m_linear: bad packed weight");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "small_m_linear: input has ", K, " features, weight expects ", packed.size(1));
  TORCH_CHECK(n_out <= blocks * kBlock, "small_m_linear: n_out too large");
  auto y = torch::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n_out && b.scalar_type() == torch::kFloat32, "small_m_linear: bad bias");
    bp = b.data_ptr<float>();
  }
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t col = blk * kBlock;
      const int64_t ncols = std::min(kBlock, n_out - col);
      const float* w = wp + blk * K * kBlock;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mb = std::min<int64_t>(8, M - m0);
        kKernels[mb - 1](xp + m0 * K, K, w, K, yp + m0 * n_out + col, n_out, ncols, bp ? bp + col : nullptr);
      }
    }
  });
  return y;
}
