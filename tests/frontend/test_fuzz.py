"""Property-based fuzzing of the public HTTP and gRPC APIs against a real frontend and a fake scheduler.

Whatever a client sends (random fields, types, sizes and nesting; numbers beyond every wire
type's range; strings that are not Unicode; truncated or random bytes), the answer is a
success or a client error (HTTP 4xx, a client-error gRPC code) within a few seconds: never a
5xx, an exception or a hang. Meanwhile well-formed streams run alongside and must come out
exactly right. Bounded (`max_examples`) and deterministic (`derandomize`, no database).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
import pytest
from aiohttp.http_exceptions import HttpProcessingError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from services.frontend.server import Frontend
from shared.pb.spindle.v1 import common_pb2, generation_pb2_grpc
from shared.pb.spindle.v1 import generation_pb2 as pb
from tests.frontend.conftest import MODEL_NAME, make_config
from tests.frontend.fake_scheduler import FakeScheduler, echo_script, start_fake_scheduler

# Hypothesis caches (unicode tables, constants) go to the temp dir, never into the work tree.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "spindle-hypothesis")
T = TypeVar("T")
TIMEOUT_S = 10.0  # per request: longer means a hang
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}

# ---- the servers: on their own event loop in a thread, so hypothesis drives plain sync clients ----


@dataclass
class Target:
    frontend: Frontend
    fake: FakeScheduler

    @property
    def http_port(self) -> int:
        return int(self.frontend.http_address.rsplit(":", 1)[1])


class ErrorLog(logging.Handler):
    """Every ERROR record logged while fuzzing: an exception a client never saw is still a bug.

    Except aiohttp's own report of a request it refused to parse (a 400 it answered itself).
    """

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        if not (isinstance(error, HttpProcessingError) and error.code < 500):
            self.records.append(record)


class Servers:
    """A fake scheduler and a real frontend per model task (generate, embed), on a private loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self._thread.start()
        self.targets: list[Target] = []
        self._closers: list[Any] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def start(self, tokenizer_dir: Path, task: int) -> None:
        fake = FakeScheduler(task=task, step_interval_s=0.001, tokens_per_step=2)
        server, address = await start_fake_scheduler(fake)
        frontend = Frontend(make_config(tokenizer_dir, address))
        await frontend.start()
        await frontend.scheduler.wait_ready(10)
        self.targets.append(Target(frontend, fake))
        self._closers += [lambda: frontend.stop(0), lambda: server.stop(0)]

    def close(self) -> None:
        for close in self._closers:
            self.run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def servers(tokenizer_dir: Path) -> Iterator[Servers]:
    servers = Servers()
    try:
        for task in (common_pb2.REQUEST_KIND_GENERATE, common_pb2.REQUEST_KIND_EMBED):
            servers.run(servers.start(tokenizer_dir, task))
        yield servers
    finally:
        servers.close()


@pytest.fixture
def error_log() -> Iterator[ErrorLog]:
    """Fails the test if anything (frontend, aiohttp, asyncio) logged an error meanwhile."""
    handler = ErrorLog()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)
    # (backslashreplace: a message may quote a client's lone surrogate, which pytest could not print)
    assert not handler.records, [handler.format(r).encode("utf-8", "backslashreplace").decode()
                                 for r in handler.records[:5]]


