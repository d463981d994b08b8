// The claim-and-finish pool behind spindle::parallel_for (why: work_pool.h).
//
// One job at a time: the caller publishes it (a new generation), the helpers (torch's thread
// count minus one, started on first use and bound like torch's OpenMP threads where OMP_PLACES
// binds those) and the caller claim chunks from one atomic ticket until none is left, and the
// caller waits only for chunks already claimed. The ticket packs the generation, the job's chunk
// count and the next chunk, so a helper that wakes late cannot claim a chunk of a job that has
// ended or read another job's bounds. A helper spins briefly for the next job (a decode step's
// calls come back to back) while a scope is open, then sleeps on the generation (futex) and
// costs nothing between steps; a sleeping helper is woken by the next job but never waited for.
//
// Measured (2-core AMD EPYC, Zen 3; `python -m benchmarks.run --models <m> --concurrency 1
// --input-len 128 --output-len 128 --configs spindle --scheduler-steps 8 --spindle-env-variant
// omp:SPINDLE_DISABLE_WORK_POOL=1 --spindle-env-variant pool`, a fresh server per cell, pairs in
// both orders, 2026-11-27), output tokens/s, OpenMP -> pool:
//
//   small model, one stream, 6 pairs    337 342 336 350 404 436 -> 409 438 410 398 442 362
//                                       (5 of 6 faster, median +18 %; ITL p50 2.0-2.6 -> 1.8-2.2
//                                       ms, p99 7.4-9.3 -> 7.3-9.2 ms)
//   medium model, one stream, 4 pairs   50.9 50.1 52.8 51.9 -> 48.9 51.6 54.8 48.8 (noise)
//
// The small model's step is ~1 ms of short calls, where the services' wake-ups cost most; the
// medium model's step is 8 GEMVs a layer at memory speed, where neither way wins. Without the
// OpenMP-spin rule (kOpenMpSpin) the first pooled round of every request (after the prefill
// round ran on OpenMP) was late: gap before token 8 over 20 requests, median 10.5 ms against
// 4.6 on OpenMP alone; with the rule 4.2-4.6. Tried and not kept: the pool for every call of
// these kernels (prefills, big batches: oneDNN's OpenMP regions between them) made a
// one-stream request's first token ~6 ms later; a scope around the layer stack alone (the LM
// head on OpenMP after it) ran the medium model at one thread's speed (51-55 -> 34-41 tok/s);
// OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep between regions) halved the small model's
// stream (140-213 tok/s: a futex wake per region); GOMP_SPINCOUNT=10000 (OpenMP spins ~250 us)
// lost 5-26 % at 64 streams in 5 of 6 pairs.
//
// Served, a one-stream step of the small model takes ~2x its in-process time (2-core AMD EPYC
// Zen 4, 2026-11-29: 1.4 against 0.69 ms). Not because a helper that loses its core holds a
// claimed chunk: counted in run(), the caller waited for one in 24 % of calls, 3 us on average
// (49 ms of a 5.7 s run). The compute thread itself is runnable but off its core 22 % of the
// time (/proc/<tid>/schedstat), behind the worker's event loop, the load client and the host
// services, which together want about as much CPU a token as the step. Also tried there and not
// kept (`benchmarks.run --models small --concurrency 1,64`, pairs interleaved, tok/s):
// helpers that sched_yield() while they wait for the next call (one stream 594-637 against
// 652-744); SPINDLE_NUM_THREADS=1, which leaves the second core to the host (one stream 660 /
// 688 against 749 / 722, 64 streams 3,214 / 2,976 against 3,728 / 3,287).
//
// Also tried and not kept (2026-12-08, Zen 4): the caller taking over a chunk a helper had held
// for 3x the caller's own chunk time (the helper then refused its stores, and a job held what
// its chunks read until its last thread left). Against three processes that each burned 0.28 ms
// every 5.5 ms, the medium bf16 model's in-process decode step no longer slowed at all (without
// it: +0.5 ms), but served it gained nothing: medium bf16 one stream +8 ms (95 % CI -10..+27) of
// 860 ms a request, small fp32 +1.6 ms (+0.4..+2.6) of 83, slower (`benchmarks.paired`). Served,
// the caller waited ~0.4 ms a token for claimed chunks, but in many short waits: the services
// preempt helpers for tens of us, not the scheduler slices the takeover could cut short.
//
// Helpers run at SCHED_IDLE (SPINDLE_DISABLE_IDLE_HELPERS=1: the default policy), so any other
// thread that wakes on a helper's core takes it at once, and the caller takes the chunks the
// helper leaves. Throughput alone did not show it (64 streams 3,769 / 3,530 against 3,728 /
// 3,287, one stream 725 / 743 against 749 / 722, medium model one stream 65.2 / 67.4 against
// 69.0 / 67.8: a wash), but the inter-token tail does, with the compute thread's yield after
// each step (round_pipeline.py): `perf sched timehist` showed the worker's event loop, woken to
// send a step's tokens, runnable for 3-5 ms behind a spinning helper or the compute thread
// (figures in the README, "CPU speed").

