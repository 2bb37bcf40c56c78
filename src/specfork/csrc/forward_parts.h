// The kernels' work split into ranges, for a caller that runs them inside its own parallel region
// (decoder_layer.cpp: one OpenMP region for a whole forward, the threads meeting at barriers instead
// of opening a region per projection). Each function computes exactly what the kernel's own entry
// point computes for the same range, so a value never depends on who computes it.
#pragma once

#include "kernels.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace parts {

// ---- quant_gemm.cpp -------------------------------------------------------------------------------

// A weight packed by pack_quantized, its shapes checked once.
struct QuantWeight {
  const uint8_t* units;
  const uint16_t* scales;   // fp16 bits
  const uint16_t* offsets;  // fp16 bits; nullptr for none
  const float* bias;  // nullptr for none
  int64_t n_out, format, K, tiles, groups, group;
};
QuantWeight quant_weight(const torch::Tensor& units, const torch::Tensor& scales, const torch::Tensor& offsets,
                         int64_t n_out, int64_t format, const torch::Tensor* bias);

// M rows of activations rounded for one weight's groups: the rounded values (int16, or int8 for
// a format with int8 inputs), and per row and group the scale, the sum of the rounded values and
// the sum of the float inputs.
struct RoundedRows {
  void* xq;
  int32_t* xqsum;
  float* xscale;
  float* xsum;
};
// 32-bit words that rounded_rows_in needs for M rows of w's inputs.
int64_t rounded_words(const QuantWeight& w, int64_t M);
RoundedRows rounded_rows_in(float* words, const QuantWeight& w, int64_t M);
// Round the (row, group) pairs i0..i1-1 (pair i: row i / groups, group i % groups) of x [M, K],
// the same on every instruction set isa.
void round_rows(int64_t isa, const QuantWeight& w, const float* x, const RoundedRows& r, int64_t i0, int64_t i1);
// y[:, 32 t0 .. 32 t1) (row stride w.n_out) = rounded rows @ W^T (+ bias), on instruction set isa.
void project_tiles(int64_t isa, const QuantWeight& w, const RoundedRows& r, int64_t M, float* y, int64_t t0,
                   int64_t t1);

// ---- rms_norm.cpp ----------------------------------------------------------------------------------

// y[r] = rms_norm(x[r]) * w for rows r0..r1-1 of n floats.
void rms_norm_rows(const float* x, const float* w, float* y, int64_t n, float eps, int64_t r0, int64_t r1);

// ---- activation.cpp ------------------------------------------------------------------------------

// act[e] = silu(gate) * up for the elements e0..e1-1 of act [T, inter] (element e: row e / inter,
// column e % inter), from gate_up [T, 2 inter].
void silu_mul(const float* gate_up, float* act, int64_t inter, int64_t e0, int64_t e1);

// ---- paged_attention.cpp -------------------------------------------------------------------------

// A work item: queries t0..t1-1 (all of one sequence), one KV head, the chunk of keys from `first`.
struct AttentionItem {
  int64_t t0, t1, kvh, first;
};

// What a step's attention does, the same in every layer: the items and where each query's chunk
// results go. `partial` is scratch space, reused layer after layer.
struct AttentionPlan {
  int64_t T, Hq, Hkv, D, bs, max_blocks;
  const int64_t* tables;
  const int64_t* seq;
  const int64_t* pos;
  float scale;
  std::vector<int64_t> chunk_base;  // query t's (chunk, head) results start at chunk_base[t] * Hq
  std::vector<AttentionItem> items;
  std::vector<int64_t> cost_end;    // the estimated cost of items 0..i (queries x (keys + a constant))
  std::vector<float> partial;
};
// Items [begin, end) of thread `me` of `threads`: contiguous runs of about equal estimated cost (a
// short last chunk counts for little), so no thread waits on another with twice its keys.
std::pair<int64_t, int64_t> share_items(const AttentionPlan& plan, int64_t me, int64_t threads);
// tables/seq_of/pos_of must outlive the plan (it keeps their pointers).
AttentionPlan plan_attention(const torch::Tensor& tables, const torch::Tensor& seq_of, const torch::Tensor& pos_of,
                             int64_t Hq, int64_t Hkv, int64_t D, int64_t bs);
// Items i0..i1-1 of the plan over cache [2, blocks, Hkv, bs, D] for the queries at q: query t's
// Hq heads of D floats side by side from q + t * q_row.
void attention_items(int64_t isa, AttentionPlan& plan, const float* q, int64_t q_row, const torch::Tensor& cache,
                     int64_t i0, int64_t i1);
// out[t] (Hq * D floats) for queries t0..t1-1: their chunks merged in order.
void merge_attention(const AttentionPlan& plan, float* out, int64_t t0, int64_t t1);

}  // namespace parts