class WellFormedTraffic:
    """Well-formed streams (HTTP and gRPC) one after another on the generate frontend, each checked
    token for token, for as long as a fuzz test runs beside it."""

    def __init__(self, servers: Servers) -> None:
        self._servers = servers
        self._target = servers.targets[0]
        self._stop = asyncio.Event()
        self.num_completed = 0
        self._task = asyncio.run_coroutine_threadsafe(self._run(), servers.loop)

    async def _run(self) -> None:
        frontend = self._target.frontend
        prompt = [40, 41, 42, 43, 44]
        expected = frontend.tokenizer.decode((echo_script(prompt) * 10)[:40])
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "stream": True}
        request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=40))
        async with aiohttp.ClientSession() as session, grpc.aio.insecure_channel(frontend.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            while not self._stop.is_set():
                async with session.post(f"http://{frontend.http_address}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    events = (await resp.read()).decode().split("\n\n")
                chunks = [json.loads(e.removeprefix("data: ")) for e in events if e and e != "data: [DONE]"]
                assert "".join(c["choices"][0]["text"] for c in chunks) == expected
                responses = [r async for r in stub.Generate(request, timeout=TIMEOUT_S)]
                assert "".join(r.chunk.text for r in responses) == expected
                assert responses[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
                self.num_completed += 1

    def finish(self) -> int:
        self._servers.loop.call_soon_threadsafe(self._stop.set)
        self._task.result(TIMEOUT_S)  # re-raises whatever went wrong in a well-formed stream
        return self.num_completed


@pytest.fixture
def well_formed(servers: Servers, error_log: ErrorLog) -> Iterator[WellFormedTraffic]:
    traffic = WellFormedTraffic(servers)
    yield traffic
    assert traffic.finish() > 0, "no well-formed stream completed while fuzzing"


# ---- values: every JSON type, boundaries of every wire type, text that is not Unicode -----------

BOUNDARY_INTS = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**63 - 1, 2**63, -(2**63) - 1,
                 2**64 - 1, 2**64, 10**30, -(10**30), 10**400]
LONE_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
boundary_ints = st.sampled_from(BOUNDARY_INTS)
ints = st.one_of(boundary_ints, st.integers(-5, 600), boundary_ints, st.integers())
floats = st.one_of(st.floats(), st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, 3.5e38, 1e-320]))
texts = st.one_of(
    st.text(max_size=20),
    st.text(st.characters(codec="utf-8"), max_size=20),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), LONE_SURROGATES, st.text(max_size=4)),
    st.builds(lambda a, s: a + s, st.text(st.characters(codec="utf-8"), max_size=6), LONE_SURROGATES),
    st.integers(0, 2000).map(lambda n: "é" * n),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner,
                                                                                                max_size=4),
                           max_leaves=12)
token_lists = st.lists(ints, max_size=20)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | texts},
    optional={"content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text") | texts},
                                                                optional={"text": texts}), max_size=3) | json_values},
), max_size=4)

# Plausible values per field (to get past the type checks into the range checks), or anything at all.
TYPED: dict[str, st.SearchStrategy[Any]] = {
    "prompt": texts | token_lists | st.lists(texts, max_size=2) | st.lists(token_lists, max_size=2),
    "messages": messages,
    "input": texts | token_lists | st.lists(texts, max_size=3) | st.lists(token_lists, max_size=3),
    "stop": texts | st.lists(texts, max_size=20),
    "stop_token_ids": token_lists,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}),
    "response_format": st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["text", "json_object", "json_schema"]) | texts,
        "json_schema": st.fixed_dictionaries({}, optional={"schema": json_values, "strict": json_values}) | json_values,
    }),
    **{name: texts | st.lists(texts, max_size=3) for name in ("text_1", "text_2", "documents", "query")},
    **{name: ints for name in ("max_tokens", "max_completion_tokens", "top_k", "seed", "min_tokens", "logprobs",
                               "top_logprobs", "n", "best_of", "priority", "top_n")},
    **{name: floats | ints | st.sampled_from([10**400, -(10**400)])  # (beyond any float)
       for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")},
    **{name: st.booleans() for name in ("stream", "echo", "ignore_eos", "skip_special_tokens", "add_special_tokens",
                                        "truncate", "normalize", "sort")},
    **{name: texts for name in ("model", "suffix", "encoding_format")},
    **{name: json_values for name in ("logit_bias", "tools", "dimensions", "user")},
}
field_values = {name: typed | json_values for name, typed in TYPED.items()}
# A valid body per route: most fuzzed bodies change a few of its fields, so they get past the
# first check and reach the deeper ones (tokenizer, scheduler, stream).
VALID: dict[str, dict[str, object]] = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/embeddings": {"model": MODEL_NAME, "input": "hi"},
    "/v1/score": {"model": MODEL_NAME, "text_1": "a", "text_2": ["b", "c"]},
    "/v1/rerank": {"model": MODEL_NAME, "query": "q", "documents": ["d"]},
}
SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs",
                   "min_tokens", "stream", "priority", "n"]
