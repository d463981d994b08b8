"""`python -m benchmarks.soak` (`make soak`): hours of abuse in minutes, then is everything back?

Starts a fresh `spindle serve` (free loopback ports, its own process group) on the small random
benchmark model and drives `--streams` (256) concurrent clients for `--duration-s` (600):
OpenAI HTTP completions and chat (streamed or not) and gRPC Generate streams, with random
prompts (token ids or text, some sharing a prefix), random sampling settings, clients that
cancel or hang up mid-stream, and requests that break a validation rule. Every
`--progress-s` it prints the requests completed, aborted, rejected and failed, tokens/s, each
service's RSS, KV blocks in use and open requests.

A warm-up (`--warmup-s`) of the same traffic comes first; once it settles, each process's RSS
is the baseline. After the load stops (requests in flight finish) and the server settles, the
checks of benchmarks/soak_checks.py run: KV blocks and open requests back to zero, no
unexpected answer, no service restarted, RSS within the larger of +15 % and +64 MiB of the
baseline. Exit status 1 if any check fails. A summary JSON and the server's log go to
benchmarks/results/.

    python -m benchmarks.soak                                   # 256 streams, 10 minutes
    python -m benchmarks.soak --duration-s 60 --streams 64 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from benchmarks.limit import machine_cores
from benchmarks.models import REPO, ensure_model
from benchmarks.soak_checks import MIB, Check, all_checks
from benchmarks.soak_grpc import Channels, send_grpc
from benchmarks.soak_http import send_http
from benchmarks.soak_outcome import ABORTED, COMPLETED, ERROR, REJECTED, Outcome, Tally, judge_failure
from benchmarks.soak_probe import Probe, Snapshot
from benchmarks.soak_shapes import Mix, Shape, ShapeSource
from benchmarks.spindle_server import spindle_server
from shared.ports import free_port
from tests.e2e.server import RunningServer

logger = logging.getLogger("benchmarks.soak")

RESULTS_DIR = REPO / "benchmarks" / "results"


@dataclass(frozen=True, slots=True)
class SoakSettings:
    duration_s: float = 600.0
    streams: int = 256
    warmup_s: float = 60.0
    settle_s: float = 60.0
    progress_s: float = 10.0
    request_timeout_s: float = 300.0
    seed: int = 0
    workers: int = 1
    kv_cache_bytes: int | None = 40 * MIB
    model_dir: str = ""  # empty: the small benchmark model, built if missing
    rss_pct: float = 15.0
    rss_mib: float = 64.0
    mix: Mix = Mix()
    # Regular expressions of server log errors not to count (a known issue being worked on).
    allowed_log: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.streams < 1 or self.warmup_s < 0 or self.progress_s <= 0:
            raise ValueError("--duration-s and --progress-s must be positive, --streams at least 1, "
                             "--warmup-s not negative")


class Target:
    """Where a stream sends its shapes: the server's HTTP and gRPC APIs, over shared connections."""

    def __init__(self, server: RunningServer, http: aiohttp.ClientSession, channels: Channels) -> None:
        self.server = server
        self.http = http
        self.channels = channels

    async def send(self, shape: Shape) -> Outcome:
        if shape.protocol == "grpc":
            return await send_grpc(self.channels, self.server.model_name, shape)
        return await send_http(self.http, self.server.http_url, self.server.model_name, shape)


async def _stream(target: Target, source: ShapeSource, until: float, tally: Tally, timeout_s: float) -> None:
    """One client: request after request until `until` (the last one runs to its end)."""
    while time.monotonic() < until:
        shape = source.next()
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await target.send(shape)
        except TimeoutError:
            outcome = judge_failure(shape, 0, f"no answer within {timeout_s:.0f} s")
        except Exception as exc:  # a client-side surprise must not end the stream; it fails the soak instead
            logger.exception("sending %s failed", shape.protocol)
            outcome = judge_failure(shape, 0, f"client exception {type(exc).__name__}: {exc}")
        tally.add(outcome)


def _mib(n: int) -> str:
    return f"{n / MIB:.0f}"


