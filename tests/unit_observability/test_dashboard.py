"""The Grafana dashboard (helm/spindle/dashboards/spindle.json) queries only what the services expose.

Builds every service's metrics registry (the scheduler's over a real `Scheduler` with fake
workers), observes each histogram and counter once so every series exists, renders them as
Prometheus scrapes them, and checks every panel query's metric names, and the labels its
selectors match on, against that exposition.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.frontend.metrics import FrontendMetrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import Scheduler
from services.worker.telemetry import WorkerMetrics
from shared.execute import WorkerInfo
from shared.types import RequestKind

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "spindle" / "dashboards" / "spindle.json"
DATASOURCE = "${datasource}"
# A metric name in PromQL: `spindle:` then name characters (digits too: `e2e_request_latency`).
METRIC_NAME = re.compile(r"spindle:[a-zA-Z0-9_:]+")
# `metric{label="v", other=~"w"}`: the labels a selector matches on.
SELECTOR = re.compile(r"(spindle:[a-zA-Z0-9_:]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def _worker_info(model_id: str) -> WorkerInfo:
    return WorkerInfo(model_id=model_id, task=RequestKind.GENERATE, vocab_size=64, max_model_len=256,
                      block_size=4, num_kv_blocks=16, eos_token_ids=(1,), attention_backend="fake", dtype="none",
                      device="cpu")


def _registries() -> list[CollectorRegistry]:
    frontend = FrontendMetrics("m")
    frontend.finished("stop")
    frontend.failed("internal")
    frontend.prompt_tokens.inc(3)
    frontend.generation_tokens.inc(2)
    frontend.cached_prompt_tokens.inc(1)
    for histogram in (frontend.time_to_first_token, frontend.inter_token_latency, frontend.e2e_latency,
                      frontend.request_prompt_tokens, frontend.request_generation_tokens, frontend.step_transit):
        histogram.observe(1)
    frontend.requests_in_flight.inc()

    scheduler = Scheduler(SchedulerConfig(), [_worker_info("m"), _worker_info("m")])
    sched = SchedulerMetrics(lambda: scheduler)
    sched.queue_time.observe(0.01)
    sched.round_steps.observe(4)
    sched.iteration_tokens.observe(16)
    sched.step_transit.observe(0.001)

    worker = WorkerMetrics()
    worker.step_duration.observe(0.001)
    worker.round_duration.observe(0.004)
    worker.rounds_failed.inc()
    worker.ready.set(1)
    return [frontend.registry, sched.registry, worker.registry]


@pytest.fixture(scope="module")
def exposed() -> dict[str, set[str]]:
    """Every sample name the services expose (`_total`, `_bucket`, ... included) -> its label names."""
    labels: dict[str, set[str]] = defaultdict(set)
    for registry in _registries():
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                labels[sample.name] |= set(sample.labels)
    return dict(labels)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _panels(dashboard) for target in panel.get("targets", [])]


def test_the_services_expose_what_the_test_expects(exposed: dict[str, set[str]]) -> None:
    # One from each registry, so a registry that renders nothing cannot pass the checks below.
    for name in ("spindle:request_success_total", "spindle:e2e_request_latency_seconds_bucket",
                 "spindle:kv_cache_usage_perc", "spindle:iteration_tokens_total_bucket",
                 "spindle:worker_step_duration_seconds_bucket"):
        assert name in exposed
    assert {"model_name", "worker"} <= exposed["spindle:kv_cache_usage_perc"]


def test_every_query_uses_only_exposed_metrics(dashboard: dict[str, Any], exposed: dict[str, set[str]]) -> None:
    exprs = _exprs(dashboard)
    assert len(exprs) >= 20
    unknown = {(title, name) for title, expr in exprs for name in METRIC_NAME.findall(expr) if name not in exposed}
    assert not unknown, f"queries name metrics no service exposes: {sorted(unknown)}"
    referenced = {name for _, expr in exprs for name in METRIC_NAME.findall(expr)}
    assert all(METRIC_NAME.search(expr) for _, expr in exprs)
    assert len(referenced) >= 20


def test_selectors_match_only_labels_the_metric_has(dashboard: dict[str, Any],
                                                    exposed: dict[str, set[str]]) -> None:
    wrong = []
    for title, expr in _exprs(dashboard):
        for name, matchers in SELECTOR.findall(expr):
            missing = set(MATCHER.findall(matchers)) - exposed.get(name, set())
            if missing:
                wrong.append((title, name, sorted(missing)))
    assert not wrong, f"selectors on labels the metric does not carry: {wrong}"


def test_variables(dashboard: dict[str, Any], exposed: dict[str, set[str]]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == DATASOURCE
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query == "label_values(spindle:request_success_total, model_name)"
    assert "model_name" in exposed["spindle:request_success_total"]


def test_panels_are_well_formed(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"] and dashboard["uid"]
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel.get("title"), f"panel {panel['id']} has no title"
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