# The fields each route reads, drawn more often than the rest.
ROUTE_FIELDS: dict[str, list[str]] = {
    "/v1/completions": ["prompt", "model", "echo", "best_of", "stream_options", "response_format", *SAMPLING_FIELDS],
    "/v1/chat/completions": ["messages", "model", "top_logprobs", "max_completion_tokens", "response_format",
                             "tools", *SAMPLING_FIELDS],
    "/v1/embeddings": ["input", "model", "encoding_format", "truncate", "normalize", "priority", "dimensions"],
    "/v1/score": ["text_1", "text_2", "model", "truncate", "priority"],
    "/v1/rerank": ["query", "documents", "top_n", "model", "priority"],
}
header_values = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@st.composite
def http_requests(draw: st.DrawFn, route: str, field: str | None = None,
                  ) -> tuple[str, str, list[tuple[bytes, bytes]], bytes]:
    """(method, path, extra headers, body bytes) aimed at `route` (or "other": the routes without a body).

    With `field`: the route's valid body with that one field changed, mostly to a value of a
    plausible type (so it gets past the type checks), else to anything.
    """
    path = draw(st.sampled_from(["/v1/models", "/health", "/v1/nowhere"])) if route == "other" else route
    body: Any = dict(VALID.get(path, {}))
    if field is not None:
        body[field] = draw(TYPED[field] if draw(st.integers(0, 3)) else json_values)
    elif draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(sorted(field_values)), max_size=3, unique=True)):
            body[name] = draw(field_values[name])
    else:
        body = draw(st.fixed_dictionaries({}, optional=field_values))
    # ensure_ascii writes a lone surrogate as a \\u escape; without it, as the bytes no UTF-8 decoder takes.
    raw = json.dumps(body, ensure_ascii=draw(st.integers(0, 3)) > 0).encode("utf-8", "surrogatepass")
    mangle = draw(st.sampled_from(["none"] * (12 if field else 4) + ["truncate", "random bytes", "deep",
                                                                        "not an object"]))
    if mangle == "truncate":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif mangle == "random bytes":
        raw = draw(st.binary(max_size=300))
    elif mangle == "deep":
        depth = draw(st.sampled_from([64, 999, 1000, 1001, 5000, 100_000]))
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    elif mangle == "not an object":
        raw = json.dumps(draw(json_values)).encode("utf-8", "surrogatepass")
    headers = [(b"Content-Type", draw(st.sampled_from([b"application/json", b"text/plain", b"", b"\xff"])))]
    for name in (b"X-Request-Id", b"traceparent"):
        if draw(st.integers(0, 3 if field else 1)) == 0:
            headers.append((name, draw(header_values)))
    method = draw(st.sampled_from(["POST"] * 9 + ["GET", "PUT"]) if route != "other" else
                  st.sampled_from(["GET", "POST"]))
    return method, path, headers, raw


