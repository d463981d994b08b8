// A decoder's whole layer stack for a few-row step in one call: every layer's norms, linear
// layers, rotary + KV write + paged attention and activation, then the final norm.
//
// Why: at decode sizes each kernel call is short and the Python around it (module calls,
// splits and views, argument checks, ~4 us of dispatch per op) costs about as much: the small
// benchmark model's one-row step (4 layers, hidden 256) spent ~1.2 ms in ops of a 1.9-2.0 ms
// step. llama.cpp pays none of that. Here the Python side makes one call per step and this file
// chains the same kernels (kernel_ops.h) in C++, so the output is bit for bit that of the fused
// Python path (models/decoder.py), which stays for what this does not cover. Measured in
// models/native_stack.py.
//
// Covered (models/native_stack.py checks before it calls): pre-norm Llama-style layers with a
// fused qkv and gate_up projection (optional biases), RMSNorm with or without Gemma's unit
// offset, SiLU or tanh-GELU gating, GQA, per-layer sliding windows, logit soft-capping, fp32
// activations with fp32 or bf16 weights or bf16 activations with bf16 weights, rows few enough
// that every linear layer runs the small-M kernel.
//
// weights: per layer (input norm, qkv, o, post-attention norm, gate_up, down), then the final
// norm; biases: per layer (qkv, o, gate_up, down), None where the layer has none.

#include "kernel_ops.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace spindle {

constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kBiasesPerLayer = 4;

at::Tensor decoder_stack(const at::Tensor& hidden, const std::vector<at::Tensor>& weights,
                         const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& kv_caches,
                         const std::vector<int64_t>& windows, double eps, bool unit_offset, int64_t activation,
                         int64_t num_heads, double scale, double softcap, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         const at::Tensor& work_items, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers + 1 &&
                  static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decoder_stack: ", kWeightsPerLayer, " weights and ", kBiasesPerLayer,
              " biases per layer (plus the final norm's weight) and one window per KV cache");
  TORCH_CHECK(hidden.dim() == 2 && (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "decoder_stack: hidden must be float32 or bfloat16 [rows, hidden]");
  const int64_t rows = hidden.size(0);
  at::Tensor delta = hidden;
  at::Tensor residual;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kWeightsPerLayer;
    const c10::optional<at::Tensor>* b = biases.data() + i * kBiasesPerLayer;
    const at::Tensor& cache = kv_caches[i];  // [2, blocks, block_size, kv_heads, head_dim]
    const int64_t kv_heads = cache.size(3), head_dim = cache.size(4);
    const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
    at::Tensor h;
    if (i == 0) {
      residual = delta;
      h = rms_norm(delta, w[0], eps, unit_offset);
    } else {
      std::tie(residual, h) = add_rms_norm(delta, residual, w[0], eps, unit_offset);
    }
    const at::Tensor qkv = linear_small_m(h, w[1], b[0]);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_stack: layer ", i, "'s qkv width does not match its cache");
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    const at::Tensor attn = paged_attention(q, k, v, cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                                            work_items, scale, windows[i], softcap, positions, cos, sin);
    std::tie(residual, h) = add_rms_norm(linear_small_m(attn.view({rows, q_size}), w[2], b[1]), residual, w[3], eps,
                                         unit_offset);
    delta = linear_small_m(act_and_mul(linear_small_m(h, w[4], b[2]), activation), w[5], b[3]);
  }
  return std::get<1>(add_rms_norm(delta, residual, weights.back(), eps, unit_offset));
}

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def(
      "decoder_stack(Tensor hidden, Tensor[] weights, Tensor?[] biases, Tensor(a!)[] kv_caches, int[] windows, "
      "float eps, bool unit_offset, int activation, int num_heads, float scale, float softcap, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor work_items, Tensor positions, "
      "Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("decoder_stack", &spindle::decoder_stack); }
