"""Scheduler time per step at 32, 256 and 1024 running sequences, with a profile of where it goes.

`python -m benchmarks.scheduler_bench [--num-seqs 32 256 1024] [--num-scheduler-steps 1 8] [--profile]`:
decode-only steady state (every request running, ignore_eos) against the test suite's
`FakeWorker` (no model) with its KV check off; only the scheduler's own calls are timed.
Per step = schedule() per round / steps per round + output processing per step; per sequence
divides that by the running sequences. `--profile` adds the top functions by own time
(cProfile) for each size.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from dataclasses import dataclass

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import UpdateSink
from shared.sampling import SamplingOptions
from tests.scheduler.fake_worker import FakeWorker


@dataclass(frozen=True)
class Timing:
    num_seqs: int
    num_scheduler_steps: int
    schedule_us: float  # median per schedule() call that produced a round
    output_us: float  # median per update_from_output() call (one forward step)


def measure(num_seqs: int, num_scheduler_steps: int = 1, num_rounds: int = 200, prompt_len: int = 128,
            block_size: int = 16, profiler: cProfile.Profile | None = None) -> Timing:
    max_len = prompt_len + 4 * num_rounds * num_scheduler_steps + 64
    num_blocks = num_seqs * (-(-max_len // block_size) + 1)
    worker = FakeWorker(num_blocks, block_size, vocab_size=32000, max_model_len=max_len, eos_period=10**12,
                        verify_kv=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
                                      num_scheduler_steps=num_scheduler_steps), [worker.info])
    sink = UpdateSink()
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 31000 + 4 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, SamplingOptions(max_tokens=max_len - prompt_len - 1,
                                                                     ignore_eos=True)), sink)
    schedule_ns: list[int] = []
    output_ns: list[int] = []
    rounds_done = 0
    while rounds_done < num_rounds:
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter_ns()
        rounds = sched.schedule()
        t1 = time.perf_counter_ns()
        if profiler is not None:
            profiler.disable()
        steady = len(sched.workers[0].running) == num_seqs and not sched.workers[0].waiting
        if 0 in rounds:
            worker.submit(rounds[0])
            if steady:
                schedule_ns.append(t1 - t0)
        # Keep one round queued on the worker (pipelining): run the oldest round only.
        if len(worker.queue) + (worker.current is not None) >= 2 or 0 not in rounds:
            for out in worker.run_round():
                if profiler is not None:
                    profiler.enable()
                t2 = time.perf_counter_ns()
                sched.update_from_output(0, out, sink)
                t3 = time.perf_counter_ns()
                if profiler is not None:
                    profiler.disable()
                if steady:
                    output_ns.append(t3 - t2)
            rounds_done += steady
        sink.by_connection.clear()
    return Timing(num_seqs, num_scheduler_steps, statistics.median(schedule_ns) / 1e3,
                  statistics.median(output_ns) / 1e3)


def profile_table(profiler: cProfile.Profile, top: int = 12) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    args = parser.parse_args()
    for num_steps in args.num_scheduler_steps:
        for num_seqs in args.num_seqs:
            t = measure(num_seqs, num_steps)
            per_step = t.schedule_us / num_steps + t.output_us
            sys.stdout.write(f"num_seqs={t.num_seqs:5d} num_scheduler_steps={t.num_scheduler_steps}: "
                             f"schedule() {t.schedule_us:8.1f} us/round, output {t.output_us:8.1f} us/step, "
                             f"total {per_step:8.1f} us/step = {1000 * per_step / num_seqs:6.1f} ns/seq/step\n")
            if args.profile:
                profiler = cProfile.Profile()
                measure(num_seqs, num_steps, num_rounds=50, profiler=profiler)
                sys.stdout.write(profile_table(profiler))


if __name__ == "__main__":
    main()