def _http(port: int, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 exchange over a raw socket (any bytes at all in headers and body).

    A server that refuses the headers answers 400 and closes with the body still unread, and the
    kernel then resets the connection, which can drop that answer before this side reads it
    (seen once in CI: an invalid X-Request-Id byte, a large body). Such a reset is retried, up to
    three times; an answer is still required.
    """
    head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\nContent-Length: {len(body)}\r\n".encode()
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    for attempt in range(3):
        response = bytearray()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
                sock.sendall(head + b"\r\n" + body)
                while chunk := sock.recv(1 << 16):
                    response += chunk
            break
        except ConnectionResetError:
            if attempt == 2:
                raise
    status_line = bytes(response).split(b"\r\n", 1)[0]
    return int(status_line.split(b" ")[1]), bytes(response)


# Each route with the model that serves it (index into Servers.targets: 0 generates, 1 embeds), so
# requests get past the task check; the other pairings are fuzzed too, more thinly.
ROUTES = [("/v1/completions", 0), ("/v1/chat/completions", 0), ("/v1/embeddings", 1), ("other", 0),
          ("/v1/score", 1), ("/v1/rerank", 0), ("/v1/embeddings", 0), ("/v1/completions", 1)]


def _fuzz_http(port: int, requests: st.SearchStrategy[tuple[str, str, list[tuple[bytes, bytes]], bytes]],
               max_examples: int) -> None:
    @settings(FUZZ, max_examples=max_examples)
    @given(request=requests)
    def fuzz(request: tuple[str, str, list[tuple[bytes, bytes]], bytes]) -> None:
        method, path, headers, body = request
        status, response = _http(port, method, path, headers, body)
        assert 200 <= status < 500, response[:2000]
        assert not re.search(rb'"code":\s*5\d\d', response), response[:2000]  # no server error inside a stream

    fuzz()


@pytest.mark.parametrize("route, target_index", ROUTES)
def test_http_api_answers_any_body_with_success_or_a_client_error(
        servers: Servers, well_formed: WellFormedTraffic, route: str, target_index: int) -> None:
    _fuzz_http(servers.targets[target_index].http_port, http_requests(route), FUZZ.max_examples)


@pytest.mark.parametrize("route, target_index, field", [
    (route, target_index, field) for route, target_index in ROUTES[:3] for field in ROUTE_FIELDS[route]])
def test_http_api_answers_any_value_of_each_field_with_success_or_a_client_error(
        servers: Servers, well_formed: WellFormedTraffic, route: str, target_index: int, field: str) -> None:
    _fuzz_http(servers.targets[target_index].http_port, http_requests(route, field), 12)


# ---- gRPC: every field within protobuf's types, huge repeated fields, bytes that do not parse ----

int32s = st.one_of(st.integers(-5, 600), st.sampled_from([2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
float32s = st.floats(width=32) | st.sampled_from([float("inf"), float("nan"), 3.4e38])
proto_texts = st.text(max_size=20) | st.integers(0, 3000).map(lambda n: "x" * n)
id_lists = st.lists(int32s, max_size=30) | st.sampled_from([[5] * 100_000, list(range(70_000))])
OPTIONAL_SAMPLING = {
    **{name: float32s for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty")},
    **{name: int32s for name in ("top_k", "max_tokens", "logprobs", "min_tokens")},
    "seed": st.integers(0, 2**64 - 1),
}
structured_outputs = st.one_of(
    st.just(pb.StructuredOutput()), st.builds(lambda b: pb.StructuredOutput(json_object=b), st.booleans()),
    *(st.builds(lambda text, form=form: pb.StructuredOutput(**{form: text}),
                proto_texts | st.sampled_from(['{"type": "object"}', "[a-z]+", 'start: "x"', "(", "{"]))
      for form in ("json_schema", "regex", "lark")))
sampling_params = st.builds(
    lambda values, stop, stop_ids, ignore_eos, structured: pb.SamplingParams(
        **values, stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos, structured=structured),
    st.fixed_dictionaries({}, optional=OPTIONAL_SAMPLING),
    st.lists(proto_texts, max_size=30) | st.just(["s"] * 10_000), id_lists, st.booleans(), structured_outputs)
generate_requests = st.builds(
    lambda model, prompt, sampling, priority, request_id: pb.GenerateRequest(
        model=model, sampling=sampling, priority=priority, request_id=request_id,
        **({"text": prompt} if isinstance(prompt, str) else {"token_ids": pb.TokenIds(ids=prompt)})),
    st.just(MODEL_NAME) | proto_texts, proto_texts | id_lists, sampling_params, int32s, proto_texts)
unary_requests = st.one_of(
    st.builds(lambda m, t, a: ("Tokenize", pb.TokenizeRequest(model=m, text=t, add_special_tokens=a)),
              st.just(MODEL_NAME) | proto_texts, proto_texts, st.booleans()),
    st.builds(lambda m, i, t, p: ("Embed", pb.EmbedRequest(model=m, inputs=i, truncate=t, priority=p)),
              st.just("") | proto_texts, st.lists(proto_texts, max_size=5) | st.just(["a"] * 5000), st.booleans(),
              int32s),
    st.builds(lambda q, d, n, s: ("Score", pb.ScoreRequest(query=q, documents=d, top_n=n, sort=s)),
              proto_texts, st.lists(proto_texts, max_size=5), int32s, st.booleans()),
    st.just(("ListModels", pb.ListModelsRequest())),
)


@st.composite
def raw_messages(draw: st.DrawFn) -> tuple[str, bytes]:
    """A method and bytes that may not parse: random, or a real message with a string made invalid UTF-8."""
    method = draw(st.sampled_from(["Generate", "Tokenize", "Embed", "Score"]))
    if draw(st.booleans()):
        return method, draw(st.binary(max_size=200))
    raw = pb.TokenizeRequest(model=MODEL_NAME, text="abc").SerializeToString()  # strings at the same tags elsewhere
    return method, raw.replace(b"abc", draw(st.sampled_from([b"\xff\xfe\xfd", b"a\xc3(", b"\xed\xa0\x80"])))


def _check(call: Any) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())


@FUZZ
@given(generate=generate_requests, unary=unary_requests, raw=raw_messages(), target_index=st.integers(0, 1))
def test_grpc_api_answers_every_request_with_success_or_a_client_error(
        servers: Servers, well_formed: WellFormedTraffic, generate: pb.GenerateRequest,
        unary: tuple[str, Any], raw: tuple[str, bytes], target_index: int) -> None:
    with grpc.insecure_channel(servers.targets[target_index].frontend.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        _check(lambda: list(stub.Generate(generate, timeout=TIMEOUT_S)))
        method, request = unary
        _check(lambda: getattr(stub, method)(request, timeout=TIMEOUT_S))
        method, data = raw
        streaming = method == "Generate"
        call = (channel.unary_stream if streaming else channel.unary_unary)(
            f"/spindle.v1.GenerationService/{method}", request_serializer=lambda b: b,
            response_deserializer=lambda b: b)
        _check(lambda: list(call(data, timeout=TIMEOUT_S)) if streaming else call(data, timeout=TIMEOUT_S))
