// RMSNorm for float32 rows on CPU: y = x * rsqrt(mean(x^2) + eps) * w, one pass per row.
//
// PyTorch's CPU rms_norm is a composite of about ten small ops (pow, mean, add, rsqrt, mul, casts),
// which costs tens of microseconds per call at decode sizes; a decode step calls it 61 times.
// Each row is reduced in a fixed order (16 lanes, then the lanes in order), so the result does not
// depend on the other rows (batch-invariant).
#include "forward_parts.h"
#include <ATen/Parallel.h>

#include <cmath>

void parts::rms_norm_rows(const float* xp, const float* wp, float* yp, int64_t n, float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = xp + r * n;
    float lanes[16] = {0.f};
    const int64_t main = n - n % 16;
    for (int64_t i = 0; i < main; i += 16)
#pragma GCC ivdep
      for (int l = 0; l < 16; ++l) lanes[l] = __builtin_fmaf(xr[i + l], xr[i + l], lanes[l]);
    for (int64_t i = main; i < n; ++i) lanes[i - main] = __builtin_fmaf(xr[i], xr[i], lanes[i - main]);
    float ss = 0.f;
    for (int l = 0; l < 16; ++l) ss += lanes[l];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    float* yr = yp + r * n;
#pragma GCC ivdep
    for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] * inv) * wp[i];
  }
}

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "rms_norm: float32 input and weight");
  const int64_t n = x_in.size(-1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight has ", weight.numel(), " elements, rows have ", n);
  const auto x = x_in.contiguous();
  const auto w = weight.contiguous();
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  auto work = [&](int64_t r0, int64_t r1) { parts::rms_norm_rows(xp, wp, yp, n, feps, r0, r1); };
  if (rows * n < 65536) {
    work(0, rows);  // decode sizes: a thread pool round trip costs more than the work
  } else {
    at::parallel_for(0, rows, 16, work);
  }
  return y;
}
