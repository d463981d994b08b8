// Where the linear kernels (linear_small_m.cpp, linear_mid_m.cpp) write their fp32 sums.
//
// Why: the kernels used to fill an fp32 tensor that torch then rounded to the activations'
// dtype, and the LM head's bf16 logits were widened again for the sampler: two more passes and
// two to three more torch ops a call (at one bf16 row about 2-3 us each, 21 a step of the small
// model; at 64 rows a [64, 8192] logits copy took ~100 us each way). Now each kernel's last store
// rounds as that pass did (round to nearest even, bias added in fp32 first), so the values are
// bit for bit what they were.
#pragma once

#include "vec_math.h"

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <utility>

namespace spindle {

// What y holds: fp32 sums (fp32 activations), or sums rounded to bf16 (bf16 activations), stored
// as bf16 or, for logits a sampler reads in fp32, as the fp32 value of that bf16.
enum class LinearOut { kFloat, kBFloat16, kBFloat16AsFloat };

// One element of a kBFloat16AsFloat output.
struct Bf16AsFloat {
  float value;
};

inline void store_sum(float* y, float sum) { *y = sum; }
inline void store_sum(c10::BFloat16* y, float sum) { *y = from_float<c10::BFloat16>(sum); }
inline void store_sum(Bf16AsFloat* y, float sum) { y->value = rounded<c10::BFloat16>(sum); }

// f(y as the element type `out` names).
template <typename F>
void with_output(LinearOut out, void* y, F&& f) {
  switch (out) {
    case LinearOut::kFloat: return std::forward<F>(f)(static_cast<float*>(y));
    case LinearOut::kBFloat16: return std::forward<F>(f)(static_cast<c10::BFloat16*>(y));
    case LinearOut::kBFloat16AsFloat: return std::forward<F>(f)(static_cast<Bf16AsFloat*>(y));
  }
}

}  // namespace spindle
