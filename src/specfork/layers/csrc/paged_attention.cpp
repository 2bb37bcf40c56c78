// Paged attention for decode and verification steps on CPU, reading keys and values straight
// from the block-paged KV cache (no gather copy).
//
// Query t belongs to sequence seq[t] and sits at position pos[t]; it attends to that sequence's
// keys 0..pos[t] (causal). Work is split into items of (query, KV head, chunk of kChunk keys): the
// query heads sharing a KV head (GQA) are computed together, so each key and value is read once
// for all of them, and long contexts are split over threads. Each item produces, per query head,
// the running max, the sum of exp and the weighted sum of values of its keys; the chunks are then
// merged in order. Chunk boundaries depend only on the position, and every reduction has a fixed
// order, so a query's output never depends on which other queries or sequences share the call, nor
// on the number of threads (batch-invariant by construction).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 128;  // keys per work item

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {  // fixed tree: (lanes 0-3 + lanes 4-7), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for x <= 0 (scores minus their max): Cody-Waite reduction and a degree-6 polynomial, within
// 2 ulp of std::exp; below -87 the result is 0 (as std::exp's is, to float precision of the sums).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// q . k over d, with a fixed order: 8 lanes, then a fixed tree over the lanes.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum(acc);
  }
#endif
  float lanes[8] = {0.f};
  for (int64_t d = 0; d < n; ++d) lanes[d % 8] = __builtin_fmaf(a[d], b[d], lanes[d % 8]);
  return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

// dot() of a with four rows b[0..3] at once: the same per-row order (8 lanes over d, then the same
// tree), so each result is bit-identical to dot(a, b[u], n); four independent chains instead of one.
inline void dot4(const float* __restrict a, const float* const* b, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 x = _mm256_loadu_ps(a + d);
      acc0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[0] + d), acc0);
      acc1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[1] + d), acc1);
      acc2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[2] + d), acc2);
      acc3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[3] + d), acc3);
    }
    out[0] = hsum(acc0);
    out[1] = hsum(acc1);
    out[2] = hsum(acc2);
    out[3] = hsum(acc3);
    return;
  }
#endif
  for (int u = 0; u < 4; ++u) out[u] = dot(a, b[u], n);
}

// scores[j] = exp(scores[j] - mx) for j < n; returns their sum (8 lanes, then a fixed tree).
inline float exp_and_sum(float* scores, int64_t n, float mx) {
  int64_t j = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    _mm256_storeu_ps(scores + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  total = hsum(acc);
#endif
  for (; j < n; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    total += scores[j];
  }
  return total;
}

struct Item {
  int64_t t, kvh, first, last;  // query, KV head, keys [first, last)
};

// A cache row as float32: itself for a float32 cache, converted (exactly) into buf for float16.
inline const float* as_float(const float* row, int64_t, float*) { return row; }
inline const float* as_float(const at::Half* row, int64_t n, float* buf) {
  int64_t d = 0;
#if defined(__F16C__)
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
#endif
  for (; d < n; ++d) buf[d] = static_cast<float>(row[d]);
  return buf;
}

}  // namespace

namespace {

template <typename Elem>
torch::Tensor attend(const torch::Tensor& q_in, const torch::Tensor& cache, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_of, const torch::Tensor& pos_of, double scale);

}  // namespace

torch::Tensor paged_attention_decode(const torch::Tensor& q_in,         // [T, Hq, D] float32
                                     const torch::Tensor& cache,        // [2, blocks, bs, Hkv, D] float32 or float16
                                     const torch::Tensor& block_tables, // [B, max_blocks] int64
                                     const torch::Tensor& seq_of,       // [T] int64
                                     const torch::Tensor& pos_of,       // [T] int64
                                     double scale) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == torch::kFloat32, "q must be [T, Hq, D] float32");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "bad cache");
  if (cache.scalar_type() == torch::kHalf) return attend<at::Half>(q_in, cache, block_tables, seq_of, pos_of, scale);
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32, "the KV cache must be float32 or float16");
  return attend<float>(q_in, cache, block_tables, seq_of, pos_of, scale);
}

