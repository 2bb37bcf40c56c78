// Paged attention for decode and verification steps on CPU, reading keys and values straight
// from the block-paged KV cache (no gather copy).
//
// Query t belongs to sequence seq[t] and sits at position pos[t]; it attends to that sequence's
// keys 0..pos[t] (causal). Work is split into items of (run of queries, KV head, chunk of kChunk
// keys): a run is up to kRun consecutive queries of one sequence (a verification window; a decode
// step's query alone), and the query heads sharing a KV head (GQA) are computed together, so each
// key and value is read from memory once for every query and head of the item, and long contexts
// are split over threads. Scores take eight keys at a time (eight accumulators over the head
// dimension, reduced by a transpose). Each item produces, per query and head, the running max, the
// sum of exp and the weighted sum of values of the query's keys in the chunk; the chunks are then
// merged in order. Chunk boundaries depend only on the position, every reduction has a fixed
// order, and a query's keys are the same whichever run it sits in, so a query's output never
// depends on which other queries or sequences share the call, nor on the number of threads
// (batch-invariant by construction).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
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

// q . k for one query and eight keys: lane u of the result is q . k[u], summed over d in 8 lanes
// (lane l takes d = l, l + 8, ... in order), then over the lanes as ((0+1)+(2+3))+((4+5)+(6+7)).
// dot_scalar computes the same sums in the same order (for any n, and without AVX2).
inline float dot_scalar(const float* __restrict a, const float* __restrict b, int64_t n) {
  float l[8] = {0.f};
  for (int64_t d = 0; d < n; ++d) l[d % 8] = __builtin_fmaf(a[d], b[d], l[d % 8]);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

inline void dot8(const float* __restrict a, const float* const* b, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 x = _mm256_loadu_ps(a + d);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[u] + d), acc[u]);
    }
    // Transpose and reduce: hadd pairs lanes (0+1, 2+3 of each half), the second hadd adds those
    // pairs, and the last add joins the two 128-bit halves ((0..3) + (4..7)).
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31)));
    return;
  }
#endif
  for (int u = 0; u < 8; ++u) out[u] = dot_scalar(a, b[u], n);
}

// scores[j] *= scale for j < n; returns their max (exact whatever the order).
inline float scale_and_max(float* scores, int64_t n, float scale) {
  int64_t j = 0;
  float mx = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    const __m256 f = _mm256_set1_ps(scale);
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(scores + j), f);
      _mm256_storeu_ps(scores + j, v);
      m = _mm256_max_ps(m, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (float v : lanes) mx = v > mx ? v : mx;
  }
#endif
  for (; j < n; ++j) {
    scores[j] *= scale;
    mx = scores[j] > mx ? scores[j] : mx;
  }
  return mx;
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

// Up to kRun consecutive queries of one sequence (a verification window) form one work item per KV
// head and chunk of keys: each key and value is read from memory once for all of them.
constexpr int64_t kRun = 8;

struct Item {
  int64_t t0, t1;  // queries t0..t1-1, all of one sequence
  int64_t kvh, first;  // KV head; the chunk of keys starting at `first`
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

// o[0..D) += sum over j < len of p[j] * v[j][0..D), as o[d] = fma(p_j, v_j[d], o[d]) in key order.
inline void weighted_values(const float* p, const float* const* v, int64_t len, int64_t D, float* o) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 64 == 0) {  // each 64-wide block of o in 8 registers over all the keys
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m256 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_ps(o + d0 + 8 * r);
      for (int64_t j = 0; j < len; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v[j] + d0 + 8 * r), acc[r]);
      }
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(o + d0 + 8 * r, acc[r]);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < len; ++j) {
#pragma GCC ivdep
    for (int64_t d = 0; d < D; ++d) o[d] = __builtin_fmaf(p[j], v[j][d], o[d]);
  }
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
  TORCH_CHECK(seqs.numel() == T && poss.numel() == T, "one sequence index and position per query");
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

  // Chunks of query t: its keys 0..pos[t] in chunks of kChunk; chunk_base[t]: the first of t's
  // (chunk, head) partial results, which are laid out query by query, chunk by chunk, head by head.
  std::vector<int64_t> chunk_base(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] + 1 <= max_blocks * bs, "position beyond the block table");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < tables.size(0), "sequence index beyond the block tables");
    chunk_base[t + 1] = chunk_base[t] + (pp[t] + kChunk) / kChunk;
  }
  std::vector<Item> items;
  for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
    int64_t n_max = pp[t0] + 1;
    for (t1 = t0 + 1; t1 < T && t1 - t0 < kRun && sp[t1] == sp[t0]; ++t1) n_max = std::max(n_max, pp[t1] + 1);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t first = 0; first < n_max; first += kChunk) items.push_back({t0, t1, kvh, first});
  }
  // per query, chunk and head: max, sum of exp, then D weighted values
  const int64_t stride = D + 2;
  std::vector<float> partial(chunk_base[T] * Hq * stride);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> scores(new float[kChunk + 8]);
    std::unique_ptr<const float*[]> krow(new const float*[kChunk]), vrow(new const float*[kChunk]);
    // float16 rows converted once per item (unused for a float32 cache)
    std::unique_ptr<float[]> converted(new float[std::is_same<Elem, float>::value ? 1 : 2 * kChunk * D]);
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int64_t* table = tp + sp[it.t0] * max_blocks;
      int64_t len_max = 0;  // keys of this chunk seen by the item's furthest query
      for (int64_t t = it.t0; t < it.t1; ++t) len_max = std::max(len_max, std::min(pp[t] + 1 - it.first, kChunk));
      for (int64_t j = 0; j < len_max; ++j) {
        const int64_t key = it.first + j;
        const int64_t row = ((table[key / bs] * bs + key % bs) * Hkv + it.kvh) * D;
        krow[j] = as_float(kp + row, D, converted.get() + j * D);
        vrow[j] = as_float(vp + row, D, converted.get() + (kChunk + j) * D);
      }
      for (int64_t t = it.t0; t < it.t1; ++t) {
        const int64_t len = std::min(pp[t] + 1 - it.first, kChunk);
        if (len <= 0) continue;  // this query's keys end before the chunk
        const int64_t chunk = it.first / kChunk;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = it.kvh * group + g;
          const float* qh = qp + (t * Hq + h) * D;
          float* s = scores.get();
          int64_t j = 0;
          for (; j + 8 <= len; j += 8) dot8(qh, krow.get() + j, D, s + j);
          if (j < len) {  // the last keys, padded to 8 with a repeat of the first (its extra scores unused)
            const float* tail[8];
            for (int u = 0; u < 8; ++u) tail[u] = krow[j + (j + u < len ? u : 0)];
            dot8(qh, tail, D, s + j);
          }
          const float mx = scale_and_max(s, len, fscale);
          float* part = partial.data() + ((chunk_base[t] + chunk) * Hq + h) * stride;
          part[0] = mx;
          part[1] = exp_and_sum(s, len, mx);
          std::fill(part + 2, part + 2 + D, 0.f);
          weighted_values(s, vrow.get(), len, D, part + 2);
        }
      }
    }
  });

  // merge the chunks of each (query, head) in order
  for (int64_t t = 0; t < T; ++t) {
    const int64_t chunks = chunk_base[t + 1] - chunk_base[t];
    for (int64_t h = 0; h < Hq; ++h) {
      const auto part = [&](int64_t c) { return partial.data() + ((chunk_base[t] + c) * Hq + h) * stride; };
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