#include "work_pool.h"

#include "env_flag.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace spindle {
namespace {

using Fn = std::function<void(int64_t, int64_t)>;
using Clock = std::chrono::steady_clock;

constexpr int64_t kChunksPerThread = 8;                       // claims per thread: what a late thread can leave to others
constexpr int64_t kMaxChunks = 0xffff;                        // the ticket's 16 bits
constexpr auto kHelperSpin = std::chrono::microseconds(100);  // a helper's wait for the next job before it sleeps
constexpr auto kCallerSpin = std::chrono::microseconds(20);   // the caller's wait on claimed chunks before it yields
// How long torch's OpenMP threads spin after a region before they sleep (libgomp's default
// GOMP_SPINCOUNT, 300,000 polls of ~25 ns on the Zen 3 measured): a helper woken meanwhile
// fights that spinner for its core, so until then the caller runs pool calls alone.
constexpr auto kOpenMpSpin = std::chrono::milliseconds(8);

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Ticket: generation (32 bits) | chunk count (16) | next chunk (16).
inline uint64_t make_ticket(uint32_t generation, int64_t chunks) { return (uint64_t{generation} << 32) | (uint64_t(chunks) << 16); }
inline uint32_t ticket_generation(uint64_t t) { return static_cast<uint32_t>(t >> 32); }
inline int64_t ticket_chunks(uint64_t t) { return static_cast<int64_t>((t >> 16) & kMaxChunks); }
inline int64_t ticket_next(uint64_t t) { return static_cast<int64_t>(t & kMaxChunks); }

thread_local bool in_pool_job = false;  // a chunk calling parallel_for again runs it inline
thread_local int scope_depth = 0;       // scopes open on this thread (work_pool_enter)
thread_local int scope_threads = 1;     // torch's thread count when the outermost scope opened
std::atomic<int64_t> last_openmp_ns{0};  // when these kernels last started an OpenMP region (steady clock)
std::atomic<int> open_scopes{0};        // threads with a scope open: helpers spin only then

bool pool_disabled() {
  static const bool disabled = env_flag("SPINDLE_DISABLE_WORK_POOL");
  return disabled;
}

class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool();  // never destroyed: its helpers run until the process exits
    return *pool;
  }

  // Runs the job on the caller and `helpers` helpers; false (nothing run) when another caller
  // holds the pool.
  bool run(int64_t begin, int64_t end, int64_t chunk, int64_t chunks, int helpers, const Fn& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    start_helpers(helpers);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    wanted_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t generation = ++last_generation_;
    ticket_.store(make_ticket(generation, chunks), std::memory_order_release);
    generation_.store(generation, std::memory_order_release);
    generation_.notify_all();
    work(generation);
    const auto since = Clock::now();
    while (done_.load(std::memory_order_acquire) < chunks) {
      if (Clock::now() - since < kCallerSpin) {
        cpu_relax();
      } else {
        sched_yield();  // a helper lost its core mid-chunk: let whatever took it run here meanwhile
      }
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  // Claims and runs chunks of job `generation` until none is left (or the job is another's).
  void work(uint32_t generation) {
    in_pool_job = true;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      do {
        if (ticket_generation(t) != generation || ticket_next(t) >= ticket_chunks(t)) {
          in_pool_job = false;
          return;
        }
      } while (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      // The job cannot end before this chunk is done, so its fields stay as published.
      const int64_t lo = begin_ + ticket_next(t) * chunk_, hi = std::min(end_, lo + chunk_);
      try {
        (*fn_)(lo, hi);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void start_helpers(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { helper_main(index); });
      threads_.back().detach();
    }
  }

  // Helper `index` takes OpenMP thread index + 1's place where OMP_PLACES binds those (the
  // caller is thread 0), so placement (services/cpu_affinity.py) holds for it too.
  static void bind_like_openmp(int index) {
    const int places = omp_get_num_places();
    if (places <= 0) return;
    const int place = (index + 1) % places;
    std::vector<int> ids(omp_get_place_num_procs(place));
    if (ids.empty()) return;
    omp_get_place_proc_ids(place, ids.data());
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int id : ids) CPU_SET(id, &set);
    sched_setaffinity(0, sizeof(set), &set);
  }

  void helper_main(int index) {
    bind_like_openmp(index);
    const std::string name = "spindle-pool-" + std::to_string(index);  // as top, py-spy and /proc show it
    pthread_setname_np(pthread_self(), name.c_str());
    if (!env_flag("SPINDLE_DISABLE_IDLE_HELPERS")) {
      // Yield the core to any other thread at once (the header says why a helper may): above
      // all the worker's event loop, woken for each step's tokens. Failure leaves the default.
      const sched_param param{};
      pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
    }
    uint32_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t generation = generation_.load(std::memory_order_acquire);
      const auto since = Clock::now();
      while (generation == seen && open_scopes.load(std::memory_order_relaxed) > 0 &&
             Clock::now() - since < kHelperSpin) {
        cpu_relax();
        generation = generation_.load(std::memory_order_acquire);
      }
      if (generation == seen) {
        generation_.wait(seen, std::memory_order_acquire);
        continue;
      }
      seen = generation;
      if (index < wanted_.load(std::memory_order_relaxed)) work(generation);
    }
  }

  std::mutex busy_;
  std::vector<std::thread> threads_;
  uint32_t last_generation_ = 0;
  std::atomic<uint32_t> generation_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> wanted_{0};
  const Fn* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace

void work_pool_enter() {
  if (scope_depth++ == 0) {
    open_scopes.fetch_add(1, std::memory_order_relaxed);
    scope_threads = at::get_num_threads();
    if (!pool_disabled()) omp_set_num_threads(1);  // disabled, OpenMP keeps every thread
  }
}

void work_pool_exit() {
  TORCH_CHECK(scope_depth > 0, "work_pool_exit: no work pool scope is open on this thread");
  if (--scope_depth == 0) {
    open_scopes.fetch_sub(1, std::memory_order_relaxed);
    omp_set_num_threads(scope_threads);
  }
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = scope_depth > 0 ? scope_threads : at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  const bool splits = threads > 1 && n > grain;  // at::parallel_for would start a region
  if (scope_depth == 0 || pool_disabled()) {
    if (splits) last_openmp_ns.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    at::parallel_for(begin, end, grain, fn);
    return;
  }
  if (!splits || in_pool_job || at::in_parallel_region() ||
      Clock::now() - Clock::time_point(Clock::duration(last_openmp_ns.load(std::memory_order_relaxed))) < kOpenMpSpin) {
    fn(begin, end);  // nothing to split, nested, or OpenMP's threads still spin on the helpers' cores
    return;
  }
  const int64_t chunks_wanted = std::min({(n + grain - 1) / grain, threads * kChunksPerThread, kMaxChunks});
  const int64_t chunk = (n + chunks_wanted - 1) / chunks_wanted;
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (!WorkPool::instance().run(begin, end, chunk, chunks, static_cast<int>(threads - 1), fn)) {
    at::parallel_for(begin, end, grain, fn);  // another thread's job holds the pool
  }
}

}  // namespace spindle

// Python opens a scope around a span of kernel calls (services/worker/models/native_stack.py).
TORCH_LIBRARY_FRAGMENT(spindle, m) {
  m.def("work_pool_enter() -> ()", &spindle::work_pool_enter);
  m.def("work_pool_exit() -> ()", &spindle::work_pool_exit);
}
