// Llama decoder layers of a decode or verification step in one call from Python, run by one OpenMP
// team in one parallel region:
//   h = x + o_proj(attention(rope(q), rope(k), v))   with q, k, v = qkv_proj(rms_norm(x)) (or of attn_in)
//   y = h + down_proj(silu(gate) * up)               with gate, up = gate_up_proj(rms_norm(h))
//
// Driven from Python a decode step of a small model spent about as long in per-op overhead as in the
// work; chained from C++ with a kernel call per projection it still opened five parallel regions per
// layer (150 a step), allocated a dozen tensors per layer, and left the second thread idle about a
// third of the time. Here the team enters one region for the whole call and the threads meet at a
// barrier between dependent stages: each stage splits its work (rows, (token, head) pairs, output
// tiles, attention items) evenly over the threads, all scratch memory is allocated once per call, and
// a thread that finishes a row-wise stage goes straight on to the next stage of the same rows.
//
// The stages run the kernels' own code on ranges (forward_parts.h) and the same element-wise
// arithmetic as the module path, so the result is bit-identical to it (tests/test_quantized.py):
// the rotation is x * cos + roll(x) * sin_signed with separate roundings (the extension is compiled
// with -ffp-contract=off), the residual adds are plain float adds, and silu(gate) * up is
// activation.cpp's (the module path calls it too). No stage's result depends on how the work is
// split, so neither does the output.
#include "forward_parts.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>

namespace {

// This thread's share [begin, end) of n items split evenly over the team.
struct Range {
  int64_t begin, end;
};
Range share(int64_t n) {
  const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t per = n / threads, extra = n % threads;
  const int64_t begin = me * per + std::min(me, extra);
  return {begin, begin + per + (me < extra ? 1 : 0)};
}

inline void barrier() {
#pragma omp barrier
}

// The weights of one layer: weights = {input norm, post-attention norm, then units, scales, offsets,
// bias (an empty tensor for none) of qkv, o, gate_up, down}; formats = {n_out, format} of each.
struct LayerWeights {
  const float* input_norm;
  const float* post_norm;
  parts::QuantWeight qkv, o, gate_up, down;
};

// The shapes every layer of a call shares.
struct Shapes {
  int64_t T, H, Hq, Hkv, D, inter, attn_width;  // attn_width: qkv's inputs (H, or attn_in's width)
};

// One layer's weights parsed (pointers and formats) with its norms checked against the hidden size H;
// the projections' shapes are checked against a call's shapes by check_layer.
LayerWeights layer_weights(const std::vector<torch::Tensor>& w, const std::vector<int64_t>& f, int64_t H) {
  TORCH_CHECK(w.size() == 18 && f.size() == 8, "decoder layer: 2 norms + 4 projections");
  for (int i = 0; i < 2; ++i)
    TORCH_CHECK(w[i].scalar_type() == torch::kFloat32 && w[i].is_contiguous() && w[i].numel() == H,
                "decoder layer: the norms must be float32 of the hidden size");
  const auto projection = [&](int i) {
    const auto& bias = w[2 + 4 * i + 3];
    return parts::quant_weight(w[2 + 4 * i], w[2 + 4 * i + 1], w[2 + 4 * i + 2], f[2 * i], f[2 * i + 1],
                               bias.numel() ? &bias : nullptr);
  };
  return LayerWeights{w[0].data_ptr<float>(), w[1].data_ptr<float>(), projection(0), projection(1), projection(2),
                      projection(3)};
}

void check_layer(const LayerWeights& lw, const Shapes& s) {
  TORCH_CHECK(lw.qkv.K == s.attn_width && lw.qkv.n_out == (s.Hq + 2 * s.Hkv) * s.D, "qkv projection is ", lw.qkv.K,
              " -> ", lw.qkv.n_out);
  TORCH_CHECK(lw.o.K == s.Hq * s.D && lw.o.n_out == s.H, "o projection has ", lw.o.n_out, " outputs, the hidden size is ", s.H);
  TORCH_CHECK(lw.gate_up.K == s.H && lw.gate_up.n_out == 2 * s.inter, "gate_up projection is ", lw.gate_up.K, " -> ",
              lw.gate_up.n_out);
  TORCH_CHECK(lw.down.K == s.inter && lw.down.n_out == s.H, "down projection has ", lw.down.n_out, " outputs");
}

std::vector<LayerWeights> layers_of(const std::vector<std::vector<torch::Tensor>>& weights,
                                    const std::vector<std::vector<int64_t>>& formats, int64_t H) {
  TORCH_CHECK(!weights.empty() && formats.size() == weights.size(), "decoder layers: one format list per layer");
  std::vector<LayerWeights> layers;
  for (size_t i = 0; i < weights.size(); ++i) layers.push_back(layer_weights(weights[i], formats[i], H));
  return layers;
}

// Scratch memory of a call, sized for T rows: every stage's output, and the rounded activations of
// the projection in flight.
struct Scratch {
  torch::Tensor memory;
  float *normed, *qkv, *attn, *h, *gate_up, *act, *rounded;

