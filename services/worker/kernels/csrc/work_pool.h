// Parallel loops for the decode kernels that do not wait for a thread that lost its core.
//
// Why: at::parallel_for (OpenMP) ends every call at a barrier that all of torch's threads must
// reach. On a small host the frontend, the scheduler and the load client wake for every token
// on the worker's cores, and each time one of them takes a worker thread's core, the other
// thread finishes its static share and then waits, idle, at the barrier. A decode step is tens
// of such calls, each reading weights at memory speed, where one thread alone reaches ~60 % of
// two threads' bandwidth. Here the range is cut into more chunks than threads and every thread
// (the caller and the pool's helpers) claims the next chunk from one counter; the call returns
// when every chunk has run, so a helper that has not started yet leaves its share to the
// others, and one preempted mid-chunk holds the call up by that chunk only. Measured in
// work_pool.cpp.
//
// Same contract as at::parallel_for: fn(begin, end) on disjoint subranges covering [begin,
// end), each at least `grain` long (but the last), in any order and on any thread; fn must
// not throw out of a helper's chunk without it reaching the caller (errors are rethrown
// there). SPINDLE_DISABLE_WORK_POOL=1: at::parallel_for itself (side-by-side runs).
#pragma once

#include <cstdint>
#include <functional>

namespace spindle {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// While a scope is open on this thread (work_pool_enter, then work_pool_exit; nested scopes
// count), its parallel_for calls run on the pool; elsewhere they are at::parallel_for. Only a
// span where every parallel op is one of these kernels opens one: where oneDNN's GEMMs (torch's
// OpenMP threads) come between them, OpenMP's threads spin after each GEMM on the cores the
// helpers need, and the two took turns (a 1-stream decode of the medium model ran at one
// thread's speed). Helpers spin for the next call only while some scope is open, and sleep
// when the last one closes.
// While the outermost scope is open, OpenMP's thread count on this thread is 1 (torch's ops in
// the span run inline: no OpenMP region wakes threads that would then spin on the helpers'
// cores) and parallel_for uses the count from before the scope.
void work_pool_enter();
void work_pool_exit();

}  // namespace spindle
