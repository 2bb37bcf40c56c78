// The native CPU kernels, compiled together into one extension (bindings.cpp exposes them to Python;
// decoder_layer.cpp runs their work ranges, forward_parts.h, inside one parallel region). Each is optional:
// without a compiler the PyTorch paths run instead.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// small_m_gemm.cpp: float32 weights packed in 32-column blocks.
torch::Tensor pack_weight(const torch::Tensor& weight);
torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                             const c10::optional<torch::Tensor>& bias);

// quant_gemm.cpp: GGUF block-quantised weights (4-, 5-, 6- and 8-bit values, IQ4's 4-bit indices:
// layers/gguf_blocks.py; int4 at load).
std::vector<torch::Tensor> pack_quantized(const torch::Tensor& q, const torch::Tensor& scale,
                                          const torch::Tensor& offset, int64_t format);
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& units, const torch::Tensor& scales,
                           const torch::Tensor& offsets, int64_t n_out, int64_t format,
                           const c10::optional<torch::Tensor>& bias);
// The same on a named instruction set ("portable", "avx2", "avx512", "avx512-vnni"; all give identical
// results), the best one this CPU runs (the one quant_linear uses), and every one it runs.
torch::Tensor quant_linear_isa(const torch::Tensor& x, const torch::Tensor& units, const torch::Tensor& scales,
                               const torch::Tensor& offsets, int64_t n_out, int64_t format,
                               const c10::optional<torch::Tensor>& bias, const std::string& isa);
std::string kernel_isa();
std::vector<std::string> supported_isas();
// The same sets by index (0 portable, 1 avx2, 2 avx512, 3 avx512-vnni), for the other kernels: the
// best this CPU runs, and a named one (an error if unknown or not run here).
int64_t best_isa_index();
int64_t isa_index(const std::string& name);

// rms_norm.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// activation.cpp: silu(gate) * up of rows holding gate and up side by side ([..., 2 I] -> [..., I]).
torch::Tensor silu_mul(const torch::Tensor& gate_up);

// paged_attention.cpp: causal attention of few queries per sequence over the paged KV cache.
torch::Tensor paged_attention_decode(const torch::Tensor& q, const torch::Tensor& cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                     const torch::Tensor& pos_of, double scale);
// The same on a named instruction set (the names of supported_isas(); all give identical results).
torch::Tensor paged_attention_decode_isa(const torch::Tensor& q, const torch::Tensor& cache,
                                         const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                         const torch::Tensor& pos_of, double scale, const std::string& isa);
// Keys per work item: the kernel keeps a partial result per query, chunk of this many keys and head.
int64_t attention_chunk();

// decoder_layer.cpp: one Llama decoder layer of a decode or verification step, in one call and one
// parallel region. cos / sin_signed (here and below): the whole rotary tables [positions, head_dim],
// read at each token's position pos_of.
// attn_in: an empty tensor for a Llama layer (attention reads rms_norm(x)), or the attention's input
// itself for a layer whose attention reads something else than its residual (EAGLE-3's head: the
// normed token embedding and the normed feature side by side, 2 H wide).
torch::Tensor decoder_layer_decode(const torch::Tensor& x, const torch::Tensor& attn_in,
                                   const std::vector<torch::Tensor>& weights,
                                   const std::vector<int64_t>& formats, const torch::Tensor& cos,
                                   const torch::Tensor& sin_signed, const torch::Tensor& cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                   const torch::Tensor& pos_of, const torch::Tensor& slot_mapping,
                                   int64_t num_heads, int64_t num_kv_heads, double eps, double scale);