class Reporter:
    """Prints a progress line every `every_s` seconds while the load runs.

    Counts are of requests that ended; tokens/s is the output tokens those requests received
    over the interval (a long stream counts when it ends, so the figure is bursty)."""

    def __init__(self, probe: Probe, tally: Tally, every_s: float) -> None:
        self.probe, self.tally, self.every_s = probe, tally, every_s
        self.phase_start = time.monotonic()
        self._last = (self.phase_start, 0)

    async def line(self, phase: str) -> str:
        now = time.monotonic()
        last_at, last_tokens = self._last
        self._last = (now, self.tally.tokens)
        rate = (self.tally.tokens - last_tokens) / max(now - last_at, 1e-9)
        k = self.tally.kinds
        head = (f"[{phase} {now - self.phase_start:4.0f}s] completed {k[COMPLETED]} aborted {k[ABORTED]} "
                f"rejected {k[REJECTED]} errors {k[ERROR]} | {rate:6.0f} tok/s")
        try:
            snap = await self.probe.snapshot()
        except Exception as exc:  # the probe failing is worth a line, not the end of the soak
            return f"{head} | probe failed: {type(exc).__name__}: {exc}"
        rss = " ".join(f"{name} {_mib(v)}" for name, v in snap.rss.items())
        return (f"{head} | KV {snap.kv_used_blocks}/{snap.kv_blocks} blocks, running {snap.running}, "
                f"waiting {snap.waiting}, frontend in flight {snap.frontend_in_flight}, "
                f"preemptions {snap.preemptions} | RSS MiB {rss}")

    async def run(self, phase: str) -> None:
        self.phase_start = time.monotonic()
        while True:
            await asyncio.sleep(self.every_s)
            print(await self.line(phase), flush=True)


async def _load(target: Target, source: ShapeSource, settings: SoakSettings, seconds: float, tally: Tally,
                reporter: Reporter, phase: str) -> float:
    """`settings.streams` clients for `seconds`; returns when the last request in flight ended."""
    start = time.monotonic()
    progress = asyncio.create_task(reporter.run(phase))
    try:
        await asyncio.gather(*(_stream(target, source, start + seconds, tally, settings.request_timeout_s)
                               for _ in range(settings.streams)))
    finally:
        progress.cancel()
    return time.monotonic() - start


async def _settle(probe: Probe, timeout_s: float) -> tuple[Snapshot, float]:
    """Wait until the server is idle (or `timeout_s`); the last snapshot and the seconds it took."""
    start = time.monotonic()
    while True:
        snap = await probe.snapshot()
        if snap.idle or time.monotonic() - start >= timeout_s:
            return snap, time.monotonic() - start
        await asyncio.sleep(0.5)


async def run_soak(server: RunningServer, metrics_port: int, settings: SoakSettings,
                   log_path: Path) -> tuple[list[Check], dict]:
    """Warm up, take the baseline, load, settle, check. Returns the checks and a JSON summary.

    `log_path` is the server's log; what it gains from now on is checked for errors.
    """
    log_start = log_path.stat().st_size
    probe = Probe(server.process.pid, metrics_port)
    channels = Channels(server.grpc_address)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None))
    try:
        info = await probe.info()
        max_total = min(info.max_model_len, info.max_request_tokens or info.max_model_len)
        source = ShapeSource(settings.seed, info.vocab_size, max_total, settings.mix)
        target = Target(server, http, channels)
        tally = Tally()
        reporter = Reporter(probe, tally, settings.progress_s)
        print(f"soak: {settings.streams} streams, {settings.duration_s:.0f} s after a {settings.warmup_s:.0f} s "
              f"warm-up; model {server.model_name} (vocab {info.vocab_size}, {max_total} tokens per request, "
              f"{info.num_kv_blocks} KV blocks, {info.num_workers} worker(s))", flush=True)
        if settings.warmup_s:
            await _load(target, source, settings, settings.warmup_s, tally, reporter, "warm-up")
        baseline, waited = await _settle(probe, settings.settle_s)
        print(f"baseline after warm-up ({'idle' if baseline.idle else 'NOT idle'} after {waited:.1f} s): RSS MiB "
              + " ".join(f"{name} {_mib(v)}" for name, v in baseline.rss.items()), flush=True)
        tokens_before, kinds_before = tally.tokens, tally.total
        elapsed = await _load(target, source, settings, settings.duration_s, tally, reporter, "soak")
        print(f"load stopped after {elapsed:.0f} s; {await reporter.line('stopped')}", flush=True)
        final, waited = await _settle(probe, settings.settle_s)
        with log_path.open("rb") as log:
            log.seek(log_start)
            log_lines = log.read().decode(errors="replace").splitlines()
        checks = all_checks(tally, baseline, final, settings.rss_pct, settings.rss_mib, log_lines,
                            settings.allowed_log, expect_aborts=settings.mix.abort > 0,
                            expect_invalid=settings.mix.invalid > 0)
        summary = {
            "settings": {**asdict(settings), "mix": asdict(settings.mix)},
            "model": server.model_name,
            "load_s": round(elapsed, 1),
            "settle_s": round(waited, 1),
            "requests": dict(tally.kinds),
            "requests_by_protocol": {f"{p} {k}": n for (p, k), n in sorted(tally.by_protocol.items())},
            "soak_requests": tally.total - kinds_before,
            "tokens_per_s": round((tally.tokens - tokens_before) / elapsed, 1),
            "preemptions": final.preemptions,
            "rss_mib": {name: {"baseline": round(v / MIB, 1), "final": round(final.rss.get(name, 0) / MIB, 1)}
                        for name, v in baseline.rss.items()},
            "errors": tally.examples,
            "checks": [asdict(c) for c in checks],
        }
        return checks, summary
    finally:
        await http.close()
        await channels.close()
        await probe.close()


