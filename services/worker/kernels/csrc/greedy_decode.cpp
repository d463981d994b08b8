// A greedy decode step in one call: token ids in, the next greedy token ids out (embedding
// lookup, the layer stack of decoder_stack.cpp, the LM head's small-M kernel with float32
// logits, argmax), for decode steps whose rows all sample greedily with nothing that reshapes
// their logits (models/greedy_step.py and services/worker/model_runner.py decide).
//
// Why: with the stack in one call, a one-stream step of the small benchmark model still went
// through Python for the embedding, the row selection before the LM head, the head, the sampler
// and the argmax, each op a few microseconds of dispatch, and the stack's own call converted its
// ~45 weights, biases and caches from Python objects on every step. Here the model's parameters
// live in a `DecoderPlan` built once at load, so a step passes only what changes: the token ids,
// the caches and the step's attention metadata. The kernels and their order are those of the
// Python path, so the tokens are the same. With the head's int8 screen in the plan, a step of up
// to kScreenRows rows reads the screen instead of the head (head_screen.cpp), and the full head
// only where the screen cannot decide.

#include "kernel_ops.h"

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace spindle {
namespace {

// Rows up to which a step screens its head: a step of one to a few streams reads its weights
// once and waits for their bytes; from here on the head is a GEMM whose rows share each read.
constexpr int64_t kScreenRows = 4;

// The decoder's parameters in the order decoder_stack takes them, plus the embedding and the LM
// head (see models/native_stack.py `NativeStack`); tensors are shared with the model, not copied.
struct DecoderPlan : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;
  std::vector<c10::optional<at::Tensor>> biases;
  std::vector<int64_t> windows;
  double eps;
  bool unit_offset;
  int64_t activation, num_heads;
  double scale, softcap;
  at::Tensor cos, sin, embedding, head;
  c10::optional<at::Tensor> embed_scale, head_bias;
  // head_screen.cpp: the head in int8, its rows' scales and rounding errors, its largest |w| and
  // largest row sum of |w|.
  c10::optional<at::Tensor> head_screen, head_screen_scales, head_screen_errors;
  double head_max_abs, head_max_row_l1;

  DecoderPlan(std::vector<at::Tensor> weights, std::vector<c10::optional<at::Tensor>> biases,
              std::vector<int64_t> windows, double eps, bool unit_offset, int64_t activation, int64_t num_heads,
              double scale, double softcap, at::Tensor cos, at::Tensor sin, at::Tensor embedding,
              c10::optional<at::Tensor> embed_scale, at::Tensor head, c10::optional<at::Tensor> head_bias,
              c10::optional<at::Tensor> head_screen, c10::optional<at::Tensor> head_screen_scales,
              c10::optional<at::Tensor> head_screen_errors, double head_max_abs, double head_max_row_l1)
      : weights(std::move(weights)), biases(std::move(biases)), windows(std::move(windows)), eps(eps),
        unit_offset(unit_offset), activation(activation), num_heads(num_heads), scale(scale), softcap(softcap),
        cos(std::move(cos)), sin(std::move(sin)), embedding(std::move(embedding)), head(std::move(head)),
        embed_scale(std::move(embed_scale)), head_bias(std::move(head_bias)), head_screen(std::move(head_screen)),
        head_screen_scales(std::move(head_screen_scales)), head_screen_errors(std::move(head_screen_errors)),
        head_max_abs(head_max_abs),
        head_max_row_l1(head_max_row_l1) {}
};

at::Tensor greedy_decode(const c10::intrusive_ptr<DecoderPlan>& plan, const at::Tensor& input_ids,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         const at::Tensor& work_items, const at::Tensor& positions) {
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.size(0) == positions.size(0),
              "greedy_decode: one token id and one position per row");
  at::Tensor hidden = at::embedding(plan->embedding, input_ids);
  if (plan->embed_scale.has_value()) hidden = at::mul(hidden, *plan->embed_scale);  // as models/decoder.py `embed`
  const at::Tensor last = decoder_stack(hidden, plan->weights, plan->biases, kv_caches, plan->windows, plan->eps,
                                        plan->unit_offset, plan->activation, plan->num_heads, plan->scale,
                                        plan->softcap, slot_mapping, block_tables, seq_lens, query_start_loc,
                                        work_items, positions.contiguous(), plan->cos, plan->sin);
  // A plan holds a screen only for the activations, head and bias it takes (greedy_step.py).
  if (plan->head_screen.has_value() && last.size(0) <= kScreenRows) {
    c10::optional<at::Tensor> tokens =
        screened_argmax(last, plan->head, *plan->head_screen, *plan->head_screen_scales, *plan->head_screen_errors,
                        plan->head_max_abs, plan->head_max_row_l1, plan->head_bias);
    if (tokens.has_value()) return *tokens;
  }
  return argmax_rows(linear_small_m(last, plan->head, plan->head_bias, /*float_out=*/true));
}

}  // namespace
}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.class_<spindle::DecoderPlan>("DecoderPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, std::vector<int64_t>, double,
                       bool, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor,
                       c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                       c10::optional<at::Tensor>, c10::optional<at::Tensor>, double, double>());
  m.def(
      "greedy_decode(__torch__.torch.classes.spindle.DecoderPlan plan, Tensor input_ids, Tensor(a!)[] kv_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor work_items, "
      "Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(spindle, CPU, m) { m.impl("greedy_decode", &spindle::greedy_decode); }
