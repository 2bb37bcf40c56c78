// The native CPU kernels, compiled together into one extension (bindings.cpp exposes them to Python;
// decoder_layer.cpp runs their work ranges, forward_parts.h, inside one parallel region). Each is optional:
// without a compiler the PyTorch paths run instead.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

// small_m_gemm.cpp: float32 weights packed in 32-column blocks.
torch::Tensor pack_weight(const torch::Tensor& weight);
torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_out,
                             const c10::optional<torch::Tensor>& bias);

// quant_gemm.cpp: GGUF block-quantised weights (Q4_0, Q4_1, Q8_0, int4 at load).
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

// decoder_layer.cpp: a model's decoder layers, final norm and (optionally) block-quantised LM head,
// prepared once, so that a step passes only what changes: forward runs every layer of a decode or
// verification step, the final norm and, with `logits`, the LM head in one call and one parallel
// region (the threads meet at barriers between stages); {hidden, the inputs of the `capture` layers
// side by side (or empty), logits (or empty)}. The weights are held, not copied, and parsed again
// when a tensor's storage was replaced.
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

 private:
  struct Parsed;
  std::vector<const void*> pointers() const;
  void parse();

  std::vector<std::vector<torch::Tensor>> weights_;
  std::vector<std::vector<int64_t>> formats_;
  int64_t num_heads_, num_kv_heads_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  double final_eps_;
  std::vector<torch::Tensor> head_weights_;
  std::vector<int64_t> head_format_;
  std::mutex mutex_;
  std::shared_ptr<const Parsed> parsed_;
};

// decoder_layer.cpp: an EAGLE-3 head's step in one call: fc of `input` (features; or `input` is the
// head's hidden already, fc_weights empty), the normed token embedding and normed hidden side by
// side, the decoder layer, and the LM head of the rows logit_rows after the final norm;
// {out [T, H], logits [|logit_rows|, n_out]}.
std::vector<torch::Tensor> eagle3_head_decode(
    const torch::Tensor& input, const std::vector<torch::Tensor>& fc_weights, const std::vector<int64_t>& fc_format,
    const torch::Tensor& ids, const torch::Tensor& embedding, const torch::Tensor& hidden_norm,
    const torch::Tensor& final_norm, const std::vector<torch::Tensor>& layer_weights,
    const std::vector<int64_t>& layer_formats, const torch::Tensor& cos, const torch::Tensor& sin_signed,
    const torch::Tensor& cache, const torch::Tensor& block_tables, const torch::Tensor& seq_of,
    const torch::Tensor& pos_of, const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
    double eps, double scale, const std::vector<torch::Tensor>& head_weights, const std::vector<int64_t>& head_format,
    const std::vector<int64_t>& logit_rows);

// sampling.cpp: one token per row drawn from the filtered softmax(logits / temperature) with the row's
// uniform (sampling.py's sample_from_probs over logits_to_probs, fused); each row's temperature
// (float32), top-k (int64, 0: off) and top-p (float32, 1: off).
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
