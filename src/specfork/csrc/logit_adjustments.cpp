// The logit adjustments several decode steps in one call apply natively: sampling.py's
// adjust_logits_ for a request with min_tokens, logit_bias, repetition / frequency / presence
// penalties and min_p (its grammar, allowed ids and bad words stay one step a call), with its
// arithmetic in float32 operation for operation (no fused multiply-add: -ffp-contract=off), so a
// row's adjusted logits are bit-identical to adjust_logits_'s. Between steps, advance() adds each
// row's new token to what the penalties read and counts min_tokens down, as the next step's history
// would hold it.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The slices of row b's lists in `ids` / `values`: offsets [B, 5].
enum List { kBias = 0, kHeld = 1, kSeen = 2, kCounted = 3 };

}  // namespace

LogitAdjustments::LogitAdjustments(const std::vector<torch::Tensor>& packed, int64_t rows, int64_t vocab)
    : vocab_(vocab) {
  TORCH_CHECK(packed.size() == 5, "logit adjustments: {settings, held steps, ids, values, offsets}");
  const auto& settings = packed[0];
  const auto& held = packed[1];
  const auto& ids = packed[2];
  const auto& values = packed[3];
  const auto& offsets = packed[4];
  TORCH_CHECK(settings.scalar_type() == torch::kFloat32 && settings.is_contiguous() && settings.dim() == 2 &&
                  settings.size(0) == rows && settings.size(1) == 4,
              "logit adjustments: float32 settings [B, 4] (repetition, frequency, presence, min_p offset)");
  TORCH_CHECK(held.scalar_type() == torch::kInt64 && held.is_contiguous() && held.numel() == rows,
              "logit adjustments: one int64 count of held-back steps per row");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous() && values.scalar_type() == torch::kFloat32 &&
                  values.is_contiguous() && values.numel() == ids.numel(),
              "logit adjustments: int64 ids with a float32 value each");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.is_contiguous() && offsets.dim() == 2 &&
                  offsets.size(0) == rows && offsets.size(1) == 5,
              "logit adjustments: int64 offsets [B, 5]");
  const float* s = settings.data_ptr<float>();
  const int64_t* h = held.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* v = values.data_ptr<float>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  rows_.resize(rows);
  for (int64_t b = 0; b < rows; ++b) {
    Row& row = rows_[b];
    row.repetition = s[4 * b];
    row.frequency = s[4 * b + 1];
    row.presence = s[4 * b + 2];
    row.min_p_offset = s[4 * b + 3];
    row.held_steps = h[b];
    const int64_t* edge = o + 5 * b;
    for (int list = 0; list < 4; ++list) {
      TORCH_CHECK(edge[list] <= edge[list + 1] && edge[list + 1] <= ids.numel() && edge[0] >= 0,
                  "logit adjustments: offsets out of order or range");
      for (int64_t j = edge[list]; j < edge[list + 1]; ++j) {
        if (list == kHeld && id[j] >= vocab) continue;  // a stop id past the LM head's rows: nothing to hold back
        TORCH_CHECK(id[j] >= 0 && id[j] < vocab, "logit adjustments: token id ", id[j], " outside the vocabulary");
        switch (list) {
          case kBias: row.bias.emplace_back(id[j], v[j]); break;
          case kHeld: row.held.push_back(id[j]); break;
          case kSeen: row.seen.push_back(id[j]); break;
          default: row.counted.emplace_back(id[j], v[j]); break;
        }
      }
    }
  }
}

// adjust_logits_'s order: min_tokens' held-back tokens at -inf, logit_bias added, the repetition
// penalty, frequency and presence penalties, then min_p.
void LogitAdjustments::apply(int64_t b, float* x) const {
  const Row& row = rows_[b];
  if (row.held_steps > 0) {
    for (int64_t t : row.held) x[t] = -kInf;
  }
  for (const auto& [t, bias] : row.bias) x[t] += bias;
  if (row.repetition != 1.0f) {
    const float penalty = row.repetition;
    for (int64_t t : row.seen) x[t] = x[t] > 0 ? x[t] / penalty : x[t] * penalty;
  }
  if (row.counts_tokens()) {
    for (const auto& [t, count] : row.counted) {
      const float by_count = row.frequency * count;
      const float present = row.presence * (count > 0 ? 1.0f : 0.0f);
      x[t] = (x[t] - by_count) - present;
    }
  }
  if (!std::isnan(row.min_p_offset)) {
    // NumPy's max: the first NaN, where a row holds one (then nothing is >= the floor)
    float largest = x[0];
    for (int64_t j = 1; j < vocab_ && !std::isnan(largest); ++j) {
      if (std::isnan(x[j]) || x[j] > largest) largest = x[j];
    }
    const float floor = largest + row.min_p_offset;
    for (int64_t j = 0; j < vocab_; ++j) {
      if (!(x[j] >= floor)) x[j] = -kInf;
    }
  }
}

void LogitAdjustments::advance(int64_t b, int64_t token) {
  Row& row = rows_[b];
  if (row.held_steps > 0) --row.held_steps;
  if (row.repetition != 1.0f && std::find(row.seen.begin(), row.seen.end(), token) == row.seen.end()) {
    row.seen.push_back(token);
  }
  if (row.counts_tokens()) {
    for (auto& [t, count] : row.counted) {
      if (t == token) {
        count += 1.0f;
        return;
      }
    }
    row.counted.emplace_back(token, 1.0f);
  }
}

void adjust_logit_rows(torch::Tensor& logits, const std::vector<torch::Tensor>& adjustments) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous(),
              "adjust_logit_rows: float32 rows [N, V]");
  const LogitAdjustments adjust(adjustments, logits.size(0), logits.size(1));
  float* x = logits.data_ptr<float>();
  for (int64_t b = 0; b < logits.size(0); ++b) adjust.apply(b, x + b * logits.size(1));
}