  Scratch(const Shapes& s, const std::vector<LayerWeights>& layers, const std::vector<const parts::QuantWeight*>& extra) {
    int64_t rounded_words = 0;
    for (const auto* w : extra) rounded_words = std::max(rounded_words, parts::rounded_words(*w, s.T));
    for (const auto& l : layers)
      for (const auto* w : {&l.qkv, &l.o, &l.gate_up, &l.down})
        rounded_words = std::max(rounded_words, parts::rounded_words(*w, s.T));
    const int64_t sizes[] = {s.T * s.H, s.T * (s.Hq + 2 * s.Hkv) * s.D, s.T * s.Hq * s.D, s.T * s.H,
                             s.T * 2 * s.inter, s.T * s.inter, rounded_words};
    int64_t total = 0;
    for (int64_t n : sizes) total += (n + 15) / 16 * 16;  // 64-byte aligned starts
    memory = torch::empty({total}, torch::kFloat32);
    float* p = memory.data_ptr<float>();
    float** slots[] = {&normed, &qkv, &attn, &h, &gate_up, &act, &rounded};
    for (int i = 0; i < 7; ++i) {
      *slots[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
    }
  }
};

// What a call's layers share besides the weights.
struct Step {
  Shapes s;
  float eps;
  const float* cos;  // the rotation tables [P, D], read at each token's position
  const float* sin;
  const int64_t* pos;   // position of each token
  const int64_t* slot;  // cache slot of each token
  int64_t isa;
  parts::AttentionPlan* plan;
  Scratch* scratch;
};

// This thread's tiles of projection w of M rounded rows.
void project(const Step& st, const parts::QuantWeight& w, const parts::RoundedRows& rows, int64_t M, float* y) {
  const auto tiles = share(w.tiles);
  parts::project_tiles(st.isa, w, rows, M, y, tiles.begin, tiles.end);
}

// Rows rows.begin..rows.end-1 of x [M, K] through projection w into y [M, n_out], M rows in all:
// this thread rounds its rows (into the scratch's rounded rows), the team meets, then each thread
// computes its tiles of every row.
void project_rows(const Step& st, const parts::QuantWeight& w, const float* x, int64_t M, Range rows, float* y) {
  const auto rounded = parts::rounded_rows_in(st.scratch->rounded, w, M);
  parts::round_rows(st.isa, w, x, rounded, rows.begin * w.groups, rows.end * w.groups);
  barrier();
  project(st, w, rounded, M, y);
}

// New keys and values into their cache slots (rounded to nearest-even for a float16 cache, as
// Tensor.to(float16) rounds on the module path).
template <typename Elem>
void store_kv(const float* k, const float* v, Elem* cache, int64_t slots_total, int64_t slot, int64_t kvh,
              int64_t Hkv, int64_t bs, int64_t D) {
  Elem* kc = cache + ((slot / bs * Hkv + kvh) * bs + slot % bs) * D;  // [block, KV head, offset, D]
  Elem* vc = kc + slots_total * Hkv * D;
  for (int64_t i = 0; i < D; ++i) {
    kc[i] = static_cast<Elem>(k[i]);
    vc[i] = static_cast<Elem>(v[i]);
  }
}

// One layer, run by every thread of the team: x [T, H] -> y [T, H]. attn_in: what attention reads
// instead of rms_norm(x) (nullptr for a Llama layer). On return this thread's rows of y are final;
// the other rows are final once the team next meets.
void run_layer(const Step& st, const LayerWeights& w, const float* x, const float* attn_in,
               const torch::Tensor& cache, float* y) {
  const Shapes& s = st.s;
  Scratch& m = *st.scratch;
  const Range rows = share(s.T);
  const int64_t width = (s.Hq + 2 * s.Hkv) * s.D;

  // attention block: its input rounded for qkv
  const float* a = attn_in;
  if (a == nullptr) {
    parts::rms_norm_rows(x, w.input_norm, m.normed, s.H, st.eps, rows.begin, rows.end);
    a = m.normed;
  }
  project_rows(st, w.qkv, a, s.T, rows, m.qkv);
  barrier();
  // rotate the q and k heads: x * cos + roll(x, D / 2) * sin_signed; then the cache takes k and v
  const Range heads = share(s.T * (s.Hq + s.Hkv));
  const int64_t half = s.D / 2, slots_total = cache.size(1) * cache.size(3);
  std::vector<float> head(s.D);
  for (int64_t i = heads.begin; i < heads.end; ++i) {
    const int64_t t = i / (s.Hq + s.Hkv), hd = i % (s.Hq + s.Hkv);
    float* v = m.qkv + t * width + hd * s.D;
    const float* c = st.cos + st.pos[t] * s.D;
    const float* sn = st.sin + st.pos[t] * s.D;
    std::memcpy(head.data(), v, s.D * sizeof(float));
    for (int64_t j = 0; j < half; ++j) v[j] = head[j] * c[j] + head[j + half] * sn[j];
    for (int64_t j = half; j < s.D; ++j) v[j] = head[j] * c[j] + head[j - half] * sn[j];
    if (hd >= s.Hq) {
      const int64_t kvh = hd - s.Hq;
      const float* value = m.qkv + t * width + (s.Hq + s.Hkv + kvh) * s.D;
      if (cache.scalar_type() == torch::kHalf)
        store_kv(v, value, cache.data_ptr<at::Half>(), slots_total, st.slot[t], kvh, s.Hkv, cache.size(3), s.D);
      else
        store_kv(v, value, cache.data_ptr<float>(), slots_total, st.slot[t], kvh, s.Hkv, cache.size(3), s.D);
    }
  }
  barrier();
  const auto items = parts::share_items(*st.plan, omp_get_thread_num(), omp_get_num_threads());
  parts::attention_items(st.isa, *st.plan, m.qkv, width, cache, items.first, items.second);
  barrier();
  parts::merge_attention(*st.plan, m.attn, rows.begin, rows.end);
  project_rows(st, w.o, m.attn, s.T, rows, m.h);
  barrier();

  // MLP block: h = x + o, its norm rounded for gate_up
  for (int64_t i = rows.begin * s.H; i < rows.end * s.H; ++i) m.h[i] = x[i] + m.h[i];
  parts::rms_norm_rows(m.h, w.post_norm, m.normed, s.H, st.eps, rows.begin, rows.end);
  project_rows(st, w.gate_up, m.normed, s.T, rows, m.gate_up);
  barrier();
  // silu(gate) * up and its rounding for down, split by down's (row, group) pairs: a thread rounds
  // exactly the elements it has just computed, so the two stages need no barrier between them.
  const Range pairs = share(s.T * w.down.groups);
  parts::silu_mul(m.gate_up, m.act, s.inter, pairs.begin * w.down.group, pairs.end * w.down.group);
  const auto rounded = parts::rounded_rows_in(m.rounded, w.down, s.T);
  parts::round_rows(st.isa, w.down, m.act, rounded, pairs.begin, pairs.end);
  barrier();
  project(st, w.down, rounded, s.T, y);
  barrier();
  for (int64_t i = rows.begin * s.H; i < rows.end * s.H; ++i) y[i] = m.h[i] + y[i];
}

// A projection given as {units, scales, offsets, bias or an empty tensor} and {n_out, format}.
parts::QuantWeight projection_of(const std::vector<torch::Tensor>& w, const std::vector<int64_t>& f, const char* what) {
  TORCH_CHECK(w.size() == 4 && f.size() == 2, what, ": units, scales, offsets, bias and n_out, format");
  return parts::quant_weight(w[0], w[1], w[2], f[0], f[1], w[3].numel() ? &w[3] : nullptr);
}

// Everything a call needs before its team starts: shapes, weights and attention plan checked (no
// error may leave a parallel region).
struct Call {
  const std::vector<LayerWeights>& layers;  // parsed by layers_of, checked against this call's shapes here
  torch::Tensor cos, sin, slots, tables, seqs, poss;
  parts::AttentionPlan plan;
  std::unique_ptr<Scratch> scratch;
  Step step;

