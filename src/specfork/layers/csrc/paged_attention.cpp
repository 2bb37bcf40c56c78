// Paged attention for decode and verification steps on CPU, reading keys and values straight
// from the block-paged KV cache (no gather copy).
//
// Query t belongs to sequence seq[t] and sits at position pos[t]; it attends to that sequence's
// keys 0..pos[t] (causal). Scores, the softmax and the weighted sum are computed for each
// (query, head) alone, over keys in order, so a query's output never depends on which other
// queries or sequences share the call (batch-invariant by construction).
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16;

// q . k with a fixed reduction order (16 independent FMA lanes, then the lanes in order):
// vectorizes, and does not depend on anything but the two vectors.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float lanes[kLanes] = {0.f};
  const int64_t main = n - n % kLanes;
  for (int64_t d0 = 0; d0 < main; d0 += kLanes)
#pragma GCC ivdep
    for (int l = 0; l < kLanes; ++l) lanes[l] = __builtin_fmaf(a[d0 + l], b[d0 + l], lanes[l]);
  for (int64_t d = main; d < n; ++d) lanes[d - main] = __builtin_fmaf(a[d], b[d], lanes[d - main]);
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

}  // namespace

torch::Tensor paged_attention_decode(const torch::Tensor& q_in,         // [T, Hq, D] float32
                                     const torch::Tensor& cache,        // [2, blocks, bs, Hkv, D]
                                     const torch::Tensor& block_tables, // [B, max_blocks] int64
                                     const torch::Tensor& seq_of,       // [T] int64
                                     const torch::Tensor& pos_of,       // [T] int64
                                     double scale) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == torch::kFloat32, "q must be [T, Hq, D] float32");
  TORCH_CHECK(cache.dim() == 5 && cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(), "bad cache");
  const auto q = q_in.contiguous();
  const auto tables = block_tables.contiguous();
  const auto seqs = seq_of.contiguous();
  const auto poss = pos_of.contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = cache.size(1), bs = cache.size(2), Hkv = cache.size(3);
  TORCH_CHECK(cache.size(4) == D && Hq % Hkv == 0, "cache/query shapes disagree");
  const int64_t group = Hq / Hkv, max_blocks = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = cache.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * Hkv * D;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* pp = poss.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, T * Hq, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t work = w0; work < w1; ++work) {
      const int64_t t = work / Hq, h = work % Hq, kvh = h / group;
      const int64_t n = pp[t] + 1;
      TORCH_CHECK(n <= max_blocks * bs, "position beyond the block table");
      const int64_t* table = tp + sp[t] * max_blocks;
      const float* qv = qp + (t * Hq + h) * D;
      scores.resize(n);
      float mx = -INFINITY;
      for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, ++blk) {  // walk the block table
        const float* kb = kp + (table[blk] * bs * Hkv + kvh) * D;
        const int64_t len = std::min(bs, n - j0);
        for (int64_t o = 0; o < len; ++o) {
          const float s = dot(qv, kb + o * Hkv * D, D) * fscale;
          scores[j0 + o] = s;
          mx = s > mx ? s : mx;
        }
      }
      float denom = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = std::exp(scores[j] - mx);
        denom += scores[j];
      }
      float* o = op + (t * Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, ++blk) {
        const float* vb = vp + (table[blk] * bs * Hkv + kvh) * D;
        const int64_t len = std::min(bs, n - j0);
        for (int64_t r = 0; r < len; ++r) {
          const float* vv = vb + r * Hkv * D;
          const float p = scores[j0 + r];
#pragma GCC ivdep
          for (int64_t d = 0; d < D; ++d) o[d] = __builtin_fmaf(p, vv[d], o[d]);
        }
      }
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}
