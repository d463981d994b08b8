// y = x @ W^T (+ bias) for a batched decode step's tens of rows, on AVX-512: the rows are the
// vector lanes, so W needs no packed copy.
//
// Why: at 8-256 rows (a decode step of that many streams, or a prefill chunk) the small-M
// kernel's dot-product tiles (linear_small_m.cpp) reached 145-183 GFLOP/s at 64 rows (each tile
// ends in horizontal sums and reloads x per feature block), so those steps ran on oneDNN, whose
// OpenMP barriers stall whenever a host service takes one of the worker's two cores, and which
// keeps the layer stack in Python (native_stack.py needs every layer on spindle's kernels).
// Here x is transposed once per call into [K][rows] (rows padded to 16, a few KB to a few
// hundred), in 16 x 16 blocks in registers, bf16 rows read in k pairs as they lie. Until
// 2026-11-29 a scalar loop transposed them, and bf16 rows were widened by torch, then rounded
// back into pairs one value at a time: 64 rows, 2 threads, Zen 4, a 16-feature call 23-24 ->
// 8 us at K = 256 and 69-74 -> 16-17 at K = 768 (fp32 x: 14 -> 11, 35 -> 27), bf16 384 x 256
// 60-65 -> 46-48 us, 256 x 768 128-132 -> 85-89. A tile of 16 x G rows by F features keeps
// G * F accumulators (<= 24 of the 32 zmm registers): per k, G vector loads of x and F
// broadcasts of W feed G * F FMAs (G = 4, F = 6 at 64 rows; G = 1, F = 12 at 16, where F = 24
// ran ~40 % slower). fp32 W is read in place
// (copying 24 rows into a scratch first ran 1.1-1.4x slower from cache), its F rows prefetched
// by hand; bf16 W is widened 24 rows at a time into a scratch. Results are staged per unit of
// features and copied into y's rows with the bias; units of 24 features, 96 for layers of 1,536
// and more (whole lines of y's rows: the 8192-wide LM head ran slower in 24s, a 256-wide layer
// in 96s kept one of two threads idle for a third of the call). Sums run over k in order, one
// lane per (row, feature). Measured alone, hot weights, 2 threads, Zen 5, time against
// oneDNN's at the small model's shapes: 16 rows 0.60-1.23x, 64 rows 0.86-1.12x, 128 rows
// 1.04-1.29x (`python -m benchmarks.linear_bench` prints it per shape and row count; the
// calibration, models/fast_linear.py, times the whole kernel against oneDNN per shape at start-up
// and decides from that).
#pragma once

#include "env_flag.h"
#include "linear_out.h"

#include <cstdint>

namespace spindle {

// True where this build has the AVX-512 path (else callers keep the small-M tiles).
bool mid_m_available();

// SPINDLE_DISABLE_BF16_PAIRS=1: bf16 x with bf16 W runs the fp32 tiles on x widened, here and in
// linear_small_m's few-rows tiles, instead of vdpbf16ps on k pairs (side-by-side runs).
inline bool bf16_pairs_disabled() {
  static const bool disabled = env_flag("SPINDLE_DISABLE_BF16_PAIRS");
  return disabled;
}

// y[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]), stored as `out` says; w fp32 or bf16 (`w_is_bf16`).
// Splits features across spindle::parallel_for. x is fp32, or bf16 where `x_is_bf16` (a --dtype
// bfloat16 model's activations): then with bf16 W on a CPU with AVX512-BF16 the tiles run
// vdpbf16ps on k pairs (SPINDLE_DISABLE_BF16_PAIRS=1: the fp32 tiles on x widened, for
// side-by-side runs).
void linear_mid_m(const void* x, bool x_is_bf16, const void* w, bool w_is_bf16, const float* bias, void* y,
                  LinearOut out, int64_t M, int64_t N, int64_t K);

}  // namespace spindle