  Call(const torch::Tensor& x, int64_t attn_width, const std::vector<LayerWeights>& layers_in,
       const std::vector<torch::Tensor>& caches, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
       const torch::Tensor& block_tables, const torch::Tensor& seq_of, const torch::Tensor& pos_of,
       const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
       const std::vector<const parts::QuantWeight*>& extra = {})
      : layers(layers_in), cos(cos_in.contiguous()), sin(sin_in.contiguous()), slots(slot_mapping.contiguous()),
        tables(block_tables.contiguous()), seqs(seq_of.contiguous()), poss(pos_of.contiguous()) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [T, H] float32");
    TORCH_CHECK(!layers.empty() && caches.size() == layers.size(), "decoder layers: one cache per layer");
    const auto& cache0 = caches[0];
    for (const auto& cache : caches)
      TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.sizes() == cache0.sizes() &&
                      cache.scalar_type() == cache0.scalar_type() &&
                      (cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kHalf),
                  "bad cache");
    const int64_t T = x.size(0), D = cache0.size(4);
    TORCH_CHECK(cache0.size(2) == num_kv_heads && D % 2 == 0 && num_heads % num_kv_heads == 0,
                "cache shape disagrees with the heads");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                    cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
                "rope tables: float32 [positions, head_dim]");
    TORCH_CHECK(slots.numel() == T && slots.scalar_type() == torch::kInt64, "cache slots: one int64 per token");
    const int64_t slots_total = cache0.size(1) * cache0.size(3);
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_total, "cache slot out of range");
    const Shapes s{T, x.size(1), num_heads, num_kv_heads, D, layers[0].gate_up.n_out / 2, attn_width};
    for (const auto& layer : layers) check_layer(layer, s);
    TORCH_CHECK(seqs.numel() == T && poss.numel() == T && poss.scalar_type() == torch::kInt64,
                "one sequence index and position per token");
    const int64_t* pos = poss.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position past the rope tables");
    plan = parts::plan_attention(tables, seqs, poss, num_heads, num_kv_heads, D, cache0.size(3));
    plan.scale = static_cast<float>(scale);
    scratch = std::make_unique<Scratch>(s, layers, extra);
    step = Step{s, static_cast<float>(eps), cos.data_ptr<float>(), sin.data_ptr<float>(), pos, slot, best_isa_index(),
                &plan, scratch.get()};
  }
};

}  // namespace

