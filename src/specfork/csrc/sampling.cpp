// Sampling from logits on the CPU: sampling.py's filter (logits_to_probs: temperature, then top-k,
// then top-p) and its draw (sample_from_probs), fused per row, and SD's verification from logits.
// A row's filter is two floors. Top-k keeps the tokens whose scaled logit s = x / t is at least the
// k-th largest, found among candidates above a rising threshold instead of by sorting the row. Top-p
// keeps, by descending weight exp(s - max), each token while the weight before it is below p x the
// total, and every token as heavy as the last one kept: the weight at or above each of a few bands'
// edges is summed in one pass a band, and only the band where the nucleus ends is gathered and sorted.
// The draw is the same two-level inverse transform as sample_from_probs: weights (unnormalised: only
// their ratios matter) summed in float64 per block of kDrawBlock tokens; the first block whose
// cumulative weight exceeds u x total, then the first token within it. The PyTorch path writes the
// scaled logits, the probabilities and the block sums as whole tensors, each a pass over the
// vocabulary from memory after a forward has evicted the caches, and selects top-k and top-p with
// topk over the whole row; here a row is read a few times, in cache, and only one block is written.
// sample_weight_rows is sample_from_probs itself, on weights the caller computed (SD's residual
// max(0, p - q), SSD's reshaped distributions): one pass per row instead of a dozen ops.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "exp_approx.h"
#include "kernels.h"

namespace {

constexpr int64_t kDrawBlock = 256;  // sampling.py's DRAW_BLOCK

// The blocks of kDrawBlock tokens a row of vocab tokens is drawn by (the last may be short).
constexpr int64_t blocks_of(int64_t vocab) { return (vocab + kDrawBlock - 1) / kDrawBlock; }
constexpr int kLanes = 8;            // float64 partial sums of a block, folded in a fixed order

constexpr float kInf = std::numeric_limits<float>::infinity();

// A row's filter: a token is kept when its scaled logit s = x / t is at least kth (top-k's k-th
// largest s; -inf without top-k) and its weight exp(s - m) at least least (top-p's last kept weight;
// 0 without top-p). m is the row's largest s, always kept. s is x / t rounded to float, as the
// PyTorch path divides.
struct RowFilter {
  float t;
  float m;
  float kth = -kInf;
  float least = 0.0f;

