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
//
// The inner loops (paged_attention_items.inc) are compiled for portable C++, AVX2 and AVX-512
// whatever the build machine's flags, with identical results on each; the best set this CPU runs is
// picked at run time (paged_attention_decode_isa runs a named one, for tests).
#include "exp_approx.h"
#include "forward_parts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 128;  // keys per work item
constexpr int64_t kRun = 8;      // queries of one sequence per work item, at most
constexpr int64_t kItemCost = 16;  // an item's fixed cost in keys (finding and converting its chunk)

// One call's operands. partial holds, per query, chunk and head, {max, sum of exp, D weighted
// values}; chunk_base[t] is the first of query t's (chunk, head) entries.
struct Call {
  const float* q;
  int64_t q_row;  // floats from one query's heads to the next's
  int64_t Hq, D, group, Hkv, bs, max_blocks;
  const void* keys;
  const void* values;
  const int64_t* tables;
  const int64_t* seq;
  const int64_t* pos;
  const int64_t* chunk_base;
  float scale;
  float* partial;
  int64_t stride;
  const parts::AttentionItem* items;
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

// The items' loops once per instruction set (paged_attention_items.inc), each in its own namespace.
#define PA_ISA 0
namespace pa_portable {
#include "paged_attention_items.inc"
}
#undef PA_ISA
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PA_ISA 1
namespace pa_avx2 {
#include "paged_attention_items.inc"
}
#undef PA_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define PA_ISA 2
namespace pa_avx512 {
#include "paged_attention_items.inc"
}
#undef PA_ISA
#pragma GCC pop_options
#endif

namespace {

// isa: quant_gemm.cpp's index (0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI, which attention
// does not use beyond AVX-512).
template <typename Elem>
void run_items(int64_t isa, const Call& c, int64_t i0, int64_t i1) {
  switch (isa) {
#if defined(__x86_64__)
    case 1: pa_avx2::run_items<Elem>(c, i0, i1); return;
    case 2:
    case 3: pa_avx512::run_items<Elem>(c, i0, i1); return;
#endif
    default: pa_portable::run_items<Elem>(c, i0, i1); return;
  }
}

}  // namespace

parts::AttentionPlan parts::plan_attention(const torch::Tensor& tables, const torch::Tensor& seq_of,
                                           const torch::Tensor& pos_of, int64_t Hq, int64_t Hkv, int64_t D,
                                           int64_t bs) {
  TORCH_CHECK(tables.is_contiguous() && seq_of.is_contiguous() && pos_of.is_contiguous() &&
                  tables.scalar_type() == torch::kInt64 && seq_of.scalar_type() == torch::kInt64 &&
                  pos_of.scalar_type() == torch::kInt64,
              "block tables, sequence indices and positions must be contiguous int64");
  const int64_t T = seq_of.numel(), max_blocks = tables.size(1);
  TORCH_CHECK(pos_of.numel() == T, "one sequence index and position per query");
  TORCH_CHECK(Hq % Hkv == 0, "cache/query shapes disagree");
  AttentionPlan plan{T, Hq, Hkv, D, bs, max_blocks, tables.data_ptr<int64_t>(), seq_of.data_ptr<int64_t>(),
                     pos_of.data_ptr<int64_t>(), 1.0f, std::vector<int64_t>(T + 1, 0), {}, {}, {}};
  const int64_t* sp = plan.seq;
  const int64_t* pp = plan.pos;
  // Chunks of query t: its keys 0..pos[t] in chunks of kChunk.
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] + 1 <= max_blocks * bs, "position beyond the block table");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < tables.size(0), "sequence index beyond the block tables");
    plan.chunk_base[t + 1] = plan.chunk_base[t] + (pp[t] + kChunk) / kChunk;
  }
  for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
    int64_t n_max = pp[t0] + 1;
    for (t1 = t0 + 1; t1 < T && t1 - t0 < kRun && sp[t1] == sp[t0]; ++t1) n_max = std::max(n_max, pp[t1] + 1);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t first = 0; first < n_max; first += kChunk) {
        plan.items.push_back({t0, t1, kvh, first});
        const int64_t cost = (t1 - t0) * (std::min(kChunk, n_max - first) + kItemCost);
        plan.cost_end.push_back((plan.cost_end.empty() ? 0 : plan.cost_end.back()) + cost);
      }
  }
  plan.partial.resize(plan.chunk_base[T] * Hq * (D + 2));
  return plan;
}