torch::Tensor decoder_layer_decode(const torch::Tensor& x_in, const torch::Tensor& attn_in,
                                   const std::vector<torch::Tensor>& weights,
                                   const std::vector<int64_t>& formats, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                   const torch::Tensor& pos_of, const torch::Tensor& slot_mapping,
                                   int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  const auto x = x_in.contiguous();
  torch::Tensor a;
  if (attn_in.numel()) {
    a = attn_in.contiguous();
    TORCH_CHECK(a.dim() == 2 && a.size(0) == x.size(0) && a.scalar_type() == torch::kFloat32,
                "attn_in must be [T, K] float32");
  }
  const auto layers = layers_of({weights}, {formats}, x.size(1));
  Call call(x, a.defined() ? a.size(1) : x.size(1), layers, {cache}, cos, sin, block_tables, seq_of, pos_of,
            slot_mapping, num_heads, num_kv_heads, eps, scale);
  auto y = torch::empty_like(x);
  const float* ap = a.defined() ? a.data_ptr<float>() : nullptr;
#pragma omp parallel num_threads(at::get_num_threads())
  run_layer(call.step, call.layers[0], x.data_ptr<float>(), ap, cache, y.data_ptr<float>());
  return y;
}

struct HeldWeights::Parsed {
  std::vector<LayerWeights> layers;
  std::vector<parts::QuantWeight> projections;
  std::vector<const float*> floats;
  std::vector<int64_t> float_rows;   // each float tensor's rows of the hidden size (1 for a norm)
  std::vector<const void*> pointers;  // every held tensor's data pointer when parsed
  // Their storages, kept alive with the snapshot: a storage replaced while a forward runs without
  // Python's lock is not freed under it, and no new storage can take an old one's address unseen.
  std::vector<c10::Storage> storages;
};

HeldWeights::HeldWeights(std::vector<std::vector<torch::Tensor>> layers, std::vector<std::vector<int64_t>> layer_formats,
                         std::vector<std::vector<torch::Tensor>> projections,
                         std::vector<std::vector<int64_t>> projection_formats, std::vector<torch::Tensor> floats,
                         int64_t hidden)
    : layers_(std::move(layers)), layer_formats_(std::move(layer_formats)), projections_(std::move(projections)),
      projection_formats_(std::move(projection_formats)), floats_(std::move(floats)), hidden_(hidden) {
  TORCH_CHECK(projections_.size() == projection_formats_.size(), "held weights: one format per projection");
  TORCH_CHECK(hidden_ > 0, "held weights: the hidden size must be positive, got ", hidden_);
  parse();  // every check now, so that bad weights fail where the model is built
}

void HeldWeights::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  parsed_.reset();
}

