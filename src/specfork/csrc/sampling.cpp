// Drawing one token per row from softmax(logits / temperature) in one fused pass per row, for the
// rows that only ask for a temperature (sampling.py's sample_tokens; top-k and top-p rows take the
// PyTorch path). The draw is sampling.py's sample_from_probs, the same two-level inverse transform:
// weights exp(x - max) (unnormalised: only their ratios matter), summed in float64 per block of
// kDrawBlock tokens; the first block whose cumulative weight exceeds u x total, then the first token
// within it. The PyTorch path writes the scaled logits, the probabilities and the block sums as whole
// tensors, each a pass over the vocabulary from memory after a forward has evicted the caches; here a
// row is read twice (its maximum, then its weights) and only one block is written.
// sample_weight_rows is sample_from_probs itself, on weights the caller filtered (top-k, top-p, SD's
// residual max(0, p - q), SSD's reshaped distributions): one pass per row instead of a dozen ops.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "exp_approx.h"
#include "kernels.h"

namespace {

constexpr int64_t kDrawBlock = 256;  // sampling.py's DRAW_BLOCK
constexpr int kLanes = 8;            // float64 partial sums of a block, folded in a fixed order

// exp(x / t - m) of n logits into w (x / t rounded to float first, as the PyTorch path divides).
inline void block_weights(const float* x, int64_t n, float t, float m, float* w) {
  for (int64_t j = 0; j < n; ++j) w[j] = exp_nonpositive_scalar(x[j] / t - m);
}

inline double block_sum(const float* w, int64_t n) {
  double lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(w[j + l]);
  for (int l = 0; j < n; ++j, ++l) lanes[l] += static_cast<double>(w[j]);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// The first index whose cumulative weight exceeds point, or the last index of positive weight where
// rounding put point at or past the total (sampling.py's _first_above).
inline int64_t first_above(const double* cumulative, int64_t n, double point) {
  const double total = cumulative[n - 1];
  int64_t last = 0;
  while (last < n && cumulative[last] < total) ++last;
  const int64_t above = std::upper_bound(cumulative, cumulative + n, point) - cumulative;
  return std::min(above, last);
}

// The largest of n floats, in 16 lanes so that the loop vectorises (a maximum is exact in any order).
inline float row_max(const float* x, int64_t n) {
  constexpr int kMaxLanes = 16;
  float lanes[kMaxLanes];
  for (int l = 0; l < kMaxLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kMaxLanes <= n; j += kMaxLanes)
    for (int l = 0; l < kMaxLanes; ++l) lanes[l] = lanes[l] > x[j + l] ? lanes[l] : x[j + l];
  float top = -std::numeric_limits<float>::infinity();
  for (; j < n; ++j) top = top > x[j] ? top : x[j];
  for (int l = 0; l < kMaxLanes; ++l) top = top > lanes[l] ? top : lanes[l];
  return top;
}

// The token at ``point`` of a row whose cumulative block weights are by_block[0..blocks), given the
// weights of the block it falls in (block_w, filled by ``fill(b, n, block_w)``).
template <class Fill>
int64_t pick(const std::vector<double>& by_block, int64_t blocks, int64_t vocab, double point, Fill fill,
             float* block_w) {
  const int64_t b = first_above(by_block.data(), blocks, point);
  const double before = b > 0 ? by_block[b - 1] : 0.0;
  const int64_t n = std::min(kDrawBlock, vocab - b * kDrawBlock);
  const float* w = fill(b, n, block_w);
  double within[kDrawBlock];
  double c = 0.0;
  for (int64_t j = 0; j < n; ++j) within[j] = c += static_cast<double>(w[j]);
  return b * kDrawBlock + first_above(within, n, point - before);
}

int64_t draw_row(const float* x, int64_t vocab, float t, double u, std::vector<double>& by_block,
                 std::vector<float>& w) {
  float top = row_max(x, vocab);
  const float m = top / t;  // division is monotone: the largest of x / t
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = std::min(kDrawBlock, vocab - b * kDrawBlock);
    block_weights(x + b * kDrawBlock, n, t, m, w.data());
    running += block_sum(w.data(), n);
    by_block[b] = running;
  }
  const auto weights_of = [&](int64_t b, int64_t n, float* out) {
    block_weights(x + b * kDrawBlock, n, t, m, out);
    return static_cast<const float*>(out);
  };
  return pick(by_block, blocks, vocab, u * running, weights_of, w.data());
}

// sample_from_probs on given weights (no exponential): the same blocks, sums and search.
int64_t draw_weights_row(const float* p, int64_t vocab, double u, std::vector<double>& by_block) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    running += block_sum(p + b * kDrawBlock, std::min(kDrawBlock, vocab - b * kDrawBlock));
    by_block[b] = running;
  }
  const auto weights_of = [&](int64_t b, int64_t, float*) { return p + b * kDrawBlock; };
  return pick(by_block, blocks, vocab, u * running, weights_of, nullptr);
}

}  // namespace

namespace {

// The entry points' common checks: [N, V] contiguous float32 rows on the CPU (V > 0) and one float64
// uniform per row.
void check_rows(const char* fn, const torch::Tensor& rows, const torch::Tensor& uniforms) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.device().is_cpu(),
              fn, ": rows must be contiguous float32 [N, V] on the CPU");
  TORCH_CHECK(rows.size(1) > 0, fn, ": an empty vocabulary");
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && uniforms.numel() == rows.size(0) && uniforms.is_contiguous(),
              fn, ": one float64 uniform per row");
}

}  // namespace

torch::Tensor sample_temperature_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                      const torch::Tensor& uniforms) {
  check_rows("sample_temperature_rows", logits, uniforms);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == rows && temperature.is_contiguous(),
              "sample_temperature_rows: one float32 temperature per row");
  auto tokens = torch::empty({rows}, torch::kInt64);
  const float* x = logits.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> by_block((vocab + kDrawBlock - 1) / kDrawBlock);
    std::vector<float> w(kDrawBlock);
    for (int64_t r = r0; r < r1; ++r) out[r] = draw_row(x + r * vocab, vocab, t[r], u[r], by_block, w);
  });
  return tokens;
}

torch::Tensor sample_weight_rows(const torch::Tensor& weights, const torch::Tensor& uniforms) {
  check_rows("sample_weight_rows", weights, uniforms);
  const int64_t rows = weights.size(0), vocab = weights.size(1);
  auto tokens = torch::empty({rows}, torch::kInt64);
  const float* p = weights.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> by_block((vocab + kDrawBlock - 1) / kDrawBlock);
    for (int64_t r = r0; r < r1; ++r) out[r] = draw_weights_row(p + r * vocab, vocab, u[r], by_block);
  });
  return tokens;
}
