// Helpers of fused_ops.cpp that the paged attention kernel calls (rotary embedding at its KV write).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace spindle {

// out = x rotated by one position's cos/sin rows (HF's rotate_half convention, float32): the
// leading `rotary_dim` of `head_dim` values rotate, the rest are copied; then every value is
// multiplied by `scale` (1 for keys; the softmax scale for queries, applied after rotating as
// the unfused path does). Rounded exactly as torch's `x * cos + rotate_half(x) * sin`.
void rope_row(const float* x, const float* cos, const float* sin, float* out, int64_t rotary_dim, int64_t head_dim,
              float scale);
// The same for bf16 q or k, rounded as torch's bf16 ops round: cos and sin cast to bf16 (as
// RotaryEmbedding casts its tables to the activations' dtype), each product and the sum rounded
// to bf16; the rotated value is exact in `out` (fp32) before `scale`.
void rope_row(const c10::BFloat16* x, const float* cos, const float* sin, float* out, int64_t rotary_dim,
              int64_t head_dim, float scale);

}  // namespace spindle