std::pair<int64_t, int64_t> parts::share_items(const AttentionPlan& plan, int64_t me, int64_t threads) {
  // Thread k starts at the first item whose cost midpoint lies at or past k / threads of the total.
  const auto& end = plan.cost_end;
  const int64_t total = end.empty() ? 0 : end.back(), n = static_cast<int64_t>(end.size());
  const auto start = [&](int64_t k) {  // midpoint of item i: (end[i - 1] + end[i]) / 2
    if (k >= threads) return n;
    int64_t i = 0;
    while (i < n && threads * ((i ? end[i - 1] : 0) + end[i]) < 2 * k * total) ++i;
    return i;
  };
  return {start(me), start(me + 1)};
}

void parts::attention_items(int64_t isa, AttentionPlan& plan, const float* q, int64_t q_row, const torch::Tensor& cache,
                            int64_t i0, int64_t i1) {
  const int64_t num_blocks = cache.size(1);
  const auto call = [&](const auto* kp) {
    return Call{q, q_row, plan.Hq, plan.D, plan.Hq / plan.Hkv, plan.Hkv, plan.bs, plan.max_blocks, kp,
                kp + num_blocks * plan.bs * plan.Hkv * plan.D, plan.tables, plan.seq, plan.pos,
                plan.chunk_base.data(), plan.scale, plan.partial.data(), plan.D + 2, plan.items.data()};
  };
  if (cache.scalar_type() == torch::kHalf) run_items<at::Half>(isa, call(cache.data_ptr<at::Half>()), i0, i1);
  else run_items<float>(isa, call(cache.data_ptr<float>()), i0, i1);
}

// Merge the chunks of each (query, head) in order.
void parts::merge_attention(const AttentionPlan& plan, float* out, int64_t t0, int64_t t1) {
  const int64_t Hq = plan.Hq, D = plan.D, stride = D + 2;
  const float* partial = plan.partial.data();
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t chunks = plan.chunk_base[t + 1] - plan.chunk_base[t];
    for (int64_t h = 0; h < Hq; ++h) {
      const auto part = [&](int64_t c) { return partial + ((plan.chunk_base[t] + c) * Hq + h) * stride; };
      float mx = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part(c)[0]);
      float* o = out + (t * Hq + h) * D;
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
}

namespace {

torch::Tensor attend(const torch::Tensor& q_in, const torch::Tensor& cache, const torch::Tensor& block_tables,
                     const torch::Tensor& seq_of, const torch::Tensor& pos_of, double scale, int64_t isa) {
  const auto q = q_in.contiguous();
  const auto tables = block_tables.contiguous();
  const auto seqs = seq_of.contiguous();
  const auto poss = pos_of.contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(cache.size(4) == D, "cache/query shapes disagree");
  TORCH_CHECK(seqs.numel() == T, "one sequence index and position per query");
  auto plan = parts::plan_attention(tables, seqs, poss, Hq, cache.size(2), D, cache.size(3));
  plan.scale = static_cast<float>(scale);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(plan.items.size()), 1,
                   [&](int64_t i0, int64_t i1) { parts::attention_items(isa, plan, qp, Hq * D, cache, i0, i1); });
  parts::merge_attention(plan, out.data_ptr<float>(), 0, T);
  return out;
}

torch::Tensor attend_on(const torch::Tensor& q_in, const torch::Tensor& cache, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_of, const torch::Tensor& pos_of, double scale, int64_t isa) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == torch::kFloat32, "q must be [T, Hq, D] float32");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "bad cache");
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kHalf,
              "the KV cache must be float32 or float16");
  return attend(q_in, cache, block_tables, seq_of, pos_of, scale, isa);
}

}  // namespace

int64_t attention_chunk() { return kChunk; }

torch::Tensor paged_attention_decode(const torch::Tensor& q_in,         // [T, Hq, D] float32
                                     const torch::Tensor& cache,        // [2, blocks, Hkv, bs, D] float32 or float16
                                     const torch::Tensor& block_tables, // [B, max_blocks] int64
                                     const torch::Tensor& seq_of,       // [T] int64
                                     const torch::Tensor& pos_of,       // [T] int64
                                     double scale) {
  return attend_on(q_in, cache, block_tables, seq_of, pos_of, scale, best_isa_index());
}

torch::Tensor paged_attention_decode_isa(const torch::Tensor& q_in, const torch::Tensor& cache,
                                         const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                         const torch::Tensor& pos_of, double scale, const std::string& isa) {
  return attend_on(q_in, cache, block_tables, seq_of, pos_of, scale, isa_index(isa));
}
