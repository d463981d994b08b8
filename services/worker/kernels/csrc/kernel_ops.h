// The kernels' C++ entry points (each also registered as a torch.ops.spindle op), for code in
// this library that chains them without going back through Python (decoder_stack.cpp, greedy_decode.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace spindle {

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                          bool float_out = false);

at::Tensor paged_attention(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                           at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const at::Tensor& work_items, double scale, int64_t window, double softcap,
                           const c10::optional<at::Tensor>& positions, const c10::optional<at::Tensor>& cos,
                           const c10::optional<at::Tensor>& sin);

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, bool unit_offset);

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                const at::Tensor& weight, double eps, bool unit_offset);

at::Tensor act_and_mul(const at::Tensor& gate_up_in, int64_t activation);

at::Tensor argmax_rows(const at::Tensor& logits_in);

// x . w over K as linear_small_m computes each output of one float32 row (head_screen.cpp).
float row_dot_f32(const float* x, const float* w, int64_t K);
float row_dot_f32(const float* x, const c10::BFloat16* w, int64_t K);
// The same for one row of bfloat16 x (x_widened: it in float32) against a bfloat16 row, before
// the bias and the rounding to bfloat16: on k pairs where one row takes them, else row_dot.
float row_dot_bf16(const c10::BFloat16* x, const float* x_widened, const c10::BFloat16* w, int64_t K);

c10::optional<at::Tensor> screened_argmax(const at::Tensor& x_in, const at::Tensor& head, const at::Tensor& screen,
                                          const at::Tensor& scales, const at::Tensor& errors, double max_abs,
                                          double max_row_l1, const c10::optional<at::Tensor>& bias);

at::Tensor decoder_stack(const at::Tensor& hidden, const std::vector<at::Tensor>& weights,
                         const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<at::Tensor>& kv_caches,
                         const std::vector<int64_t>& windows, double eps, bool unit_offset, int64_t activation,
                         int64_t num_heads, double scale, double softcap, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         const at::Tensor& work_items, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin);

}  // namespace spindle