  float weight(float x) const {
    const float s = x / t;
    const float e = exp_nonpositive_scalar(s - m);
    return (s >= kth && e >= least) ? e : 0.0f;
  }
};

// The kept weights of n logits into w.
inline void block_weights(const float* x, int64_t n, const RowFilter& f, float* w) {
  for (int64_t j = 0; j < n; ++j) w[j] = f.weight(x[j]);
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

// The largest of n floats. GCC leaves a plain maximum loop scalar (it may not reorder a float
// maximum without -ffinite-math-only), so AVX2's registers take it (256-bit, as GCC's own vector
// code here); a maximum is exact in any order.
inline float row_max(const float* x, int64_t n) {
  float top = -kInf;
  int64_t j = 0;
#if defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-kInf);
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float v : lanes) top = top > v ? top : v;
#endif
  for (; j < n; ++j) top = top > x[j] ? top : x[j];
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

// max(0, p - q) of n tokens into r, p = the kept weight x scale (p itself where q is null). Its own
// function, flattened, so that the exponential is inlined and the loop vectorised (inside the
// verification's larger function GCC called it, one token at a time).
__attribute__((flatten)) void residual_weights(const float* x, const float* q, int64_t n, const RowFilter& f,
                                               float scale, float* r) {
  if (q == nullptr) {
    for (int64_t j = 0; j < n; ++j) r[j] = f.weight(x[j]) * scale;
  } else {
    for (int64_t j = 0; j < n; ++j) r[j] = std::max(f.weight(x[j]) * scale - q[j], 0.0f);
  }
}

// The total kept weight of a row, summed block by block in float64; by_block (when given) receives the
// running totals at each block's end. The weights go to w: block after block into its first
// kDrawBlock floats, or all of them side by side where whole_row.
double row_total(const float* x, int64_t vocab, const RowFilter& f, float* w, double* by_block,
                 bool whole_row = false) {
  const int64_t blocks = blocks_of(vocab);
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = std::min(kDrawBlock, vocab - b * kDrawBlock);
    float* wb = whole_row ? w + b * kDrawBlock : w;
    block_weights(x + b * kDrawBlock, n, f, wb);
    running += block_sum(wb, n);
    if (by_block != nullptr) by_block[b] = running;
  }
  return running;
}

// Writes the values of x[0..m) (m <= kDrawBlock) that pass keep to out, in order, and returns how
// many: the block's passes are counted first (a loop GCC vectorises), so a block without any costs its
// compares alone, and a block with some is gathered without a branch per value (out must hold m
// floats). keep is taken by value, with its bounds in it: a predicate that read a bound through a
// reference, while the gathered values were written, had it reloaded from memory at every value
// (top-k's rising threshold: 1.4x a row's time where GCC inlined the search).
template <class Keep>
inline int64_t gather_block(const float* x, int64_t m, Keep keep, float* out) {
  int hits = 0;
  for (int64_t i = 0; i < m; ++i) hits += keep(x[i]) ? 1 : 0;
  if (hits == 0) return 0;
  int64_t c = 0;
  for (int64_t i = 0; i < m; ++i) {
    const float v = x[i];
    out[c] = v;
    c += keep(v) ? 1 : 0;
  }
  return c;
}

// The k-th largest of n floats (1 <= k < n; NaN ignored; -inf when fewer than k are numbers): the
// values at or above a threshold are gathered, block by block, and cut to the k largest (with their
// ties) whenever enough have gathered, which raises the threshold.
float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& buf) {
  size_t cap = std::max<size_t>(4 * static_cast<size_t>(k), 256);
  size_t used = 0;
  float floor = -kInf;
  if (buf.size() < cap + kDrawBlock) buf.resize(cap + kDrawBlock);  // a block gathered from used < cap stays within
  const auto cut = [&] {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.begin() + used, std::greater<float>());
    floor = buf[k - 1];
    used = std::partition(buf.begin(), buf.begin() + used, [&](float v) { return v >= floor; }) - buf.begin();
    cap = std::max(cap, 2 * used);  // many ties at the threshold: cut less often
    if (buf.size() < cap + kDrawBlock) buf.resize(cap + kDrawBlock);
  };
  for (int64_t j = 0; j < n; j += kDrawBlock) {
    const auto at_least = [floor](float v) { return v >= floor; };
    used += static_cast<size_t>(gather_block(x + j, std::min(kDrawBlock, n - j), at_least, buf.data() + used));
    if (used >= cap) cut();
  }
  if (used < static_cast<size_t>(k)) return -kInf;
  cut();
  return floor;
}

// Top-p's bands of weight: [1/4, inf), [1/32, 1/4), ... down to the smallest positive float.
constexpr float kBandEdges[] = {0x1p-2f, 0x1p-5f, 0x1p-9f, 0x1p-14f, 0x1p-20f, 0x1p-149f};
constexpr int kBands = sizeof(kBandEdges) / sizeof(kBandEdges[0]);

// at_least[b]: the weight of w[0..n) at or above band b's lower edge, one pass a band, in 16 float
// lanes per block of kDrawBlock tokens (a loop GCC vectorises) and float64 across blocks.
void band_masses(const float* w, int64_t n, double* at_least) {
  constexpr int kL = 16;
  for (int b = 0; b < kBands; ++b) {
    const float edge = kBandEdges[b];
    double total = 0.0;
    int64_t j = 0;
    for (; j + kDrawBlock <= n; j += kDrawBlock) {
      float lanes[kL] = {};
      for (int64_t i = 0; i < kDrawBlock; i += kL)
        for (int l = 0; l < kL; ++l) lanes[l] += w[j + i + l] >= edge ? w[j + i + l] : 0.0f;
      double block = 0.0;
      for (int l = 0; l < kL; ++l) block += static_cast<double>(lanes[l]);
      total += block;
    }
    for (; j < n; ++j) total += w[j] >= edge ? static_cast<double>(w[j]) : 0.0;
    at_least[b] = total;
  }
}

