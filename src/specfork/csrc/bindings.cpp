// The Python module of the native CPU kernels (see kernels.h).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack a [N, K] weight into [N/32, K, 32] blocks");
  m.def("small_m_linear", &small_m_linear, "y = x @ W^T (+ bias) for few rows, from a packed weight");
  m.def("pack_quantized", &pack_quantized, "repack GGUF block-quantised rows into 32-column tiles of input pairs");
  m.def("quant_linear", &quant_linear, "y = x @ W^T (+ bias) for few rows, W block-quantised (Q4 or Q8)");
  m.def("quant_linear_isa", &quant_linear_isa, "quant_linear on a named instruction set (for tests)");
  m.def("kernel_isa", &kernel_isa, "the instruction set quant_linear uses on this CPU");
  m.def("supported_isas", &supported_isas, "every instruction set quant_linear can use on this CPU");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension of float32 rows");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of float32 rows [..., 2 I] holding gate and up side by side");
  m.def("paged_attention_decode", &paged_attention_decode, "causal paged attention for few queries per sequence");
  m.def("paged_attention_decode_isa", &paged_attention_decode_isa, "paged_attention_decode on a named instruction set (for tests)");
  m.def("attention_chunk", &attention_chunk, "keys per work item of paged_attention_decode (its partials are per query, chunk and head)");
  m.def("decoder_layer_decode", &decoder_layer_decode, "one Llama decoder layer of a decode/verify step");
  m.def("decoder_stack_decode", &decoder_stack_decode, "every decoder layer, the final norm and the LM head of a decode/verify step");
  m.def("sample_logit_rows", &sample_logit_rows, "one token per row from the filtered softmax(logits / temperature), fused");
  m.def("filtered_prob_rows", &filtered_prob_rows, "each row's probabilities after its temperature, top-k and top-p");
  m.def("sample_weight_rows", &sample_weight_rows, "one token per row of weights with the row's uniform (inverse transform)");
  m.def("verify_logit_rows", &verify_logit_rows, "speculative sampling's verification of one sequence from its logits");
  m.def("eagle3_head_decode", &eagle3_head_decode, "an EAGLE-3 head's step: fc, norms, its decoder layer and the LM head of chosen rows");
}