// Every held tensor, in a fixed order.
template <typename F>
void HeldWeights::each_tensor(F f) const {
  for (const auto* group : {&layers_, &projections_})
    for (const auto& tensors : *group)
      for (const auto& t : tensors) f(t);
  for (const auto& t : floats_) f(t);
}

// The held tensors' data pointers: a tensor whose storage was replaced since (its .data set anew)
// changes them.
std::vector<const void*> HeldWeights::pointers() const {
  std::vector<const void*> out;
  each_tensor([&](const torch::Tensor& t) { out.push_back(t.data_ptr()); });
  return out;
}

void HeldWeights::parse() {
  auto parsed = std::make_shared<Parsed>();
  if (!layers_.empty()) parsed->layers = layers_of(layers_, layer_formats_, hidden_);
  for (size_t i = 0; i < projections_.size(); ++i)
    parsed->projections.push_back(projection_of(projections_[i], projection_formats_[i], "a held projection"));
  for (const auto& t : floats_) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() >= 1 && t.size(-1) == hidden_,
                "held weights: norms and embeddings must be contiguous float32 of the hidden size ", hidden_);
    parsed->floats.push_back(t.data_ptr<float>());
    parsed->float_rows.push_back(t.numel() / hidden_);
  }
  parsed->pointers = pointers();
  each_tensor([&](const torch::Tensor& t) { parsed->storages.push_back(t.storage()); });
  parsed_ = std::move(parsed);
}

std::shared_ptr<const HeldWeights::Parsed> HeldWeights::parsed() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!parsed_ || pointers() != parsed_->pointers) parse();
  return parsed_;
}

namespace {
// {v}, or no entries where the thing it describes is absent (an optional projection).
template <typename T>
std::vector<std::vector<T>> one_or_none(std::vector<T> v, bool present) {
  if (!present) return {};
  return {std::move(v)};
}
int64_t embedding_width(const torch::Tensor& embedding) {
  TORCH_CHECK(embedding.dim() == 2, "Eagle3Step: the embedding must be [V, H], got ", embedding.sizes());
  return embedding.size(1);
}
}  // namespace

DecoderStack::DecoderStack(std::vector<std::vector<torch::Tensor>> layer_weights,
                           std::vector<std::vector<int64_t>> layer_formats, int64_t num_heads, int64_t num_kv_heads,
                           double eps, double scale, torch::Tensor final_norm, double final_eps,
                           std::vector<torch::Tensor> head_weights, std::vector<int64_t> head_format)
    : weights_(std::move(layer_weights), std::move(layer_formats), one_or_none(head_weights, !head_weights.empty()),
               one_or_none(std::move(head_format), !head_weights.empty()), {final_norm}, final_norm.numel()),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps), scale_(scale), final_eps_(final_eps) {
  TORCH_CHECK(final_norm.dim() == 1, "DecoderStack: the final norm must be one vector");
  const auto parsed = weights_.parsed();
  TORCH_CHECK(!parsed->layers.empty(), "DecoderStack: no layers");
  for (const auto& head : parsed->projections)
    TORCH_CHECK(head.K == final_norm.numel(), "DecoderStack: the LM head reads ", head.K,
                " features, the hidden size is ", final_norm.numel());
  weights_.release();
}