// Top-p's least kept weight, from a row's kept weights w[0..n) (0 outside top-k) and their total: by
// descending weight, a token is kept while the weight before it is below p x total (the first always).
// The search starts in the band of weight where the weight at or above its lower edge reaches p x
// total; only that band's tokens are gathered and sorted (and the next band's, where rounding left the
// walk short). Returns 0 (every token kept) where rounding left the whole row's weight below p x total.
float nucleus_least(const float* w, int64_t n, double total, float p, std::vector<float>& band) {
  const double target = static_cast<double>(p) * total;
  double at_least[kBands];
  band_masses(w, n, at_least);
  int b = 0;
  while (b < kBands - 1 && at_least[b] < target) ++b;
  double before = b > 0 ? at_least[b - 1] : 0.0;  // the weight of every heavier band
  float upper = b > 0 ? kBandEdges[b - 1] : kInf;
  float last = 0.0f;
  if (band.size() < static_cast<size_t>(n)) band.resize(n);  // a band may hold the whole row
  for (; b < kBands; ++b) {
    const float lower = kBandEdges[b];
    const auto in_band = [lower, upper](float v) { return (v >= lower) & (v < upper); };
    int64_t used = 0;
    for (int64_t j = 0; j < n; j += kDrawBlock)
      used += gather_block(w + j, std::min(kDrawBlock, n - j), in_band, band.data() + used);
    std::sort(band.begin(), band.begin() + used, std::greater<float>());
    for (int64_t i = 0; i < used; ++i) {
      const float v = band[i];
      if (!(before < target)) return last;
      last = v;
      before += static_cast<double>(v);
    }
    upper = lower;
  }
  return 0.0f;
}

// The total of a row of weights, block by block in float64; by_block (when given) receives the
// running totals at each block's end.
double weights_total(const float* p, int64_t vocab, double* by_block = nullptr) {
  const int64_t blocks = blocks_of(vocab);
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    running += block_sum(p + b * kDrawBlock, std::min(kDrawBlock, vocab - b * kDrawBlock));
    if (by_block != nullptr) by_block[b] = running;
  }
  return running;
}

// sample_from_probs on given weights (no exponential): the same blocks, sums and search.
int64_t draw_weights_row(const float* p, int64_t vocab, double u, std::vector<double>& by_block) {
  const int64_t blocks = blocks_of(vocab);
  const double running = weights_total(p, vocab, by_block.data());
  const auto weights_of = [&](int64_t b, int64_t, float*) { return p + b * kDrawBlock; };
  return pick(by_block, blocks, vocab, u * running, weights_of, nullptr);
}

// One thread's scratch space for rows of vocab tokens.
struct RowScratch {
  std::vector<double> by_block;
  std::vector<float> w;  // a row's weights, or a block's
  std::vector<float> candidates;
  bool row_weights = false;  // w holds the current row's weights before top-p's cut (row_filter)

  explicit RowScratch(int64_t vocab)
      : by_block(blocks_of(vocab)), w(std::max(kDrawBlock, vocab)) {}
};

// The filter of a row of logits at temperature t with top-k k (0: off) and top-p p (>= 1: off).
RowFilter row_filter(const float* x, int64_t vocab, float t, int64_t k, float p, RowScratch& s) {
  // division by t > 0 is monotone: the largest x / t is the largest x over t, and the k-th likewise
  RowFilter f{t, row_max(x, vocab) / t};
  if (k > 0 && k < vocab) f.kth = kth_largest(x, vocab, k, s.candidates) / t;
  s.row_weights = p < 1.0f;
  if (s.row_weights) {
    const double total = row_total(x, vocab, f, s.w.data(), nullptr, /*whole_row=*/true);
    f.least = nucleus_least(s.w.data(), vocab, total, p, s.candidates);
  }
  return f;
}

// The total kept weight of a row (row_filter's last), its weights left in s.w side by side: the
// weights row_filter computed for top-p, cut at least (the same values block_weights gives), or
// else computed.
double kept_weights(const float* x, int64_t vocab, const RowFilter& f, RowScratch& s) {
  float* w = s.w.data();
  if (!s.row_weights) return row_total(x, vocab, f, w, nullptr, /*whole_row=*/true);
  for (int64_t j = 0; j < vocab; ++j) w[j] = w[j] >= f.least ? w[j] : 0.0f;
  return weights_total(w, vocab);
}

int64_t draw_row(const float* x, int64_t vocab, const RowFilter& f, double u, RowScratch& s) {
  if (s.row_weights) {  // the row's weights are at hand
    kept_weights(x, vocab, f, s);
    return draw_weights_row(s.w.data(), vocab, u, s.by_block);
  }
  const int64_t blocks = blocks_of(vocab);
  const double running = row_total(x, vocab, f, s.w.data(), s.by_block.data());
  const auto weights_of = [&](int64_t b, int64_t n, float* out) {
    block_weights(x + b * kDrawBlock, n, f, out);
    return static_cast<const float*>(out);
  };
  return pick(s.by_block, blocks, vocab, u * running, weights_of, s.w.data());
}