// decoder_layer.cpp: weights a native forward holds from its model's construction on: decoder
// layers (18 tensors and 8 format values each: decoder_layer_decode's), single block-quantised
// projections (units, scales, offsets, bias or an empty tensor; n_out and format) and float32
// tensors whose last dimension is the hidden size (norms, an embedding). They are parsed once, and
// again when a tensor's storage was replaced (loading moves the packed weights onto 2 MB pages
// that way, after the model is built); held, not copied. A step then passes only what changes:
// passing a 30-layer model's 540 weight tensors with every call cost 0.2-0.3 ms of a decode step.
class HeldWeights {
 public:
  struct Parsed;
  HeldWeights(std::vector<std::vector<torch::Tensor>> layers, std::vector<std::vector<int64_t>> layer_formats,
              std::vector<std::vector<torch::Tensor>> projections, std::vector<std::vector<int64_t>> projection_formats,
              std::vector<torch::Tensor> floats, int64_t hidden);
  // The weights as parsed now (first parsed again if a storage moved); a snapshot keeps the
  // storages it points into alive, so it stays valid while it is held, whatever later calls do.
  std::shared_ptr<const Parsed> parsed();
  // Drop the snapshot: the next parsed() parses again. The owners call it once built (checked),
  // since loading may still move the weights onto 2 MB pages, and a snapshot kept from then on
  // would keep the old copies alive until the first forward.
  void release();
  int64_t hidden() const { return hidden_; }

 private:
  template <typename F>
  void each_tensor(F f) const;
  std::vector<const void*> pointers() const;
  void parse();

  std::vector<std::vector<torch::Tensor>> layers_;
  std::vector<std::vector<int64_t>> layer_formats_;
  std::vector<std::vector<torch::Tensor>> projections_;
  std::vector<std::vector<int64_t>> projection_formats_;
  std::vector<torch::Tensor> floats_;
  int64_t hidden_;
  std::mutex mutex_;
  std::shared_ptr<const Parsed> parsed_;
};

// logit_adjustments.cpp: sampling.py's adjust_logits_ for the settings several decode steps in one call
// take natively (min_tokens, logit_bias, the repetition, frequency and presence penalties, min_p),
// one row per sequence, bit-identical to it; advance() adds a row's new token to its history.
// Packed (sampling.py's step_adjustments) as {settings [B, 4] float32: repetition penalty (1: off),
// frequency and presence penalties, min_p's offset T log(min_p) from the largest logit (NaN: off);
// held [B] int64: the steps min_tokens still holds its tokens back; ids [n] int64 and values [n]
// float32; offsets [B, 5] int64: row b's logit-bias ids (values: the biases), held-back ids, ids of
// its prompt and output (the repetition penalty's), and output ids (values: their counts)}.
class LogitAdjustments {
 public:
  LogitAdjustments(const std::vector<torch::Tensor>& packed, int64_t rows, int64_t vocab);
  void apply(int64_t row, float* logits) const;  // row's V logits, in place
  void advance(int64_t row, int64_t token);

 private:
  struct Row {
    float repetition, frequency, presence, min_p_offset;
    int64_t held_steps;
    std::vector<std::pair<int64_t, float>> bias;
    std::vector<int64_t> held, seen;
    std::vector<std::pair<int64_t, float>> counted;
    // Frequency and presence penalties are on: either is nonzero, or -0 (a tiny negative penalty in
    // float32, which turns a -0 logit into +0 as adjust_logits_ does; an off row holds +0).
    bool counts_tokens() const {
      return frequency != 0.0f || presence != 0.0f || std::signbit(frequency) || std::signbit(presence);
    }
  };
  int64_t vocab_;
  std::vector<Row> rows_;
};
// One step of them on float32 logits [B, V], in place (for tests: decode_steps applies them each step).
void adjust_logit_rows(torch::Tensor& logits, const std::vector<torch::Tensor>& adjustments);

