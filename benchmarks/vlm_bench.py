"""`python -m benchmarks.vlm_bench`: a vision-language model through spindle against transformers `generate`.

A random LLaVA checkpoint (CLIP tower + Llama, built by shared/tiny_vlm.py at a size where one
request takes tens of milliseconds on a CPU) answers N chat requests (default 32), each one PNG
image as a data: URL plus a short question, max_tokens 16, greedy, ignore_eos. Two workloads:

    shared    every request carries the same image and the same text prefix (encoder-cache and
              prefix-cache hits after the first);
    distinct  every request a different image (random pixels, fixed seed).

spindle: a fresh `spindle serve` per workload, driven by the asyncio load client at a fixed
concurrency (default 8) over streamed /v1/chat/completions, after one untimed request with
another image. Reported: requests/s, TTFT p50/p90, mean latency, and the scheduler's
`spindle:encoder_cache_hits_total`, `spindle:encoder_items_encoded_total` and
`spindle:prefix_cache_hits_total` (scraped from its /metrics before and after the timed run;
the difference is shown; prefix-cache hits are prompt tokens, encoder-cache hits are images a chunk
needed that were cached or being encoded already, so an image whose blocks all come from the prefix
cache counts as neither encoded nor hit). Each spindle answer is compared with transformers' (logged).
transformers: `LlavaForConditionalGeneration.generate` on the same
requests one at a time in this process (processor from the model dir, preprocessing timed too).
Prints a markdown table with spindle / transformers ratios and writes JSON to benchmarks/results/.

    python -m benchmarks.vlm_bench            # 32 requests per workload, concurrency 8
    python -m benchmarks.vlm_bench --quick    # 8 requests per workload
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.limit import machine_cores
from benchmarks.load_client import LoadConfig, _cached_tokens, run_with_warmup
from benchmarks.metrics import LatencyStats, RequestResult
from benchmarks.models import REPO
from benchmarks.report import format_ms, machine_info
from benchmarks.soak_probe import metric_samples, read_metrics
from shared.ports import free_port
from shared.tiny_vlm import TinyVlmSpec, build_vlm

logger = logging.getLogger("benchmarks.vlm_bench")

RESULTS_DIR = REPO / "benchmarks" / "results"
SHARED, DISTINCT = "shared", "distinct"
WORKLOADS = (SHARED, DISTINCT)
SPINDLE, HF = "spindle", "transformers"
# Big enough that a request costs tens of ms on a CPU: 64 image tokens of a 4-layer tower, a 4-layer Llama.
BENCH_SPEC = TinyVlmSpec(image_size=64, patch_size=8, vision_hidden=128, vision_layers=4, text_hidden=256,
                         text_layers=4, init_std=0.05)
QUESTION = "Describe this picture in a few words, please."
SCHEDULER_COUNTERS = {"encoder_cache_hits": "spindle:encoder_cache_hits_total",
                      "encoder_items_encoded": "spindle:encoder_items_encoded_total",
                      "prefix_cache_hits": "spindle:prefix_cache_hits_total"}
WARMUP_SEED = 1_000_003  # the warmup image differs from every timed one


@dataclass(frozen=True, slots=True)
class VlmSettings:
    """Everything one run measures; recorded verbatim in the results JSON."""

    num_requests: int = 32
    concurrency: int = 8
    max_tokens: int = 16
    image_px: int = 96  # sent images are this square size; the processor resizes them
    num_threads: int = 1
    seed: int = 0
    spindle_args: tuple[str, ...] = ()
    server_timeout_s: float = 600.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if min(self.num_requests, self.concurrency, self.max_tokens, self.image_px, self.num_threads) < 1:
            raise ValueError("num_requests, concurrency, max_tokens, image_px and num_threads must be >= 1")


@dataclass(frozen=True, slots=True)
class VlmRequest:
    image_png: bytes
    text: str
    max_tokens: int

    def chat_payload(self, model: str) -> dict[str, object]:
        url = "data:image/png;base64," + base64.b64encode(self.image_png).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": self.text}]
        return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@dataclass(slots=True)
class VlmRow:
    workload: str
    system: str
    num_ok: int
    num_requests: int
    duration_s: float
    requests_per_s: float
    mean_latency_s: float
    ttft: LatencyStats | None = None
    counters: dict[str, float] = field(default_factory=dict)
    cached_prompt_tokens: int = 0
    outputs: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class ChatResult(RequestResult):
    """A RequestResult that keeps the answer text (checked against transformers')."""

    text: str = ""


def random_png(seed: int, px: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((px, px, 3)) * 255).astype("uint8")
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def build_requests(workload: str, s: VlmSettings) -> list[VlmRequest]:
    """shared: one image, one text for all; distinct: image i from seed + i, same text."""
    if workload == SHARED:
        image = random_png(s.seed, s.image_px)
        return [VlmRequest(image, QUESTION, s.max_tokens) for _ in range(s.num_requests)]
    return [VlmRequest(random_png(s.seed + 1 + i, s.image_px), QUESTION, s.max_tokens)
            for i in range(s.num_requests)]


async def send_chat(session: aiohttp.ClientSession, config: LoadConfig, request: VlmRequest) -> RequestResult:
    """One streamed chat completion, timed per content chunk; records server faults, never raises for them."""
    result = ChatResult(prompt_len=0, expected_output_tokens=request.max_tokens)
    chunks: list[str] = []
    start = last = time.perf_counter()
    try:
        async with session.post(config.url("chat/completions"), json=request.chat_payload(config.model)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                choices = chunk.get("choices") or []
                text = (choices[0].get("delta") or {}).get("content") if choices else None
                if text:
                    if not chunks:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last = now
                    chunks.append(text)
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.prompt_len = int(usage.get("prompt_tokens") or 0)
                    result.cached_prompt_tokens = _cached_tokens(usage)
        result.e2e_s = time.perf_counter() - start
        if not chunks:
            result.error = "stream ended without any output chunk"
        result.text = "".join(chunks)
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def scrape_counters(port: int) -> dict[str, float]:
    """The scheduler's counters of SCHEDULER_COUNTERS, summed over workers."""
    text = read_metrics(port)
    return {key: sum(v for _, v in metric_samples(text, name)) for key, name in SCHEDULER_COUNTERS.items()}


def run_spindle(workload: str, model_dir: Path, s: VlmSettings, stem: str) -> VlmRow:
    """A fresh server with metrics on (frontend, scheduler +1, worker +2), one warmup request, the timed run."""
    from benchmarks.spindle_server import spindle_server

    requests = build_requests(workload, s)
    warmup = [VlmRequest(random_png(s.seed + WARMUP_SEED, s.image_px), QUESTION, s.max_tokens)]
    metrics_port = free_port(count=3)
    log_path = RESULTS_DIR / f"vlm-{stem}-{workload}.log"
    with spindle_server(model_dir, "--metrics-port", str(metrics_port), *s.spindle_args, num_threads=s.num_threads,
                        log_path=log_path, timeout_s=s.server_timeout_s) as server:
        config = LoadConfig(base_url=server.http_url, model=server.model_name, concurrency=s.concurrency,
                            seed=s.seed, timeout_s=s.request_timeout_s, show_progress=False)

        async def go() -> tuple[dict[str, float], object, dict[str, float]]:
            await run_with_warmup(replace(config), warmup, (), send_chat)
            before = scrape_counters(metrics_port + 1)
            run = await run_with_warmup(config, requests, (), send_chat)
            return before, run, scrape_counters(metrics_port + 1)

        before, run, after = asyncio.run(go())
    summary = run.summary  # type: ignore[attr-defined]
    ok = [r for r in run.results if r.is_success]  # type: ignore[attr-defined]
    return VlmRow(workload, SPINDLE, summary.num_completed, summary.num_requests, summary.duration_s,
                  summary.request_throughput, summary.e2e.mean_ms / 1000, summary.ttft,
                  {k: after[k] - before[k] for k in after}, summary.total_cached_prompt_tokens,
                  [getattr(r, "text", "") for r in ok], "; ".join(summary.errors) or None)


def run_transformers(workload: str, model_dir: Path, s: VlmSettings) -> VlmRow:
    """`generate` per request, one at a time, preprocessing included; one untimed request first."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(s.num_threads)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def answer(req: VlmRequest) -> str:
        parts = [{"type": "image"}, {"type": "text", "text": req.text}]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        image = Image.open(io.BytesIO(req.image_png)).convert("RGB")
        inputs = processor(images=[image], text=text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=req.max_tokens, min_new_tokens=req.max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=3)
        return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    answer(VlmRequest(random_png(s.seed + WARMUP_SEED, s.image_px), QUESTION, s.max_tokens))
    latencies, outputs = [], []
    start = time.perf_counter()
    for req in build_requests(workload, s):
        t0 = time.perf_counter()
        outputs.append(answer(req))
        latencies.append(time.perf_counter() - t0)
    duration = time.perf_counter() - start
    return VlmRow(workload, HF, len(latencies), len(latencies), duration, len(latencies) / duration,
                  float(np.mean(latencies)), outputs=outputs)


def format_table(rows: Sequence[VlmRow]) -> str:
    """One line per (workload, system); spindle rows carry the ratios to transformers on the same workload."""
    head = ("| workload | system | ok | req/s | TTFT p50 | TTFT p90 | mean latency | encoder-cache hits "
            "| images encoded | prefix-cache hit tokens | req/s ratio | latency ratio |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        if r.error and r.num_ok == 0:
            lines.append(f"| {r.workload} | {r.system} | 0/{r.num_requests} | failed: {r.error[:80]} |")
            continue
        base = next((b for b in rows if b.workload == r.workload and b.system == HF and b.num_ok), None)
        rps = f"{r.requests_per_s / base.requests_per_s:.2f}x" if base and r.system == SPINDLE else "-"
        lat = f"{r.mean_latency_s / base.mean_latency_s:.2f}x" if base and r.system == SPINDLE else "-"
        ttft = (format_ms(r.ttft.p50_ms), format_ms(r.ttft.p90_ms)) if r.ttft else ("-", "-")
        c = [f"{r.counters[k]:.0f}" if k in r.counters else "-" for k in SCHEDULER_COUNTERS]
        lines.append(f"| {r.workload} | {r.system} | {r.num_ok}/{r.num_requests} | {r.requests_per_s:.2f} "
                     f"| {ttft[0]} | {ttft[1]} | {format_ms(r.mean_latency_s * 1000)} | {c[0]} | {c[1]} | {c[2]} "
                     f"| {rps} | {lat} |")
    return "\n".join(lines) + "\n"


def run_all(s: VlmSettings, model_dir: Path, stem: str) -> list[VlmRow]:
    rows: list[VlmRow] = []
    for workload in WORKLOADS:
        for system in (HF, SPINDLE):
            logger.info("%s / %s: %d requests", workload, system, s.num_requests)
            try:
                row = (run_transformers(workload, model_dir, s) if system == HF
                       else run_spindle(workload, model_dir, s, stem))
            except Exception as exc:  # one broken run must not lose the others' figures
                logger.exception("%s / %s failed", workload, system)
                row = VlmRow(workload, system, 0, s.num_requests, 0.0, 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")
            logger.info("    %.2f req/s, mean %.1f ms", row.requests_per_s, row.mean_latency_s * 1000)
            rows.append(row)
        _check_outputs([r for r in rows if r.workload == workload])
    return rows


def _check_outputs(rows: Sequence[VlmRow]) -> None:
    """Greedy outputs should agree; a mismatch is logged (the benchmark still reports the figures)."""
    hf = next((r for r in rows if r.system == HF and r.num_ok), None)
    sp = next((r for r in rows if r.system == SPINDLE and r.num_ok == r.num_requests), None)
    if hf and sp:
        same = sum(a == b for a, b in zip(hf.outputs, sp.outputs, strict=False))
        logger.info("    %d of %d spindle outputs equal transformers'", same, len(hf.outputs))


def parse_settings(argv: Sequence[str] | None) -> VlmSettings:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vlm_bench", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="8 requests per workload")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=machine_cores(), help="torch threads, both sides (default: all)")
    p.add_argument("--spindle-arg", action="append", default=[], help="extra flag for spindle serve (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    return VlmSettings(num_requests=8 if a.quick else a.num_requests, concurrency=a.concurrency,
                       max_tokens=a.max_tokens, num_threads=a.threads, seed=a.seed, spindle_args=tuple(a.spindle_arg))


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    stem = time.strftime("%Y%m%d-%H%M%S")
    logger.info("VLM benchmark %s: %s, model %s", stem, settings, BENCH_SPEC)
    with tempfile.TemporaryDirectory(prefix="spindle-vlm-bench-") as tmp:
        model_dir = build_vlm(Path(tmp) / "bench-llava", BENCH_SPEC)
        rows = run_all(settings, model_dir, stem)
    table = format_table(rows)
    sys.stdout.write("\n" + table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"timestamp": stem, "machine": machine_info(settings.num_threads), "settings": asdict(settings),
            "model": asdict(BENCH_SPEC), "note": "compare ratios measured in this run only"}
    json_rows = [{**asdict(r), "ttft": asdict(r.ttft) if r.ttft else None} for r in rows]
    (RESULTS_DIR / f"vlm-{stem}.json").write_text(json.dumps({**meta, "rows": json_rows}, indent=1, default=str))
    (RESULTS_DIR / f"vlm-{stem}.md").write_text(table)
    if all(r.num_ok == 0 for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
