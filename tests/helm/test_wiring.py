"""The rendered chart runs: its pods, started as local processes, serve requests and pass their probes.

Rendering and schemas prove little about whether the services can find each other, parse
their settings or answer the probes the chart gives them. Here the frontend, scheduler and
worker pods of `helm template` (with tests/helm/wiring-values.yaml) run exactly as rendered,
through tests/helm/cluster.py's stand-in for kubelet, kube-proxy and DNS, on a tiny
checkpoint built locally. Tests run in file order against one running release; the last
stops it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc
from shared.tiny_models import build_model
from tests.e2e.conftest import FAMILY_SPECS
from tests.helm.chart import RELEASE, SERVICES, find, render
from tests.helm.cluster import LocalCluster
from tests.helm.image import final_image

pytestmark = pytest.mark.e2e

WIRING_VALUES = Path(__file__).with_name("wiring-values.yaml")
VALUES = yaml.safe_load(WIRING_VALUES.read_text())
MODEL = VALUES["model"]["servedModelName"]
API_KEY = VALUES["apiKeys"]["keys"][0]
FRONTEND = f"{RELEASE}-spindle-frontend"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    workdir = tmp_path_factory.mktemp("wiring")
    models = workdir / "models"
    build_model(models / VALUES["model"]["path"], FAMILY_SPECS["llama"])
    release = LocalCluster(render((WIRING_VALUES,)), final_image(), workdir,
                           claims={VALUES["model"]["volume"]["existingClaim"]: models})
    release.check_ports_free()
    try:
        release.start()
        release.wait_ready(timeout_s=120)
        yield release
    finally:
        release.stop()


@pytest.fixture(autouse=True)
def _pod_logs(cluster: LocalCluster) -> Iterator[None]:
    """Print each pod's recent log after every test: pytest shows it when the test failed."""
    yield
    for pod in cluster:
        print(f"--- {pod.name}\n{pod.log_tail()}")


def test_release_runs_one_pod_per_service(cluster: LocalCluster) -> None:
    assert sorted(pod.component for pod in cluster) == sorted(SERVICES)


def test_every_probe_answers_as_the_kubelet_asks(cluster: LocalCluster) -> None:
    failures = [f"{pod.name}: {why}" for pod in cluster for probe in PROBES if (why := cluster.probe(pod, probe))]
    assert not failures, "\n".join(failures)
    for pod in cluster:
        assert all(probe in pod.container for probe in PROBES), pod.name


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_http_completion_through_the_frontend_service(cluster: LocalCluster) -> None:
    base = f"http://{cluster.service_address(FRONTEND, 'http')}"
    request = urllib.request.Request(f"{base}/v1/models", headers={"authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == [MODEL]
    reply = _post(f"{base}/v1/completions",
                  {"model": MODEL, "prompt": "hello world", "max_tokens": 8, "temperature": 0})
    (choice,) = reply["choices"]
    assert choice["finish_reason"] in ("length", "stop")
    assert reply["usage"]["completion_tokens"] >= 1
    with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
        assert response.status == 200


def test_grpc_generation_through_the_frontend_service(cluster: LocalCluster) -> None:
    with grpc.insecure_channel(cluster.service_address(FRONTEND, "grpc")) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            model=MODEL, text="the quick brown fox",
            sampling=generation_pb2.SamplingParams(max_tokens=6, temperature=0.0))
        tokens, finish = [], None
        for response in stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {API_KEY}")]):
            if response.HasField("chunk"):
                tokens += response.chunk.token_ids
            else:
                finish = response.complete.finish_reason
    assert 1 <= len(tokens) <= 6
    assert finish in (generation_pb2.FINISH_REASON_LENGTH, generation_pb2.FINISH_REASON_STOP)


def test_every_metrics_port_serves_prometheus_metrics(cluster: LocalCluster) -> None:
    # What the ServiceMonitor scrapes: the `metrics` port of each Service, on every pod behind it.
    scraped = []
    for service in find(cluster.manifests, "Service"):
        port = next((p for p in service["spec"]["ports"] if p["name"] == "metrics"), None)
        if port is None:
            continue
        for pod in cluster.backends(service):
            url = f"http://{pod.ip}:{pod.container_port(port['targetPort'])}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                body = response.read().decode()
            assert response.status == 200 and "spindle:" in body, url
            scraped.append(pod.component)
    assert sorted(scraped) == sorted(SERVICES)


def test_helm_test_hook_passes(cluster: LocalCluster) -> None:
    (hook,) = [m for m in find(cluster.manifests, "Pod")
               if m["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    result = cluster.run_once(hook, timeout_s=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 2 * len(SERVICES), result.stdout


def test_every_service_stops_cleanly_on_sigterm(cluster: LocalCluster) -> None:
    codes = cluster.stop()
    assert codes == {pod.name: 0 for pod in cluster}, (
        f"exit codes after SIGTERM (None: still running after the grace period): {codes}")
