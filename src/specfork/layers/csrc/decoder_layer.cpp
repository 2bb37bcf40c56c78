// One Llama decoder layer of a decode or verification step, in one call from Python:
//   h = x + o_proj(attention(rope(q), rope(k), v))   with q, k, v = qkv_proj(rms_norm(x)) (or of attn_in)
//   y = h + down_proj(silu(gate) * up)               with gate, up = gate_up_proj(rms_norm(h))
// A decode step of a small model is dominated by per-op overhead when driven from Python (about 25
// tensor ops and 8 module calls per layer, ~160 us per layer measured here against ~200 us of actual
// work). This chains the same kernels (quant_linear, rms_norm, paged_attention_decode) and the same
// element-wise arithmetic in C++, so its result is bit-identical to the Python path
// (tests/test_fused_layer.py): the rotation is x * cos + roll(x) * sin_signed with separate roundings
// (the extension is compiled with -ffp-contract=off), the residual adds are plain float adds, and
// silu(gate) * up uses ATen's own ops.
#include "kernels.h"

#include <cstring>

namespace {

// The block-quantised projection number i of the layer: weights[2 + 4i ..] = units, scales, offsets,
// bias (an empty tensor for none); formats[2i ..] = n_out, format.
torch::Tensor project(int i, const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                      const std::vector<int64_t>& formats) {
  const auto& bias = weights[2 + 4 * i + 3];
  return quant_linear(x, weights[2 + 4 * i], weights[2 + 4 * i + 1], weights[2 + 4 * i + 2], formats[2 * i],
                      formats[2 * i + 1], bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
}

}  // namespace

torch::Tensor decoder_layer_decode(const torch::Tensor& x, const torch::Tensor& attn_in,
                                   const std::vector<torch::Tensor>& weights,
                                   const std::vector<int64_t>& formats, const torch::Tensor& cos_in,
                                   const torch::Tensor& sin_in, const torch::Tensor& cache,
                                   const torch::Tensor& block_tables, const torch::Tensor& seq_of,
                                   const torch::Tensor& pos_of, const torch::Tensor& slot_mapping_in,
                                   int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(weights.size() == 18 && formats.size() == 8, "decoder_layer_decode: 2 norms + 4 projections");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [T, H] float32");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() &&
                  (cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kHalf),
              "bad cache");
  const int64_t T = x.size(0), D = cache.size(4), Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(cache.size(3) == Hkv && D % 2 == 0, "cache shape disagrees with the heads");
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous(), slots = slot_mapping_in.contiguous();
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T, "rope tables / slots: one per token");

  // attention block
  if (attn_in.numel()) {
    TORCH_CHECK(attn_in.dim() == 2 && attn_in.size(0) == T && attn_in.scalar_type() == torch::kFloat32,
                "attn_in must be [T, K] float32");
  }
  const auto attn_input = attn_in.numel() ? attn_in.contiguous() : rms_norm(x, weights[0], eps);
  auto qkv = project(0, attn_input, weights, formats);  // [T, (Hq + 2 Hkv) * D]
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv projection has ", qkv.size(1), " outputs");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
  std::vector<float> head(D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hq + Hkv; ++h) {  // rotate q and k heads: x * cos + roll(x, D / 2) * sin_signed
      float* v = qp + t * width + h * D;
      std::memcpy(head.data(), v, D * sizeof(float));
      for (int64_t i = 0; i < D; ++i) {
        const float a = head[i] * cp[t * D + i];
        const float b = head[(i + half) % D] * sp[t * D + i];
        v[i] = a + b;
      }
    }
  }
  // new keys and values into their cache slots (rounded to nearest-even for a float16 cache, as
  // Tensor.to(float16) rounds on the module path)
  const int64_t slots_total = cache.size(1) * cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_total, "cache slot out of range");
  if (cache.scalar_type() == torch::kFloat32) {
    float* kc = cache.data_ptr<float>();
    float* vc = kc + slots_total * Hkv * D;
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(kc + slot[t] * Hkv * D, qp + t * width + Hq * D, Hkv * D * sizeof(float));
      std::memcpy(vc + slot[t] * Hkv * D, qp + t * width + (Hq + Hkv) * D, Hkv * D * sizeof(float));
    }
  } else {
    at::Half* kc = cache.data_ptr<at::Half>();
    at::Half* vc = kc + slots_total * Hkv * D;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < Hkv * D; ++i) {
        kc[slot[t] * Hkv * D + i] = static_cast<at::Half>(qp[t * width + Hq * D + i]);
        vc[slot[t] * Hkv * D + i] = static_cast<at::Half>(qp[t * width + (Hq + Hkv) * D + i]);
      }
  }
  const auto q = qkv.view({T, Hq + 2 * Hkv, D}).narrow(1, 0, Hq);
  const auto attn = paged_attention_decode(q, cache, block_tables, seq_of, pos_of, scale).view({T, Hq * D});
  auto h = project(1, attn, weights, formats);
  TORCH_CHECK(h.sizes() == x.sizes(), "o projection has ", h.size(1), " outputs, the hidden size is ", x.size(1));
  {
    float* hp = h.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) hp[i] = xp[i] + hp[i];
  }

  // MLP block
  const auto gate_up = project(2, rms_norm(h, weights[1], eps), weights, formats);
  const int64_t inter = gate_up.size(1) / 2;
  const auto act = at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
  auto y = project(3, act, weights, formats);
  TORCH_CHECK(y.sizes() == h.sizes(), "down projection has ", y.size(1), " outputs");
  float* yp = y.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  for (int64_t i = 0; i < y.numel(); ++i) yp[i] = hp[i] + yp[i];
  return y;
}

// Every decoder layer of a decode or verification step, then the final norm, in one call (no return
// to Python between layers): the same decoder_layer_decode per layer, so bit-identical to calling it
// layer by layer. Returns {hidden after the final norm} and, with `capture` (layer indices), the
// inputs of those layers concatenated in that order ([T, |capture| H]: an EAGLE-3 head's features).
std::vector<torch::Tensor> decoder_stack_decode(
    const torch::Tensor& x_in, const std::vector<std::vector<torch::Tensor>>& layer_weights,
    const std::vector<std::vector<int64_t>>& layer_formats, const std::vector<torch::Tensor>& caches,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& block_tables, const torch::Tensor& seq_of,
    const torch::Tensor& pos_of, const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
    double eps, double scale, const std::vector<int64_t>& capture, const torch::Tensor& final_norm, double final_eps) {
  const size_t L = layer_weights.size();
  TORCH_CHECK(layer_formats.size() == L && caches.size() == L, "decoder_stack_decode: one cache and format list per layer");
  std::vector<torch::Tensor> captured(capture.size());
  const auto llama_attention = torch::empty({0});  // attention reads rms_norm(x)
  auto x = x_in.contiguous();
  for (size_t i = 0; i < L; ++i) {
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == static_cast<int64_t>(i)) captured[c] = x;
    x = decoder_layer_decode(x, llama_attention, layer_weights[i], layer_formats[i], cos, sin, caches[i], block_tables,
                             seq_of, pos_of, slot_mapping, num_heads, num_kv_heads, eps, scale);
  }
  std::vector<torch::Tensor> out{rms_norm(x, final_norm, final_eps)};
  if (!capture.empty()) {
    for (const auto& c : captured) TORCH_CHECK(c.defined(), "decoder_stack_decode: capture names a layer it does not have");
    out.push_back(torch::cat(captured, 1));
  }
  return out;
}