// decoder_layer.cpp: a model's decoder layers, final norm and (optionally) block-quantised LM head
// (head_weights empty: none), held: forward runs every layer of a decode or verification step, the
// final norm and, with `logits`, the LM head in one call and one parallel region (the threads meet
// at barriers between stages); {hidden, the inputs of the `capture` layers side by side (or
// empty), logits (or empty)}.
class DecoderStack {
 public:
  DecoderStack(std::vector<std::vector<torch::Tensor>> layer_weights, std::vector<std::vector<int64_t>> layer_formats,
               int64_t num_heads, int64_t num_kv_heads, double eps, double scale, torch::Tensor final_norm,
               double final_eps, std::vector<torch::Tensor> head_weights, std::vector<int64_t> head_format);
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const std::vector<torch::Tensor>& caches,
                                     const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                     const torch::Tensor& pos_of, const torch::Tensor& slot_mapping,
                                     const std::vector<int64_t>& capture, bool logits);
  std::vector<torch::Tensor> decode_steps(const torch::Tensor& x, const torch::Tensor& embedding,
                                          const std::vector<torch::Tensor>& caches, const torch::Tensor& cos,
                                          const torch::Tensor& sin_signed, const torch::Tensor& block_tables,
                                          const torch::Tensor& seq_of, const torch::Tensor& pos_of,
                                          const torch::Tensor& slot_mapping, const torch::Tensor& temperature,
                                          const torch::Tensor& top_k, const torch::Tensor& top_p,
                                          const torch::Tensor& uniforms, const std::vector<int64_t>& capture,
                                          const std::vector<torch::Tensor>& adjustments,
                                          const std::vector<int64_t>& logprobs);

 private:
  HeldWeights weights_;  // the layers; projections: the LM head, if any; floats: the final norm
  int64_t num_heads_, num_kv_heads_;
  double eps_, scale_, final_eps_;
};

// decoder_layer.cpp: an EAGLE-3 head's weights, held (models/eagle3.py): forward is the head's step
// in one call: fc of `input` (the target's features; with `through_fc` false `input` is the head's
// hidden already), the normed token embedding and normed hidden side by side, the decoder layer,
// and the LM head of the rows logit_rows after the final norm; {out [T, H], logits
// [|logit_rows|, n_out]}.
class Eagle3Step {
 public:
  Eagle3Step(std::vector<torch::Tensor> fc_weights, std::vector<int64_t> fc_format, torch::Tensor embedding,
             torch::Tensor hidden_norm, torch::Tensor final_norm, std::vector<torch::Tensor> layer_weights,
             std::vector<int64_t> layer_formats, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
             std::vector<torch::Tensor> head_weights, std::vector<int64_t> head_format);
  std::vector<torch::Tensor> forward(const torch::Tensor& input, bool through_fc, const torch::Tensor& ids,
                                     const torch::Tensor& cos, const torch::Tensor& sin_signed,
                                     const torch::Tensor& cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_of, const torch::Tensor& pos_of,
                                     const torch::Tensor& slot_mapping, const std::vector<int64_t>& logit_rows);

 private:
  HeldWeights weights_;  // the layer; projections: the LM head, fc; floats: embedding, hidden norm, final norm
  int64_t num_heads_, num_kv_heads_;
  double eps_, scale_;
};

// sampling.cpp: one token per row of logits [N, V] (sampling.py's sample_tokens): drawn from the filtered
// softmax(logits / temperature) with the row's uniform (sample_from_probs over logits_to_probs, fused),
// or, where the row's temperature is 0, its first largest logit (a NaN first of all); each row's
// temperature (float32), top-k (int64, 0: off) and top-p (float32, 1: off).
torch::Tensor sample_logit_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& uniforms);
// sampling.py's logits_to_probs: each row's probabilities [N, V] float32 after its temperature, top-k
// and top-p.
torch::Tensor filtered_prob_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                 const torch::Tensor& top_k, const torch::Tensor& top_p);
// sampling.py's sample_from_probs: one token per row of [N, V] float32 weights (a row need not sum to
// 1) with the row's uniform.
torch::Tensor sample_weight_rows(const torch::Tensor& weights, const torch::Tensor& uniforms);
// rejection.py's verify_sampled for one sequence, from the target's logits [n + 1, V] and the
// request's temperature, top-k and top-p: (accepted proposals m, the recovered or bonus token) as
// int64 [2].
torch::Tensor verify_logit_rows(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p,
                                const torch::Tensor& proposed, const torch::Tensor& draft_probs,
                                const torch::Tensor& accept_uniforms, double last_uniform);