// The entry points' common checks: [N, V] contiguous float32 rows on the CPU (V > 0), one float64
// uniform per row, and each row's settings (below).
void check_rows(const char* fn, const torch::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat32 && rows.is_contiguous() && rows.device().is_cpu(),
              fn, ": rows must be contiguous float32 [N, V] on the CPU");
  TORCH_CHECK(rows.size(1) > 0, fn, ": an empty vocabulary");
}

void check_uniforms(const char* fn, const torch::Tensor& rows, const torch::Tensor& uniforms) {
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && uniforms.numel() == rows.size(0) && uniforms.is_contiguous(),
              fn, ": one float64 uniform per row");
}

// Each row's settings, checked: a float32 temperature (> 0), an int64 top-k (0: off) and a float32
// top-p (1: off) per row.
struct RowSettings {
  const float* t;
  const int64_t* k;
  const float* p;

  RowFilter filter(const float* row, int64_t vocab, int64_t r, RowScratch& s) const {
    return row_filter(row, vocab, t[r], k[r], p[r], s);
  }
};

RowSettings row_settings(const char* fn, const torch::Tensor& rows, const torch::Tensor& temperature,
                         const torch::Tensor& top_k, const torch::Tensor& top_p) {
  const int64_t n = rows.size(0);
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && temperature.numel() == n && temperature.is_contiguous(),
              fn, ": one float32 temperature per row");
  TORCH_CHECK(top_k.scalar_type() == torch::kInt64 && top_k.numel() == n && top_k.is_contiguous(), fn,
              ": one int64 top-k per row");
  TORCH_CHECK(top_p.scalar_type() == torch::kFloat32 && top_p.numel() == n && top_p.is_contiguous(), fn,
              ": one float32 top-p per row");
  return {temperature.data_ptr<float>(), top_k.data_ptr<int64_t>(), top_p.data_ptr<float>()};
}

// f(r, scratch) for every row r, rows split between the threads, with one scratch space per thread.
template <class F>
void each_row(int64_t rows, int64_t vocab, F f) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    RowScratch s(vocab);
    for (int64_t r = r0; r < r1; ++r) f(r, s);
  });
}

// The row's greedy token: its largest logit, the first one on ties, and the first NaN where there is
// one (as sampling.py's greedy_tokens and torch.argmax choose).
int64_t first_argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(row[j])) return j;
    if (row[j] > row[best]) best = j;
  }
  return best;
}

}  // namespace

torch::Tensor sample_logit_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& uniforms) {
  check_rows("sample_logit_rows", logits);
  check_uniforms("sample_logit_rows", logits, uniforms);
  const RowSettings settings = row_settings("sample_logit_rows", logits, temperature, top_k, top_p);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = torch::empty({rows}, torch::kInt64);
  const float* x = logits.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::optional<RowScratch> s;  // only a sampled row needs one
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * vocab;
      if (settings.t[r] == 0.0f) {
        out[r] = first_argmax(row, vocab);
        continue;
      }
      if (!s) s.emplace(vocab);
      out[r] = draw_row(row, vocab, settings.filter(row, vocab, r, *s), u[r], *s);
    }
  });
  return tokens;
}

torch::Tensor filtered_prob_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                 const torch::Tensor& top_k, const torch::Tensor& top_p) {
  check_rows("filtered_prob_rows", logits);
  const RowSettings settings = row_settings("filtered_prob_rows", logits, temperature, top_k, top_p);
  const int64_t vocab = logits.size(1);
  auto probs = torch::empty_like(logits);
  const float* x = logits.data_ptr<float>();
  float* out = probs.data_ptr<float>();
  each_row(logits.size(0), vocab, [&](int64_t r, RowScratch& s) {
    const float* row = x + r * vocab;
    float* w = out + r * vocab;
    const double total = kept_weights(row, vocab, settings.filter(row, vocab, r, s), s);
    for (int64_t j = 0; j < vocab; ++j) w[j] = static_cast<float>(static_cast<double>(s.w[j]) / total);
  });
  return probs;
}