// Every decoder layer of a decode or verification step, the final norm and optionally the LM head,
// in one call and one parallel region. Returns {hidden after the final norm, features, logits}:
// features, with `capture` (layer indices), the inputs of those layers concatenated in that order
// ([T, |capture| H]: an EAGLE-3 head's features), else an empty tensor; logits [T, V] of every row
// with `logits` and an LM head, else an empty tensor.
std::vector<torch::Tensor> DecoderStack::forward(const torch::Tensor& x_in, const std::vector<torch::Tensor>& caches,
                                                 const torch::Tensor& cos, const torch::Tensor& sin,
                                                 const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                                 const torch::Tensor& pos_of, const torch::Tensor& slot_mapping,
                                                 const std::vector<int64_t>& capture, bool with_logits) {
  const auto parsed = weights_.parsed();  // held until the call returns
  const auto& layers = parsed->layers;
  const auto x = x_in.contiguous();
  const int64_t L = static_cast<int64_t>(layers.size()), T = x.size(0), H = x.size(1);
  TORCH_CHECK(parsed->float_rows[0] == 1, "DecoderStack: the final norm must be one vector");
  TORCH_CHECK(H == weights_.hidden(), "DecoderStack: the input has ", H, " features, the model ", weights_.hidden());
  const parts::QuantWeight* head = with_logits && !parsed->projections.empty() ? &parsed->projections[0] : nullptr;
  if (head) TORCH_CHECK(head->K == H, "DecoderStack: the LM head reads ", head->K, " features, the input has ", H);
  std::vector<const parts::QuantWeight*> extra;
  if (head) extra.push_back(head);
  Call call(x, H, layers, caches, cos, sin, block_tables, seq_of, pos_of, slot_mapping, num_heads_, num_kv_heads_,
            eps_, scale_, extra);
  for (int64_t c : capture)
    TORCH_CHECK(c >= 0 && c < L, "DecoderStack: capture names a layer it does not have");
  auto buffers = torch::empty({2, T, H}, x.options());
  auto hidden = torch::empty_like(x);
  auto features = torch::empty({capture.empty() ? 0 : T, static_cast<int64_t>(capture.size()) * H}, x.options());
  auto logits = torch::empty({head ? T : 0, head ? head->n_out : 0}, x.options());
  const int64_t width = features.size(1);
  float* feature_rows = features.data_ptr<float>();
  const float* norm = parsed->floats[0];
  const float feps = static_cast<float>(final_eps_);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const Range rows = share(T);
    const float* in = x.data_ptr<float>();
    for (int64_t i = 0; i < L; ++i) {
      for (size_t c = 0; c < capture.size(); ++c)
        if (capture[c] == i)
          for (int64_t t = rows.begin; t < rows.end; ++t)
            std::memcpy(feature_rows + t * width + c * H, in + t * H, H * sizeof(float));
      float* out = buffers.data_ptr<float>() + (i % 2) * T * H;
      run_layer(call.step, call.layers[i], in, nullptr, caches[i], out);
      in = out;
    }
    parts::rms_norm_rows(in, norm, hidden.data_ptr<float>(), H, feps, rows.begin, rows.end);
    if (head) {
      project_rows(call.step, *head, hidden.data_ptr<float>(), T, rows, logits.data_ptr<float>());
    }
  }
  return {hidden, features, logits};
}

