// The Python module of the native CPU kernels (see kernels.h).
#include "kernels.h"

// Every kernel runs without Python's lock: an engine step holds it for none of its native time,
// so the server's event loop (health, metrics, streams, disconnects) answers while a step runs.
// None of them touches a Python object; arguments and results convert with the lock held.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, py::call_guard<py::gil_scoped_release>(), "pack a [N, K] weight into [N/32, K, 32] blocks");
  m.def("small_m_linear", &small_m_linear, py::call_guard<py::gil_scoped_release>(), "y = x @ W^T (+ bias) for few rows, from a packed weight");
  m.def("pack_quantized", &pack_quantized, py::call_guard<py::gil_scoped_release>(), "repack GGUF block-quantised rows into 32-column tiles of input pairs");
  m.def("quant_linear", &quant_linear, py::call_guard<py::gil_scoped_release>(), "y = x @ W^T (+ bias) for few rows, W block-quantised (Q4, Q5, Q6 or Q8)");
  m.def("quant_linear_isa", &quant_linear_isa, py::call_guard<py::gil_scoped_release>(), "quant_linear on a named instruction set (for tests)");
  m.def("kernel_isa", &kernel_isa, py::call_guard<py::gil_scoped_release>(), "the instruction set quant_linear uses on this CPU");
  m.def("supported_isas", &supported_isas, py::call_guard<py::gil_scoped_release>(), "every instruction set quant_linear can use on this CPU");
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), "RMSNorm over the last dimension of float32 rows");
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>(), "silu(gate) * up of float32 rows [..., 2 I] holding gate and up side by side");
  m.def("paged_attention_decode", &paged_attention_decode, py::call_guard<py::gil_scoped_release>(), "causal paged attention for few queries per sequence");
  m.def("paged_attention_decode_isa", &paged_attention_decode_isa, py::call_guard<py::gil_scoped_release>(), "paged_attention_decode on a named instruction set (for tests)");
  m.def("attention_chunk", &attention_chunk, py::call_guard<py::gil_scoped_release>(), "keys per work item of paged_attention_decode (its partials are per query, chunk and head)");
  m.def("decoder_layer_decode", &decoder_layer_decode, py::call_guard<py::gil_scoped_release>(), "one Llama decoder layer of a decode/verify step");
  py::class_<DecoderStack>(m, "DecoderStack", "a model's decoder layers, final norm and LM head, prepared once")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>, int64_t, int64_t, double,
                    double, torch::Tensor, double, std::vector<torch::Tensor>, std::vector<int64_t>>())
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>(),
           "every decoder layer, the final norm and (with logits) the LM head of a decode/verify step")
      .def("decode_steps", &DecoderStack::decode_steps, py::call_guard<py::gil_scoped_release>(),
           "several decode steps, each step's tokens (argmax or drawn, after the rows' logit adjustments) the next one's input");
  m.def("sample_logit_rows", &sample_logit_rows, py::call_guard<py::gil_scoped_release>(), "one token per row from the filtered softmax(logits / temperature), fused (the argmax at temperature 0)");
  m.def("adjust_logit_rows", &adjust_logit_rows, py::call_guard<py::gil_scoped_release>(), "one step of the logit adjustments decode steps apply natively, in place (for tests)");
  m.def("filtered_prob_rows", &filtered_prob_rows, py::call_guard<py::gil_scoped_release>(), "each row's probabilities after its temperature, top-k and top-p");
  m.def("sample_weight_rows", &sample_weight_rows, py::call_guard<py::gil_scoped_release>(), "one token per row of weights with the row's uniform (inverse transform)");
  m.def("verify_logit_rows", &verify_logit_rows, py::call_guard<py::gil_scoped_release>(), "speculative sampling's verification of one sequence from its logits");
  py::class_<Eagle3Step>(m, "Eagle3Step", "an EAGLE-3 head's weights, prepared once")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, torch::Tensor, torch::Tensor, torch::Tensor,
                    std::vector<torch::Tensor>, std::vector<int64_t>, int64_t, int64_t, double, double,
                    std::vector<torch::Tensor>, std::vector<int64_t>>())
      .def("forward", &Eagle3Step::forward, py::call_guard<py::gil_scoped_release>(),
           "an EAGLE-3 head's step: fc, norms, its decoder layer and the LM head of chosen rows");
}