def _print_summary(checks: list[Check], summary: dict) -> None:
    print("\n=== soak summary ===")
    print(f"load {summary['load_s']} s, settled in {summary['settle_s']} s; requests {summary['requests']}; "
          f"{summary['tokens_per_s']} tokens/s; preemptions {summary['preemptions']}")
    print("by protocol: " + ", ".join(f"{k} {n}" for k, n in summary["requests_by_protocol"].items()))
    for example in summary["errors"]:
        print(f"  error: {example}")
    for check in checks:
        print(check.line())
    print("soak " + ("PASSED" if all(c.ok for c in checks) else "FAILED"), flush=True)


def parse_settings(argv: Sequence[str] | None) -> tuple[SoakSettings, Path]:
    d = SoakSettings()
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="seconds of load after the warm-up")
    p.add_argument("--streams", type=int, default=d.streams, help="concurrent clients")
    p.add_argument("--warmup-s", type=float, default=d.warmup_s, help="seconds of load before the RSS baseline")
    p.add_argument("--settle-s", type=float, default=d.settle_s, help="most seconds to wait for the server to idle")
    p.add_argument("--progress-s", type=float, default=d.progress_s, help="seconds between progress lines")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="a request unanswered this long counts as an error (a hang)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds every request shape")
    p.add_argument("--workers", type=int, default=d.workers, help="spindle serve --workers")
    p.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes,
                   help="KV cache per worker: small enough that 256 streams fill it now and then")
    p.add_argument("--model-dir", default=d.model_dir, help="checkpoint to serve (default: the small bench model)")
    p.add_argument("--rss-pct", type=float, default=d.rss_pct, help="allowed RSS growth in percent ...")
    p.add_argument("--rss-mib", type=float, default=d.rss_mib, help="... or in MiB, whichever is larger")
    for name, help_text in (("grpc", "share of requests sent over gRPC"), ("abort", "share the client aborts"),
                            ("invalid", "share that break a validation rule"),
                            ("chat", "share of HTTP requests that are chat completions"),
                            ("non_stream", "share of HTTP requests not streamed")):
        p.add_argument(f"--{name.replace('_', '-')}-fraction", dest=name, type=float, default=getattr(d.mix, name),
                       help=help_text)
    p.add_argument("--allow-log", action="append", default=[], metavar="REGEX",
                   help="a server log error matching this is not counted (repeatable)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where the summary JSON and server log go")
    a = p.parse_args(argv)
    try:
        mix = Mix(grpc=a.grpc, chat=a.chat, non_stream=a.non_stream, abort=a.abort, invalid=a.invalid)
        settings = SoakSettings(
            duration_s=a.duration_s, streams=a.streams, warmup_s=a.warmup_s, settle_s=a.settle_s,
            progress_s=a.progress_s, request_timeout_s=a.request_timeout_s, seed=a.seed, workers=a.workers,
            kv_cache_bytes=a.kv_cache_bytes, model_dir=a.model_dir, rss_pct=a.rss_pct, rss_mib=a.rss_mib, mix=mix,
            allowed_log=tuple(a.allow_log))
    except ValueError as exc:
        p.error(str(exc))
    return settings, a.out_dir


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings, out_dir = parse_settings(argv)
    stem = time.strftime("soak-%Y%m%d-%H%M%S")
    model_dir = Path(settings.model_dir) if settings.model_dir else ensure_model("small")
    metrics_port = free_port(count=3 + settings.workers)
    args = ["--workers", str(settings.workers), "--metrics-port", str(metrics_port)]
    if settings.kv_cache_bytes:
        args += ["--kv-cache-bytes", str(settings.kv_cache_bytes)]
    log_path = out_dir / f"{stem}.log"
    print(f"starting spindle serve on {model_dir} (log {log_path})", flush=True)
    with spindle_server(model_dir, *args, num_threads=machine_cores(), log_path=log_path) as server:
        checks, summary = asyncio.run(run_soak(server, metrics_port, settings, log_path))
    _print_summary(checks, summary)
    out = out_dir / f"{stem}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary: {out}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
