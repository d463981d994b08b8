// y = x @ W^T (+ bias) for a batched decode step's tens of rows, on AVX-512: the rows are the
// vector lanes, so W is read in place, row by row, with no packing.
//
// Why: at 16-256 rows (a decode step of that many streams) the small-M kernel's dot-product
// tiles (linear_small_m.cpp) reach only part of the FMA peak (each tile ends in horizontal sums
// and reloads x per feature block), so those steps ran on oneDNN, whose OpenMP barriers stall
// whenever a host service takes one of the worker's two cores, and which keeps the layer stack
// in Python (native_stack.py needs every layer on spindle's kernels). Here x is transposed once
// per call into [K][rows] (rows padded to 16, a few KB), and a tile of 16 x G rows by F features
// keeps G * F accumulators (<= 24 of the 32 zmm registers), each FMA taking one W element
// broadcast from memory: per k, G vector loads of x and F broadcasts feed G * F FMAs, and W
// streams once, in its own layout, per group of <= 64 rows. bf16 weights are widened F rows at a
// time into an L1-resident scratch. Sums run over k in order, one lane per (row, feature).
// Which calls use it is decided by measurement at run time (models/fast_linear.py calibrates
// the whole kernel against oneDNN).
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