namespace {

template <typename Elem>
torch::Tensor attend(const torch::Tensor& q_in, const torch::Tensor& cache, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_of, const torch::Tensor& pos_of, double scale) {
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
  const Elem* kp = cache.data_ptr<Elem>();
  const Elem* vp = kp + num_blocks * bs * Hkv * D;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* pp = poss.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  std::vector<Item> items;
  std::vector<int64_t> first_item(T + 1);
  for (int64_t t = 0; t < T; ++t) {
    first_item[t] = static_cast<int64_t>(items.size());
    const int64_t n = pp[t] + 1;
    TORCH_CHECK(pp[t] >= 0 && n <= max_blocks * bs, "position beyond the block table");
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t first = 0; first < n; first += kChunk) items.push_back({t, kvh, first, std::min(n, first + kChunk)});
  }
  first_item[T] = static_cast<int64_t>(items.size());
  // per item and query head of its group: max, sum of exp, then D weighted values
  const int64_t stride = D + 2;
  std::vector<float> partial(items.size() * group * stride);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(group * kChunk);
    std::vector<float> row(4 * D);  // float16 key rows converted
    std::vector<float> values(kChunk * D);  // float16 value rows converted
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int64_t* table = tp + sp[it.t] * max_blocks;
      const int64_t len = it.last - it.first;
      const float* qh = qp + (it.t * Hq + it.kvh * group) * D;
      const auto key_row = [&](int64_t key, float* buf) {
        return as_float(kp + ((table[key / bs] * bs + key % bs) * Hkv + it.kvh) * D, D, buf);
      };
      int64_t j = 0;
      for (; j + 4 <= len; j += 4) {  // scores of every head of the group, each key read once, 4 keys at a time
        const float* kv[4];
        for (int u = 0; u < 4; ++u) kv[u] = key_row(it.first + j + u, row.data() + u * D);
        float s4[4];
        for (int64_t g = 0; g < group; ++g) {
          dot4(qh + g * D, kv, D, s4);
          for (int u = 0; u < 4; ++u) scores[g * kChunk + j + u] = s4[u] * fscale;
        }
      }
      for (; j < len; ++j) {
        const float* kv = key_row(it.first + j, row.data());
        for (int64_t g = 0; g < group; ++g) scores[g * kChunk + j] = dot(qh + g * D, kv, D) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * kChunk;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) mx = s[j] > mx ? s[j] : mx;
        float* part = partial.data() + (i * group + g) * stride;
        part[0] = mx;
        part[1] = exp_and_sum(s, len, mx);
        std::fill(part + 2, part + 2 + D, 0.f);
      }
      // Weighted values: o[d] = fma(p_j, v_j[d], o[d]) over the keys in order, for every head of the group.
      const auto value_row = [&](int64_t j) {
        const int64_t key = it.first + j;
        return as_float(vp + ((table[key / bs] * bs + key % bs) * Hkv + it.kvh) * D, D, values.data() + j * D);
      };
#if defined(__AVX2__) && defined(__FMA__)
      if (D % 64 == 0) {  // each head's 64-wide block of o in 8 registers over all the keys
        const float* vrow[kChunk];
        for (int64_t j = 0; j < len; ++j) vrow[j] = value_row(j);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d0 = 0; d0 < D; d0 += 64) {
            float* o = partial.data() + (i * group + g) * stride + 2 + d0;
            __m256 acc[8];
            for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_ps(o + 8 * r);
            for (int64_t j = 0; j < len; ++j) {
              const __m256 p = _mm256_set1_ps(scores[g * kChunk + j]);
              const float* v = vrow[j] + d0;
              for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * r), acc[r]);
            }
            for (int r = 0; r < 8; ++r) _mm256_storeu_ps(o + 8 * r, acc[r]);
          }
        continue;
      }
#endif
      for (int64_t j = 0; j < len; ++j) {  // each value read once
        const float* vv = value_row(j);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * kChunk + j];
          float* o = partial.data() + (i * group + g) * stride + 2;
#pragma GCC ivdep
          for (int64_t d = 0; d < D; ++d) o[d] = __builtin_fmaf(p, vv[d], o[d]);
        }
      }
    }
  });

  // merge the chunks of each (query, head) in order
  for (int64_t t = 0; t < T; ++t) {
    const int64_t chunks = (first_item[t + 1] - first_item[t]) / Hkv;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kvh = h / group, g = h % group;
      const auto part = [&](int64_t c) { return partial.data() + ((first_item[t] + kvh * chunks + c) * group + g) * stride; };
      float mx = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part(c)[0]);
      float* o = op + (t * Hq + h) * D;
      std::fill(o, o + D, 0.f);
      float denom = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* pc = part(c);
        const float w = chunks == 1 ? 1.0f : std::exp(pc[0] - mx);
        denom = __builtin_fmaf(w, pc[1], denom);
        for (int64_t d = 0; d < D; ++d) o[d] = __builtin_fmaf(w, pc[2 + d], o[d]);
      }
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return out;
}

}  // namespace
