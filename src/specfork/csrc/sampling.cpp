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

// max(0, p - q) of n tokens into r, p = exp(x / t - m) x scale (p itself where q is null). Its own
// function, flattened, so that the exponential is inlined and the loop vectorised (inside the
// verification's larger function GCC called it, one token at a time).
__attribute__((flatten)) void residual_weights(const float* x, const float* q, int64_t n, float t, float m, float scale,
                                               float* r) {
  if (q == nullptr) {
    for (int64_t j = 0; j < n; ++j) r[j] = exp_nonpositive_scalar(x[j] / t - m) * scale;
  } else {
    for (int64_t j = 0; j < n; ++j) r[j] = std::max(exp_nonpositive_scalar(x[j] / t - m) * scale - q[j], 0.0f);
  }
}

// The total weight of a row, exp(x / t - m) summed block by block in float64; by_block (when given)
// receives the running totals at each block's end.
double row_total(const float* x, int64_t vocab, float t, float m, float* w, double* by_block) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = std::min(kDrawBlock, vocab - b * kDrawBlock);
    block_weights(x + b * kDrawBlock, n, t, m, w);
    running += block_sum(w, n);
    if (by_block != nullptr) by_block[b] = running;
  }
  return running;
}

int64_t draw_row(const float* x, int64_t vocab, float t, double u, std::vector<double>& by_block,
                 std::vector<float>& w) {
  const float m = row_max(x, vocab) / t;  // division is monotone: the largest of x / t
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  const double running = row_total(x, vocab, t, m, w.data(), by_block.data());
  const auto weights_of = [&](int64_t b, int64_t n, float* out) {
    block_weights(x + b * kDrawBlock, n, t, m, out);
    return static_cast<const float*>(out);
  };
  return pick(by_block, blocks, vocab, u * running, weights_of, w.data());
}

// The total of a row of weights, block by block in float64; by_block (when given) receives the
// running totals at each block's end.
double weights_total(const float* p, int64_t vocab, double* by_block = nullptr) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    running += block_sum(p + b * kDrawBlock, std::min(kDrawBlock, vocab - b * kDrawBlock));
    if (by_block != nullptr) by_block[b] = running;
  }
  return running;
}

// sample_from_probs on given weights (no exponential): the same blocks, sums and search.
int64_t draw_weights_row(const float* p, int64_t vocab, double u, std::vector<double>& by_block) {
  const int64_t blocks = (vocab + kDrawBlock - 1) / kDrawBlock;
  const double running = weights_total(p, vocab, by_block.data());
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

// Speculative sampling's verification of one sequence (rejection.py's verify_sampled) from the
// target's logits, for a request that asks for a temperature alone: the target's probability of a
// proposal is exp(x / t - m) over its row's total, computed for the rows verification reaches (it
// stops at the first rejection); only the row where it stops is written out in full, as the
// residual max(0, p - q) (p without the proposal for a one-hot proposal) to draw the recovered
// token from, and a bonus token is drawn straight from the logits. The PyTorch path filters every
// verify row to probabilities first.
torch::Tensor verify_temperature_rows(const torch::Tensor& logits, double temperature, const torch::Tensor& proposed,
                                      const torch::Tensor& draft_probs, const torch::Tensor& accept_uniforms,
                                      double last_uniform) {
  const int64_t n = proposed.numel();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(0) == n + 1 && logits.size(1) > 0,
              "verify_temperature_rows: logits must be contiguous float32 [n + 1, V] on the CPU");
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(proposed.scalar_type() == torch::kInt64 && proposed.is_contiguous(),
              "verify_temperature_rows: proposed must be contiguous int64 [n]");
  const bool one_hot = draft_probs.numel() == 0;
  TORCH_CHECK(one_hot || (draft_probs.scalar_type() == torch::kFloat32 && draft_probs.is_contiguous() &&
                          draft_probs.dim() == 2 && draft_probs.size(0) == n && draft_probs.size(1) == vocab),
              "verify_temperature_rows: draft_probs must be empty (one-hot proposals) or contiguous float32 [n, V]");
  TORCH_CHECK(accept_uniforms.scalar_type() == torch::kFloat32 && accept_uniforms.numel() == n &&
                  accept_uniforms.is_contiguous(),
              "verify_temperature_rows: one float32 uniform per proposal");
  const float t = static_cast<float>(temperature);
  const float* x = logits.data_ptr<float>();
  const int64_t* tokens = proposed.data_ptr<int64_t>();
  const float* q = one_hot ? nullptr : draft_probs.data_ptr<float>();
  const float* u = accept_uniforms.data_ptr<float>();
  std::vector<double> by_block((vocab + kDrawBlock - 1) / kDrawBlock);
  std::vector<float> w(std::max(kDrawBlock, vocab));
  int64_t m = 0;
  float top = 0.0f;     // the largest of row m's x / t, once row m is reached
  double total = 0.0;   // and its total weight
  for (; m < n; ++m) {  // accept while u * q(x) <= p(x)
    const float* row = x + m * vocab;
    const int64_t token = tokens[m];
    TORCH_CHECK(token >= 0 && token < vocab, "verify_temperature_rows: a proposal outside the vocabulary");
    top = row_max(row, vocab) / t;
    total = row_total(row, vocab, t, top, w.data(), nullptr);
    const float p_x = exp_nonpositive_scalar(row[token] / t - top) * static_cast<float>(1.0 / total);
    const float q_x = one_hot ? 1.0f : q[m * vocab + token];
    if (!(u[m] * q_x <= p_x)) break;
  }
  int64_t last;
  if (m == n) {
    last = draw_row(x + n * vocab, vocab, t, last_uniform, by_block, w);
  } else {
    const float* row = x + m * vocab;
    const float scale = static_cast<float>(1.0 / total);  // p = exp(x / t - top) * scale
    float* r = w.data();
    residual_weights(row, one_hot ? nullptr : q + m * vocab, vocab, t, top, scale, r);
    if (one_hot) r[tokens[m]] = 0.0f;
    if (!(weights_total(r, vocab) > 0.0))  // p == q exactly: rejection had probability 0, the residual is empty
      residual_weights(row, nullptr, vocab, t, top, scale, r);
    last = draw_weights_row(r, vocab, last_uniform, by_block);
  }
  auto out = torch::empty({2}, torch::kInt64);
  out.data_ptr<int64_t>()[0] = m;
  out.data_ptr<int64_t>()[1] = last;
  return out;
}
