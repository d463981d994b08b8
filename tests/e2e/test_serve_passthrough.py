"""Flags given to `spindle serve` reach the services that take them, through the real processes.

A frontend request limit, the per-key rate limit and the state store: the rate-limit counter
must land in the Redis named on `spindle serve`'s command line, so it really is the frontend's
state store, not its in-memory default.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from tests.e2e.faults import child, flag, redis_server
from tests.e2e.server import RunningServer, spindle_serve

pytestmark = pytest.mark.e2e


def _complete(server: RunningServer, **fields: object) -> tuple[int, dict[str, str], str]:
    body = json.dumps({"model": server.model_name, "prompt": "hello", "max_tokens": 2, **fields}).encode()
    request = urllib.request.Request(server.http_url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def test_serve_hands_limits_rate_limit_and_state_store_to_the_services(tiny_models: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    with redis_server(tmp_path) as store, spindle_serve(
            tiny_models["llama"], "--max-stop-strings", "1", "--rate-limit-rpm", "3", "--state-store", store.url,
            "--max-waiting-requests", "9") as server:
        _, scheduler = child(server.process.pid, "services.scheduler")
        assert flag(scheduler, "--state-store") == store.url and flag(scheduler, "--max-waiting-requests") == "9"

        status, _, body = _complete(server, stop=["a", "b"])
        assert status == 400 and "max_stop_strings" in body

        # 3 per minute in fixed one-minute windows: within 7 requests one window must run out.
        answers = [_complete(server) for _ in range(7)]
        statuses = [status for status, _, _ in answers]
        assert 200 in statuses and 429 in statuses, statuses
        refused = next(headers for status, headers, _ in answers if status == 429)
        assert int(refused["Retry-After"]) >= 1
        assert redis.Redis(port=store.port).keys("spindle:rate:requests:*"), "the frontend counts in Redis"
