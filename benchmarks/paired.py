"""`python -m benchmarks.paired`: two spindle variants served at once, one request at a time in turn.

Why: on the shared 2-core host a served run's speed drifts by 15-25 % within the hour, so two
runs minutes apart cannot show a change of a few percent, and interleaved runs need many pairs.
Here both variants are up together (fresh servers, every core available to each) and each
request of one workload goes to both, one after the other, the order swapping every request;
only one request is ever in flight, so each server runs alone while it answers. A drift of the
host then hits both sides of a pair alike, and the pairs' differences show what the variants
change. Reported: each side's mean and median latency (and output tokens/s for completions), the
paired difference's mean with a 95 % bootstrap interval, and how often A was faster.

A variant is `LABEL[@TREE][:NAME=VALUE,...]`: the source tree it runs from (default: this one;
a git worktree of another revision, with its protobuf modules generated: `make -C TREE protos`)
and environment variables for its services, as `benchmarks.run --spindle-env-variant` takes them.

    python -m benchmarks.paired --a new --b old@/tmp/wt-base              # embeddings, one sentence a request
    python -m benchmarks.paired --a socket --b grpc:SPINDLE_SCHEDULER_STEP_PORT=-1 \\
        --workload completion --model small --spindle-arg=--dtype --spindle-arg=bfloat16

Idle threads of the other server (OpenMP spinning after its last op, heartbeats) cost both sides
alike; absolute latencies are for the pair, the difference is the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.cli_args import env_variant
from benchmarks.embed_client import EmbedBatch, EmbeddingSender, make_batches
from benchmarks.limit import machine_cores
from benchmarks.load_client import LoadConfig, send_request
from benchmarks.metrics import RequestResult
from benchmarks.models import BENCH_MODELS, REPO, ensure_model
from benchmarks.report import machine_info
from benchmarks.workload import BenchRequest, WorkloadSpec, build_workload, english_like_sentences

logger = logging.getLogger("benchmarks.paired")

RESULTS_DIR = REPO / "benchmarks" / "results"
WORKLOADS = ("embed", "completion")
BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True, slots=True)
class Variant:
    """One side: a label, the source tree its services run from and their extra environment."""

    label: str
    tree: Path = REPO
    env: tuple[tuple[str, str], ...] = ()


def parse_variant(text: str) -> Variant:
    """'old@/tmp/wt:NAME=1' -> Variant('old', Path('/tmp/wt'), (('NAME', '1'),))."""
    head, sep, assignments = text.partition(":")
    label, _, tree = head.partition("@")
    label, env = env_variant(f"{label}{sep}{assignments}")
    path = Path(tree).resolve() if tree else REPO
    if not (path / "services" / "cli.py").is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a spindle source tree (no services/cli.py)")
    if not (path / "shared" / "pb" / "spindle" / "v1" / "common_pb2.py").is_file():
        raise argparse.ArgumentTypeError(f"{path} has no generated protobuf modules: run `make -C {path} protos`")
    return Variant(label, path, env)


@dataclass(slots=True)
class Side:
    """What one variant measured: per request, in workload order."""

    variant: Variant
    latencies_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, result: RequestResult) -> None:
        if result.error is not None:
            self.errors.append(result.error)
        self.latencies_s.append(result.e2e_s if result.error is None else float("nan"))
        self.output_tokens.append(result.output_tokens)


@dataclass(frozen=True, slots=True)
class PairedSummary:
    """A against B over the requests both answered. Times in ms; `diff` is A minus B (negative: A faster)."""

    num_pairs: int
    a_mean_ms: float
    a_median_ms: float
    b_mean_ms: float
    b_median_ms: float
    diff_mean_ms: float
    diff_ci95_ms: tuple[float, float]
    diff_median_ms: float
    a_faster_share: float
    b_over_a: float  # B's mean latency over A's: above 1, A is faster by that factor
    a_tokens_per_s: float | None = None  # completions: output tokens over the latencies' sum
    b_tokens_per_s: float | None = None


def summarize(a: Side, b: Side, seed: int = 0) -> PairedSummary:
    """Paired statistics of two sides' latencies (pairs where either failed are left out)."""
    la, lb = np.asarray(a.latencies_s), np.asarray(b.latencies_s)
    ok = ~(np.isnan(la) | np.isnan(lb))
    if not ok.any():
        raise ValueError("no request was answered by both variants")
    la, lb = la[ok] * 1e3, lb[ok] * 1e3
    diff = la - lb
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), (BOOTSTRAP_SAMPLES, len(diff)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    rates: list[float | None] = [None, None]
    if any(a.output_tokens) or any(b.output_tokens):
        for i, (side, lat) in enumerate(((a, la), (b, lb))):
            tokens = np.asarray(side.output_tokens)[ok]
            rates[i] = float(tokens.sum() / (lat.sum() / 1e3))
    return PairedSummary(
        num_pairs=int(ok.sum()), a_mean_ms=float(la.mean()), a_median_ms=float(np.median(la)),
        b_mean_ms=float(lb.mean()), b_median_ms=float(np.median(lb)), diff_mean_ms=float(diff.mean()),
        diff_ci95_ms=(float(low), float(high)), diff_median_ms=float(np.median(diff)),
        a_faster_share=float((diff < 0).mean()), b_over_a=float(lb.mean() / la.mean()),
        a_tokens_per_s=rates[0], b_tokens_per_s=rates[1])


def format_summary(summary: PairedSummary, a: Side, b: Side) -> str:
    """A few lines for the terminal."""
    s = summary
    lines = [f"{s.num_pairs} pairs, one request in flight, order swapped every request"]
    for side, mean, median, rate in ((a, s.a_mean_ms, s.a_median_ms, s.a_tokens_per_s),
                                     (b, s.b_mean_ms, s.b_median_ms, s.b_tokens_per_s)):
        extra = f", {rate:,.1f} output tok/s" if rate is not None else ""
        failed = f", {len(side.errors)} failed" if side.errors else ""
        lines.append(f"  {side.variant.label:>12}: mean {mean:.2f} ms, median {median:.2f} ms{extra}{failed}")
    low, high = s.diff_ci95_ms
    lines.append(f"  A - B: mean {s.diff_mean_ms:+.3f} ms (95 % CI {low:+.3f} .. {high:+.3f}), "
                 f"median {s.diff_median_ms:+.3f} ms; A faster in {s.a_faster_share:.0%} of pairs; "
                 f"B / A = {s.b_over_a:.3f}")
    return "\n".join(lines)


def _embed_workload(model_dir: Path, num: int, seed: int) -> list[EmbedBatch]:
    """`num` seeded sentences of 8-200 words, one per request, with the token counts the sender checks."""
    from sentence_transformers import SentenceTransformer

    from benchmarks.embed_bench import count_tokens

    sentences = english_like_sentences(num, seed=seed)
    return make_batches(sentences, count_tokens(SentenceTransformer(str(model_dir), device="cpu"), sentences), 1)


def _completion_workload(model: str, num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    return build_workload(WorkloadSpec(kind="random", num_requests=num, input_len=input_len, output_len=output_len,
                                       vocab_high=BENCH_MODELS[model].vocab_size, seed=seed))


async def _alternate(configs: Sequence[LoadConfig], requests: Sequence[object], sender: object,
                     sides: Sequence[Side] | None, progress_every: int) -> None:
    """Each request to both servers in turn (A first on even requests), one at a time."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=configs[0].timeout_s)) as session:
        for i, request in enumerate(requests):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                result = await sender(session, configs[k], request)  # type: ignore[operator]
                if sides is not None:
                    sides[k].add(result)
            if sides is not None and progress_every and (i + 1) % progress_every == 0:
                logger.info("%d / %d pairs", i + 1, len(requests))


def run(args: argparse.Namespace) -> tuple[PairedSummary, Side, Side]:
    from benchmarks.spindle_server import spindle_server
    from shared.ports import free_port

    variants = (args.a, args.b)
    if args.workload == "embed":
        from benchmarks.embed_bench import default_model_dir

        model_dir = Path(args.model) if args.model else default_model_dir()
        requests: list[object] = list(_embed_workload(model_dir, args.warmup + args.num_requests, args.seed))
        sender: object = EmbeddingSender("float")
    else:
        model = args.model or "small"
        model_dir = ensure_model(model)
        requests = list(_completion_workload(model, args.warmup + args.num_requests, args.input_len,
                                             args.output_len, args.seed))
        sender = send_request
    stem = time.strftime("%Y%m%d-%H%M%S")
    with contextlib.ExitStack() as stack:
        servers = []
        for v in variants:
            log_path = RESULTS_DIR / f"paired-{stem}-{v.label}.log"
            servers.append(stack.enter_context(spindle_server(
                model_dir, *args.spindle_arg, "--metrics-port", str(free_port(count=3)), num_threads=args.threads,
                log_path=log_path, extra_env=dict(v.env), tree=v.tree)))
        configs = [LoadConfig(base_url=s.http_url, model=s.model_name, concurrency=1, seed=args.seed,
                              timeout_s=args.request_timeout_s, show_progress=False) for s in servers]
        asyncio.run(_alternate(configs, requests[:args.warmup], sender, None, 0))
        sides = [Side(v) for v in variants]
        asyncio.run(_alternate(configs, requests[args.warmup:], sender, sides, max(args.num_requests // 10, 1)))
    summary = summarize(*sides, seed=args.seed)
    print(format_summary(summary, *sides))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"paired-{stem}.json"
    out.write_text(json.dumps({
        "settings": {k: (str(v) if isinstance(v, Path | Variant) else v) for k, v in vars(args).items()},
        "variants": [{"label": v.label, "tree": str(v.tree), "env": dict(v.env)} for v in variants],
        "machine": machine_info(args.threads),
        "summary": asdict(summary),
        "latencies_ms": {s.variant.label: [x * 1e3 for x in s.latencies_s] for s in sides},
        "errors": {s.variant.label: s.errors[:20] for s in sides},
    }, indent=2))
    logger.info("wrote %s", out)
    return summary, *sides


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__.splitlines()[0])
    p.add_argument("--a", type=parse_variant, default=Variant("a"), metavar="LABEL[@TREE][:NAME=VALUE,...]",
                   help="variant A (default: this tree as it is)")
    p.add_argument("--b", type=parse_variant, required=True, metavar="LABEL[@TREE][:NAME=VALUE,...]",
                   help="variant B")
    p.add_argument("--workload", choices=WORKLOADS, default="embed",
                   help="embed: one sentence per /v1/embeddings request; completion: one streamed completion")
    p.add_argument("--model", default=None,
                   help="embed: a model directory (default all-MiniLM-L6-v2); completion: a benchmark model "
                        f"({', '.join(BENCH_MODELS)}; default small)")
    p.add_argument("--num-requests", type=int, default=400, help="timed requests, each sent to both variants")
    p.add_argument("--warmup", type=int, default=40, help="untimed requests first, each to both")
    p.add_argument("--input-len", type=int, default=128, help="completion prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="completion output tokens (ignore_eos)")
    p.add_argument("--spindle-arg", action="append", default=[], help="extra flag for both servers (repeatable)")
    p.add_argument("--threads", type=int, default=machine_cores(), help="torch threads of each server")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.a.label == args.b.label:
        p.error(f"the variants need different labels (both are {args.a.label!r})")
    if args.num_requests < 2:
        p.error("--num-requests must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    run(parse_args(argv))


if __name__ == "__main__":
    main()