// `steps` decode steps of B sequences in one call, each step's tokens the next one's input (their
// embedding rows): what `steps` calls of forward, each followed by the sampler's choice of a token per
// row (sample_logit_rows: the argmax of a greedy row, temperature 0, else a draw with the row's filter and
// its uniform of that step) and the embedding lookup, compute, with no Python between them; with
// `adjustments` (LogitAdjustments' packed form; empty: none) each step's logits are adjusted before
// the choice, each row's token then added to its history; with `logprobs` (per row the alternatives it
// wants reported, -1: none; empty: none) the reporting rows' log-probabilities of their own logits are
// taken before the adjustments, as token_logprobs takes them. x [B, H]
// is the first step's input; pos_of, slot_mapping and uniforms [steps, B] the positions, cache slots
// and uniforms of each step's rows (the block tables cover the last); seq_of, temperature, top_k and
// top_p [B]. Returns {tokens [steps, B], features [steps * B, |capture| H] (step by step, forward's
// features of each step's rows; empty without `capture`), and with a reporting row, [steps, B] each
// step's token's log-probability, [steps, B, the most alternatives a row wants] the alternatives' ids
// and log-probabilities, most likely first (a row's first n are its own; all empty without)}.
std::vector<torch::Tensor> DecoderStack::decode_steps(const torch::Tensor& x, const torch::Tensor& embedding,
                                                      const std::vector<torch::Tensor>& caches, const torch::Tensor& cos,
                                                      const torch::Tensor& sin, const torch::Tensor& block_tables,
                                                      const torch::Tensor& seq_of, const torch::Tensor& pos_of,
                                                      const torch::Tensor& slot_mapping, const torch::Tensor& temperature,
                                                      const torch::Tensor& top_k, const torch::Tensor& top_p,
                                                      const torch::Tensor& uniforms, const std::vector<int64_t>& capture,
                                                      const std::vector<torch::Tensor>& adjustments,
                                                      const std::vector<int64_t>& logprobs) {
  TORCH_CHECK(!weights_.parsed()->projections.empty(), "DecoderStack.decode_steps: the stack has no LM head");
  TORCH_CHECK(pos_of.dim() == 2 && slot_mapping.sizes() == pos_of.sizes() && uniforms.sizes() == pos_of.sizes() &&
                  pos_of.size(1) == x.size(0),
              "DecoderStack.decode_steps: positions, slots and uniforms must be [steps, B] for B input rows");
  const int64_t B = x.size(0);
  TORCH_CHECK(uniforms.scalar_type() == torch::kFloat64 && temperature.numel() == B && top_k.numel() == B &&
                  top_p.numel() == B,
              "DecoderStack.decode_steps: float64 uniforms and a temperature, top-k and top-p per row");
  TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == torch::kFloat32 && embedding.size(1) == x.size(1),
              "DecoderStack.decode_steps: the embedding must be float32 [V, H]");
  const int64_t steps = pos_of.size(0);
  auto tokens = torch::empty({steps, B}, pos_of.options());
  auto features = torch::empty({capture.empty() ? 0 : steps * B, static_cast<int64_t>(capture.size()) * x.size(1)},
                               x.options());
  TORCH_CHECK(logprobs.empty() || static_cast<int64_t>(logprobs.size()) == B,
              "DecoderStack.decode_steps: log-probabilities wanted per row (-1: none), or none");
  int64_t top = 0;  // the most alternatives a row wants
  for (int64_t n : logprobs) top = std::max(top, n);
  const bool reports = std::any_of(logprobs.begin(), logprobs.end(), [](int64_t n) { return n >= 0; });
  auto chosen_logprob = torch::zeros({reports ? steps : 0, B}, x.options());
  auto top_ids = torch::zeros({reports ? steps : 0, B, top}, pos_of.options());
  auto top_logprobs = torch::zeros({reports ? steps : 0, B, top}, x.options());
  std::vector<torch::Tensor> raw(B);  // this step's log-softmax of a reporting row's own logits
  std::optional<LogitAdjustments> adjust;  // built at the first step's logits
  torch::Tensor in = x;
  for (int64_t s = 0; s < steps; ++s) {
    const auto out = forward(in, caches, cos, sin, block_tables, seq_of, pos_of[s], slot_mapping[s], capture, true);
    const auto& logits = out[2];
    TORCH_CHECK(logits.size(1) <= embedding.size(0),
                "DecoderStack.decode_steps: the LM head has more outputs than the embedding rows");
    const int64_t vocab = logits.size(1);
    // A reporting row's log-probabilities, of its logits before any adjustment: the very ATen ops
    // layers/logprobs.py's token_logprobs runs on the row, so the numbers are one step a call's.
    for (int64_t b = 0; reports && b < B; ++b) {
      if (logprobs[b] < 0) continue;
      raw[b] = logits.narrow(0, b, 1).log_softmax(-1);
      const int64_t k = std::min(logprobs[b], vocab);
      if (k > 0) {
        const auto best = raw[b].topk(k, -1);
        top_logprobs[s][b].narrow(0, 0, k).copy_(std::get<0>(best)[0]);
        top_ids[s][b].narrow(0, 0, k).copy_(std::get<1>(best)[0]);
      }
    }
    if (!adjustments.empty() && !adjust) adjust.emplace(adjustments, B, vocab);
    if (adjust) {
      float* rows = logits.data_ptr<float>();
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) adjust->apply(b, rows + b * vocab);
      });
    }
    tokens[s].copy_(sample_logit_rows(logits, temperature, top_k, top_p, uniforms[s]));
    const int64_t* chosen = tokens[s].data_ptr<int64_t>();  // a row of a contiguous [steps, B]
    if (adjust) {
      for (int64_t b = 0; b < B; ++b) adjust->advance(b, chosen[b]);
    }
    for (int64_t b = 0; reports && b < B; ++b) {
      if (logprobs[b] >= 0) chosen_logprob[s][b] = raw[b][0][chosen[b]];
    }
    if (!capture.empty()) features.narrow(0, s * B, B).copy_(out[1]);
    if (s + 1 < steps) in = embedding.index_select(0, tokens[s]);
  }
  return {tokens, features, chosen_logprob, top_ids, top_logprobs};
}

Eagle3Step::Eagle3Step(std::vector<torch::Tensor> fc_weights, std::vector<int64_t> fc_format, torch::Tensor embedding,
                       torch::Tensor hidden_norm, torch::Tensor final_norm, std::vector<torch::Tensor> layer_weights,
                       std::vector<int64_t> layer_formats, int64_t num_heads, int64_t num_kv_heads, double eps,
                       double scale, std::vector<torch::Tensor> head_weights, std::vector<int64_t> head_format)
    : weights_({std::move(layer_weights)}, {std::move(layer_formats)}, {std::move(head_weights), std::move(fc_weights)},
               {std::move(head_format), std::move(fc_format)}, {embedding, hidden_norm, final_norm},
               embedding_width(embedding)),
      num_heads_(num_heads), num_kv_heads_(num_kv_heads), eps_(eps), scale_(scale) {
  TORCH_CHECK(hidden_norm.dim() == 1 && final_norm.dim() == 1, "Eagle3Step: the norms must be vectors of H");
  weights_.release();
}

