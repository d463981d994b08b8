"""A real OTLP/gRPC trace receiver on loopback: what a collector sees (tests check spans, benchmarks count them)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    events: list[str]
    links: list[tuple[str, str]]  # (trace_id, span_id)


@dataclass
class OtlpReceiver:
    address: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_spans(self) -> int:
        with self.lock:
            return len(self.spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Poll until `done(spans)` holds; returns the spans received so far either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name")), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[e.name for e in s.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links]))
        with self.receiver.lock:
            self.receiver.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    port = server.add_insecure_port("127.0.0.1:0")
    receiver = OtlpReceiver(f"127.0.0.1:{port}")
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    server.start()
    try:
        yield receiver
    finally:
        server.stop(0)
