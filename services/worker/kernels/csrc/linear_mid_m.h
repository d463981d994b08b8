// y = x @ W^T (+ bias) for a batched decode step's tens of rows, on AVX-512: the rows are the
// vector lanes, so W needs no packed copy.
//
// Why: at 8-256 rows (a decode step of that many streams, or a prefill chunk) the small-M
// kernel's dot-product tiles (linear_small_m.cpp) reached 145-183 GFLOP/s at 64 rows (each tile
// ends in horizontal sums and reloads x per feature block), so those steps ran on oneDNN, whose
// OpenMP barriers stall whenever a host service takes one of the worker's two cores, and which
// keeps the layer stack in Python (native_stack.py needs every layer on spindle's kernels).
// Here x is transposed once per call into [K][rows] (rows padded to 16, a few KB to a few
// hundred), W's rows are copied (fp32) or widened (bf16) 24 at a time into a scratch that stays
// in L1/L2 (one sequential stream per row: 6-12 rows read in place, interleaved, ran 15-30 %
// slower from memory), and a tile of 16 x G rows by F features keeps G * F accumulators (<= 24
// of the 32 zmm registers): per k, G vector loads of x and F broadcasts of W feed G * F FMAs
// (G = 4, F = 6 at 64 rows; G = 1, F = 12 at 16, where F = 24 ran ~40 % slower). Results are
// staged per 96 features and copied into y's rows with the bias. Sums run over k in order, one
// lane per (row, feature). Measured alone (hot weights, 2 threads, Zen 5): 290-474 GFLOP/s at
// 64 rows over the benchmark models' shapes, oneDNN 250-480. Which calls use it is decided by
// measurement at run time (models/fast_linear.py calibrates the whole kernel against oneDNN).
#pragma once

#include <cstdint>

namespace spindle {

// True where this build has the AVX-512 path (else callers keep the small-M tiles).
bool mid_m_available();

// y[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]); w fp32 or bf16 (`w_is_bf16`). Splits features
// across spindle::parallel_for.
void linear_mid_m(const float* x, const void* w, bool w_is_bf16, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t K);

}  // namespace spindle