// An EAGLE-3 head's step (models/eagle3.py) in one call and one parallel region:
//   h = fc(features)                  (or `input` is h already, through_fc false)
//   a = [rms_norm(embedding[ids]), rms_norm(h)]   the layer's input norm, then hidden_norm
//   out = the decoder layer of h reading a
//   logits[r] = lm_head(rms_norm(out[logit_rows[r]]))   the final norm; only the rows asked for
// with the module path's kernels and arithmetic, so the results are bit-identical to it
// (tests/test_eagle3.py). Returns {out [T, H], logits [R, n_out]}.
std::vector<torch::Tensor> Eagle3Step::forward(const torch::Tensor& input, bool through_fc, const torch::Tensor& ids_in,
                                               const torch::Tensor& cos, const torch::Tensor& sin,
                                               const torch::Tensor& cache, const torch::Tensor& block_tables,
                                               const torch::Tensor& seq_of, const torch::Tensor& pos_of,
                                               const torch::Tensor& slot_mapping, const std::vector<int64_t>& logit_rows) {
  const auto parsed = weights_.parsed();  // held until the call returns
  const auto& layers = parsed->layers;
  const auto& lm_head = parsed->projections[0];
  const parts::QuantWeight* fc = through_fc ? &parsed->projections[1] : nullptr;
  const auto in = input.contiguous();
  const auto ids = ids_in.contiguous();
  TORCH_CHECK(in.dim() == 2 && in.scalar_type() == torch::kFloat32, "Eagle3Step: float32 [T, K] input");
  const int64_t T = in.size(0), H = weights_.hidden(), vocab = parsed->float_rows[0];
  TORCH_CHECK(parsed->float_rows[1] == 1 && parsed->float_rows[2] == 1, "Eagle3Step: the norms must be vectors");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.numel() == T, "Eagle3Step: one int64 id per row");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "Eagle3Step: token id out of range");
  TORCH_CHECK(lm_head.K == H, "Eagle3Step: the LM head reads ", lm_head.K, " features");
  if (fc) {
    TORCH_CHECK(fc->K == in.size(1) && fc->n_out == H, "Eagle3Step: fc is ", fc->K, " -> ", fc->n_out);
  } else {
    TORCH_CHECK(in.size(1) == H, "Eagle3Step: the hidden input must be [T, H]");
  }
  const int64_t R = static_cast<int64_t>(logit_rows.size());
  TORCH_CHECK(R <= T, "Eagle3Step: more logit rows than rows");
  for (int64_t r : logit_rows) TORCH_CHECK(r >= 0 && r < T, "Eagle3Step: logit row out of range");
  std::vector<const parts::QuantWeight*> extra{&lm_head};
  if (fc) extra.push_back(fc);
  auto hidden = fc ? torch::empty({T, H}, in.options()) : in;
  Call call(hidden, 2 * H, layers, {cache}, cos, sin, block_tables, seq_of, pos_of, slot_mapping, num_heads_,
            num_kv_heads_, eps_, scale_, extra);
  auto attn_in = torch::empty({T, 2 * H}, in.options());
  auto out = torch::empty({T, H}, in.options());
  auto logits = torch::empty({R, lm_head.n_out}, in.options());
  const Step& st = call.step;
  const float feps = static_cast<float>(eps_);
  float* h = hidden.data_ptr<float>();
  float* a = attn_in.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const float* emb = parsed->floats[0];
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const Range rows = share(T);
    if (fc) {
      project_rows(st, *fc, in.data_ptr<float>(), T, rows, h);
      barrier();
    }
    for (int64_t t = rows.begin; t < rows.end; ++t) {
      parts::rms_norm_rows(emb + id[t] * H, call.layers[0].input_norm, a + t * 2 * H, H, feps, 0, 1);
      parts::rms_norm_rows(h + t * H, parsed->floats[1], a + t * 2 * H + H, H, feps, 0, 1);
    }
    run_layer(st, call.layers[0], h, a, cache, y);
    barrier();
    const Range picked = share(R);
    float* normed = st.scratch->normed;  // free once the layer is done
    for (int64_t r = picked.begin; r < picked.end; ++r)
      parts::rms_norm_rows(y + logit_rows[r] * H, parsed->floats[2], normed + r * H, H, feps, 0, 1);
    project_rows(st, lm_head, normed, R, picked, logits.data_ptr<float>());
  }
  return {out, logits};
}
