"""Render helm/spindle with the helm binary `make test` installs, and find things in the result.

Every chart test works on `helm template` output: parsed manifests, looked up by kind and
by the chart's `app.kubernetes.io/component` label.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "spindle"
BIN = Path(sys.executable).parent
HELM = BIN / "helm"
RELEASE = "rel"
NAMESPACE = "spindle-ns"
CLUSTER_DOMAIN = "cluster.local"  # the chart's default clusterDomain
CI_VALUES = {path.name.removesuffix("-values.yaml"): path for path in sorted((CHART / "ci").glob("*-values.yaml"))}
# The chart's defaults plus each CI values file: what lint, schema validation and the
# structural checks run over.
VALUES_SETS: dict[str, tuple[Path, ...]] = {"default": (), **{name: (path,) for name, path in CI_VALUES.items()}}
SERVICES = ("frontend", "scheduler", "worker")
HEALTH_SERVICE = {
    "frontend": "spindle.v1.GenerationService",
    "scheduler": "spindle.v1.SchedulerService",
    "worker": "spindle.v1.WorkerService",
}

Manifest = dict[str, Any]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run helm; fail the test (not error it) when the binary is missing."""
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: `make test` installs it (or `make {HELM.relative_to(REPO)}`)")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=False)


@functools.cache
def render(values_files: tuple[Path, ...] = (), sets: tuple[str, ...] = ()) -> tuple[Manifest, ...]:
    """`helm template` the chart (cached: tests only read the result)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for path in values_files:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    if result.returncode != 0:
        raise AssertionError(f"helm template {' '.join(args[3:])} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render_error(*sets: str) -> str:
    """The error `helm template` reports for values that must be refused."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *(f"--set={s}" for s in sets)]
    result = helm(*args)
    assert result.returncode != 0, f"helm template {' '.join(sets)} rendered values it must refuse"
    return result.stderr


def component_of(manifest: Manifest) -> str | None:
    return manifest["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def find(manifests: tuple[Manifest, ...], kind: str, component: str | None = None) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind and (component is None or component_of(m) == component)]


def one(manifests: tuple[Manifest, ...], kind: str, component: str) -> Manifest:
    found = find(manifests, kind, component)
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def workload(manifests: tuple[Manifest, ...], component: str) -> Manifest:
    """The Deployment or StatefulSet running a service."""
    found = [m for m in manifests if m["kind"] in ("Deployment", "StatefulSet") and component_of(m) == component]
    assert len(found) == 1, f"expected one workload for {component}, found {len(found)}"
    return found[0]


def pod_spec(manifest: Manifest) -> dict[str, Any]:
    return manifest["spec"] if manifest["kind"] == "Pod" else manifest["spec"]["template"]["spec"]


def pod_specs(manifests: tuple[Manifest, ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod the chart creates, workloads and the helm-test hook alike, as (name, spec)."""
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet", "Pod"):
            yield f"{m['kind']}/{m['metadata']['name']}", pod_spec(m)


def main_container(manifests: tuple[Manifest, ...], component: str) -> dict[str, Any]:
    containers = pod_spec(workload(manifests, component))["containers"]
    assert len(containers) == 1, f"{component}: expected one container, found {len(containers)}"
    return containers[0]


def config_data(manifests: tuple[Manifest, ...], component: str) -> dict[str, str]:
    return one(manifests, "ConfigMap", component)["data"]


def env_value(container: dict[str, Any], name: str) -> str | None:
    for item in container.get("env", []):
        if item["name"] == name:
            return item.get("value")
    return None


def flag(args: list[str], name: str) -> str:
    """The value after `name` in a container's args."""
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def port_named(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name}: {ports}"
    return ports[name]


def fqdn(name: str) -> str:
    return f"{name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
