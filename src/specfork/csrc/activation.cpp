// SwiGLU's gating for float32 rows on CPU: act = silu(gate) * up, with gate and up the two halves of
// a fused gate_up projection's output [T, 2 I].
//
// silu(g) = g / (1 + exp(-g)), computed as g / (1 + e) for g >= 0 and g e / (1 + e) for g < 0 with
// e = exp(-|g|) from exp_approx.h, so the exponential never overflows and is the same plain float
// arithmetic whichever vector width the compiler picks: an element's value does not depend on
// where a range of elements starts, so the module path (one call) and the one-region forward (the
// elements split over threads) agree bit for bit. ATen's silu went through an op dispatch per call
// and ran on one thread inside the forward's parallel region.
#include "exp_approx.h"
#include "forward_parts.h"

#include <ATen/Parallel.h>

#include <algorithm>

void parts::silu_mul(const float* gate_up, float* act, int64_t inter, int64_t e0, int64_t e1) {
  while (e0 < e1) {  // row by row: each row's run of gates and ups is contiguous
    const int64_t t = e0 / inter, j0 = e0 % inter, j1 = std::min(inter, j0 + (e1 - e0));
    const float* gate = gate_up + t * 2 * inter;
    const float* up = gate + inter;
    float* out = act + t * inter;
    for (int64_t j = j0; j < j1; ++j) {
      const float g = gate[j];
      const float e = exp_nonpositive_scalar(-std::fabs(g));
      const float silu = g >= 0.0f ? g / (1.0f + e) : (g * e) / (1.0f + e);
      out[j] = silu * up[j];
    }
    e0 += j1 - j0;
  }
}

torch::Tensor silu_mul(const torch::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.scalar_type() == torch::kFloat32 && gate_up_in.dim() >= 1 && gate_up_in.size(-1) % 2 == 0,
              "silu_mul: float32 rows of an even width (gate and up side by side)");
  const auto gate_up = gate_up_in.contiguous();
  const int64_t inter = gate_up.size(-1) / 2, rows = inter ? gate_up.numel() / (2 * inter) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto act = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, rows * inter, 32768, [&](int64_t e0, int64_t e1) { parts::silu_mul(gp, ap, inter, e0, e1); });
  return act;
}