torch::Tensor sample_weight_rows(const torch::Tensor& weights, const torch::Tensor& uniforms) {
  check_rows("sample_weight_rows", weights);
  check_uniforms("sample_weight_rows", weights, uniforms);
  const int64_t vocab = weights.size(1);
  auto tokens = torch::empty({weights.size(0)}, torch::kInt64);
  const float* p = weights.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  each_row(weights.size(0), vocab, [&](int64_t r, RowScratch& s) {
    out[r] = draw_weights_row(p + r * vocab, vocab, u[r], s.by_block);
  });
  return tokens;
}

// Speculative sampling's verification of one sequence (rejection.py's verify_sampled) from the
// target's logits: the target's probability of a proposal is its kept weight (the request's filter)
// over its row's total, computed for the rows verification reaches (it stops at the first rejection);
// only the row where it stops is written out in full, as the residual max(0, p - q) (p without the
// proposal for a one-hot proposal) to draw the recovered token from, and a bonus token is drawn
// straight from the logits. The PyTorch path filters every verify row to probabilities first.
torch::Tensor verify_logit_rows(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p,
                                const torch::Tensor& proposed, const torch::Tensor& draft_probs,
                                const torch::Tensor& accept_uniforms, double last_uniform) {
  const int64_t n = proposed.numel();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(0) == n + 1 && logits.size(1) > 0,
              "verify_logit_rows: logits must be contiguous float32 [n + 1, V] on the CPU");
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(proposed.scalar_type() == torch::kInt64 && proposed.is_contiguous(),
              "verify_logit_rows: proposed must be contiguous int64 [n]");
  const bool one_hot = draft_probs.numel() == 0;
  TORCH_CHECK(one_hot || (draft_probs.scalar_type() == torch::kFloat32 && draft_probs.is_contiguous() &&
                          draft_probs.dim() == 2 && draft_probs.size(0) == n && draft_probs.size(1) == vocab),
              "verify_logit_rows: draft_probs must be empty (one-hot proposals) or contiguous float32 [n, V]");
  TORCH_CHECK(accept_uniforms.scalar_type() == torch::kFloat32 && accept_uniforms.numel() == n &&
                  accept_uniforms.is_contiguous(),
              "verify_logit_rows: one float32 uniform per proposal");
  const float t = static_cast<float>(temperature);
  const float p = static_cast<float>(top_p);
  const float* x = logits.data_ptr<float>();
  const int64_t* tokens = proposed.data_ptr<int64_t>();
  const float* q = one_hot ? nullptr : draft_probs.data_ptr<float>();
  const float* u = accept_uniforms.data_ptr<float>();
  RowScratch s(vocab);
  RowFilter f{t, 0.0f};  // row m's filter, once row m is reached
  double total = 0.0;    // and its total kept weight
  int64_t m = 0;
  for (; m < n; ++m) {  // accept while u * q(x) <= p(x), never where p(x) is 0
    const float* row = x + m * vocab;
    const int64_t token = tokens[m];
    TORCH_CHECK(token >= 0 && token < vocab, "verify_logit_rows: a proposal outside the vocabulary");
    f = row_filter(row, vocab, t, top_k, p, s);
    total = s.row_weights ? kept_weights(row, vocab, f, s) : row_total(row, vocab, f, s.w.data(), nullptr);
    const float p_x = f.weight(row[token]) * static_cast<float>(1.0 / total);
    const float q_x = one_hot ? 1.0f : q[m * vocab + token];
    if (!(u[m] * q_x <= p_x && p_x > 0.0f)) break;
  }
  int64_t last;
  const float* row = x + m * vocab;
  if (m == n) {
    last = draw_row(row, vocab, row_filter(row, vocab, t, top_k, p, s), last_uniform, s);
  } else {
    const float scale = static_cast<float>(1.0 / total);  // p = the kept weight x scale
    float* r = s.w.data();
    residual_weights(row, one_hot ? nullptr : q + m * vocab, vocab, f, scale, r);
    if (one_hot) r[tokens[m]] = 0.0f;
    if (!(weights_total(r, vocab) > 0.0))  // p == q exactly: rejection had probability 0, the residual is empty
      residual_weights(row, nullptr, vocab, f, scale, r);
    last = draw_weights_row(r, vocab, last_uniform, s.by_block);
  }
  auto out = torch::empty({2}, torch::kInt64);
  out.data_ptr<int64_t>()[0] = m;
  out.data_ptr<int64_t>()[1] = last;
  return out;
}
