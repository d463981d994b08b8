"""Traces and metrics through the real services: a real OTLP/gRPC receiver and Prometheus scrapes.

16 concurrent requests (8 over HTTP, 8 over gRPC), each with its own client `traceparent`,
must each come back as one connected trace: the frontend's request span (child of the
client's span) -> the scheduler's request span -> the worker's request span, with the GenAI
attributes; worker rounds are spans linked to the requests they served. Then each service's
/metrics must count exactly that workload.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from benchmarks.otlp_receiver import ReceivedSpan, otlp_receiver
from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc
from shared.ports import free_port
from tests.e2e.clients import grpc_channel
from tests.e2e.metrics import metric_sum, scrape
from tests.e2e.server import RunningServer, spindle_serve

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 16
MAX_TOKENS = 6
PROMPT = "the quick brown fox jumps over the lazy dog"


def _client_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _http_completion(server: RunningServer, traceparent: str) -> dict:
    body = json.dumps({"model": server.model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(server.http_url + "/v1/completions", data=body,
                                 headers={"content-type": "application/json", "traceparent": traceparent})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


async def _grpc_generate(server: RunningServer, traceparent: str) -> str:
    async with grpc_channel(server.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        sampling = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = generation_pb2.GenerateRequest(model=server.model_name, text=PROMPT, sampling=sampling)
        finish = ""
        async for response in stub.Generate(request, metadata=(("traceparent", traceparent),)):
            if response.HasField("complete"):
                finish = generation_pb2.FinishReason.Name(response.complete.finish_reason)
        return finish


async def _workload(server: RunningServer, traceparents: list[str]) -> None:
    half = len(traceparents) // 2
    http = [asyncio.to_thread(_http_completion, server, tp) for tp in traceparents[:half]]
    grpc_calls = [_grpc_generate(server, tp) for tp in traceparents[half:]]
    results = await asyncio.gather(*http, *grpc_calls)
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results[:half])
    assert all(r == "FINISH_REASON_LENGTH" for r in results[half:])


def _complete(spans: list[ReceivedSpan], trace_ids: set[str]) -> bool:
    by_trace: dict[str, set[str]] = defaultdict(set)
    for span in spans:
        by_trace[span.trace_id].add(span.name)
    expected = {"scheduler.request", "worker.prefill", "validate", "tokenize", "text_completion tiny-llama"}
    return all(expected <= by_trace[t] for t in trace_ids)


def test_each_request_is_one_connected_trace_and_metrics_count_it(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    with otlp_receiver() as receiver:
        metrics_port = free_port(count=3)
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{receiver.address}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with spindle_serve(model, "--metrics-port", str(metrics_port), extra_env=env) as server:
            clients = [_client_traceparent() for _ in range(NUM_REQUESTS)]
            asyncio.run(_workload(server, [tp for tp, _, _ in clients]))
            trace_ids = {trace_id for _, trace_id, _ in clients}
            spans = receiver.wait_for(lambda s: _complete(s, trace_ids))
            frontend, scheduler, worker = (scrape(metrics_port + i) for i in range(3))

    by_id = {s.span_id: s for s in spans}
    for _, trace_id, client_span_id in clients:
        trace = [s for s in spans if s.trace_id == trace_id]
        names = {s.name for s in trace}
        assert {"scheduler.request", "worker.prefill", "validate", "tokenize"} <= names, names
        [root] = [s for s in trace if s.parent_span_id == client_span_id and s.service == "spindle-frontend"
                  and s.name.startswith("text_completion")]
        [sched] = [s for s in trace if s.name == "scheduler.request"]
        [work] = [s for s in trace if s.name == "worker.prefill"]
        assert (sched.service, sched.parent_span_id) == ("spindle-scheduler", root.span_id)
        assert (work.service, work.parent_span_id) == ("spindle-worker", sched.span_id)
        assert {s.parent_span_id for s in trace} <= {client_span_id, *(s.span_id for s in trace)}  # connected
        a = root.attributes
        assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == server.model_name
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (MAX_TOKENS, 0.0)
        assert a["gen_ai.usage.output_tokens"] == MAX_TOKENS and a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["spindle.time_to_first_token_s"] > 0 and "spindle.prefix_cache_hit_tokens" in a
        assert sched.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert {"scheduled", "first_token"} <= set(sched.events)
        assert "spindle.preemptions" in sched.attributes and "spindle.queue_time_s" in sched.attributes
        # Batched work: round spans (in their own traces) link to this request's worker span.
        linked = [s for s in spans if s.name == "worker.round" and (trace_id, sched.span_id) in s.links]
        assert sum(s.attributes["spindle.num_steps"] for s in linked) >= MAX_TOKENS  # every decode step
    rounds = [s for s in spans if s.name == "worker.round"]
    assert all(link[1] in by_id and by_id[link[1]].name == "scheduler.request" for s in rounds for link in s.links)

    model_label = {"model_name": server.model_name}
    successes = metric_sum(frontend, "spindle:request_success_total", finished_reason="length", **model_label)
    assert successes == NUM_REQUESTS
    assert metric_sum(frontend, "spindle:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert metric_sum(frontend, "spindle:prompt_tokens_total") == sum(
        s.attributes["gen_ai.usage.input_tokens"] for s in spans if s.name.startswith("text_completion"))
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert metric_sum(frontend, f"spindle:{histogram}_count") == NUM_REQUESTS
    assert metric_sum(frontend, "spindle:inter_token_latency_seconds_count") > 0
    # Every worker step's tokens are timed on their way: one observation per step each side.
    to_scheduler = metric_sum(scheduler, "spindle:step_transit_seconds_count", hop="worker_to_scheduler")
    assert to_scheduler > 0
    assert 0 < metric_sum(frontend, "spindle:step_transit_seconds_count", hop="worker_to_frontend") <= to_scheduler
    assert metric_sum(scheduler, "spindle:step_transit_seconds_sum", hop="worker_to_scheduler") / to_scheduler < 1.0
    assert metric_sum(frontend, "spindle:frontend_requests_in_flight") == 0
    assert metric_sum(scheduler, "spindle:request_queue_time_seconds_count") == NUM_REQUESTS
    assert metric_sum(scheduler, "spindle:num_requests_running") == 0
    assert metric_sum(scheduler, "spindle:num_requests_waiting") == 0
    assert metric_sum(scheduler, "spindle:scheduler_requests_total", outcome="finished") == NUM_REQUESTS
    assert metric_sum(scheduler, "spindle:prefix_cache_queries_total", worker="0") > 0
    assert metric_sum(scheduler, "spindle:prefix_cache_hits_total", worker="0") > 0  # 16 identical prompts
    assert metric_sum(scheduler, "spindle:kv_cache_usage_perc", worker="0") == 0
    assert metric_sum(scheduler, "spindle:worker_healthy", worker="0") == 1
    assert metric_sum(scheduler, "spindle:iteration_tokens_total_count") > 0
    assert metric_sum(worker, "spindle:worker_ready") == 1
    assert metric_sum(worker, "spindle:worker_cpu_kernels", target="native") == 1  # `make install` built them
    assert metric_sum(worker, "spindle:worker_step_duration_seconds_count") >= MAX_TOKENS
    assert metric_sum(worker, "spindle:worker_round_duration_seconds_count") > 0
    # Where the steps' time went (step_phases.py): every text-model phase ran, inside the rounds.
    phases = {p: metric_sum(worker, "spindle:worker_step_phase_seconds_total", phase=p)
              for p in ("prepare", "forward", "logits", "sample", "deliver")}
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert sum(phases.values()) <= metric_sum(worker, "spindle:worker_round_duration_seconds_sum")
