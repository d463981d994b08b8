"""Time `Scheduler.schedule()` and output processing per step at a given number of running sequences.

`python -m tests.scheduler.bench_schedule [--num-seqs 32 256 1024] [--num-scheduler-steps 1]`:
decode-only steady state (every request running, ignore_eos) against a `FakeWorker` with its KV
check off; only the scheduler's own calls are timed.
"""

from __future__ import annotations

import argparse
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
            block_size: int = 16) -> Timing:
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
        t0 = time.perf_counter_ns()
        rounds = sched.schedule()
        t1 = time.perf_counter_ns()
        steady = len(sched.workers[0].running) == num_seqs and not sched.workers[0].waiting
        if 0 in rounds:
            worker.submit(rounds[0])
            if steady:
                schedule_ns.append(t1 - t0)
        # Keep one round queued on the worker (pipelining): run the oldest round only.
        if len(worker.queue) + (worker.current is not None) >= 2 or 0 not in rounds:
            for out in worker.run_round():
                t2 = time.perf_counter_ns()
                sched.update_from_output(0, out, sink)
                if steady:
                    output_ns.append(time.perf_counter_ns() - t2)
            rounds_done += steady
        sink.by_connection.clear()
    return Timing(num_seqs, num_scheduler_steps, statistics.median(schedule_ns) / 1e3,
                  statistics.median(output_ns) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    for num_steps in args.num_scheduler_steps:
        for num_seqs in args.num_seqs:
            t = measure(num_seqs, num_steps)
            sys.stdout.write(f"num_seqs={t.num_seqs:5d} num_scheduler_steps={t.num_scheduler_steps}: "
                             f"schedule() {t.schedule_us:8.1f} us/round, output {t.output_us:8.1f} us/step\n")


if __name__ == "__main__":
    main()
