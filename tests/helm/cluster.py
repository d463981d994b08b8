"""A stand-in for kubelet, kube-proxy and cluster DNS on one host, for the chart's wiring test.

It runs the pods of rendered manifests as local processes, doing for each what Kubernetes
would and nothing more, so that a chart that renders but could not run fails here:

- a pod's process is the image's ENTRYPOINT (or the container's `command`) plus its `args`,
  in the image's environment (its PATH and prebuilt kernel cache pointing at this checkout's venv
  and kernel builds: a worker that had to compile its kernels took minutes to be ready on a
  slower CPU) overlaid by `envFrom` ConfigMaps and Secrets and the `env`
  list, `$(VAR)` references expanded as the kubelet expands them;
- each pod gets its own loopback address as its pod IP (127.77.0.N); processes bind what the
  chart tells them, and `0.0.0.0` covers every loopback address as it covers a pod's IP;
- in-cluster DNS names in args and environment become pod addresses: a ClusterIP Service's
  `name:port` maps to a ready pod's IP and target port (kube-proxy's job), a headless
  Service's `<pod>.<service>` to that pod; a name that resolves to nothing is an error;
- volumes are local directories: emptyDir a fresh one, a claim the directory the test gives
  for it, Secrets and ConfigMaps their rendered data as files; paths under a mountPath are
  rewritten to the directory mounted there;
- probes are called as the kubelet calls them (gRPC health, HTTP GET, TCP connect), against
  the pod IP.
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.kernels.build import CACHE_ENV as KERNEL_CACHE_ENV
from services.worker.kernels.build import cache_root as kernel_cache_root
from tests.helm.chart import BIN, CLUSTER_DOMAIN, NAMESPACE, Manifest, component_of
from tests.helm.image import ImageConfig

POD_NETWORK = "127.77.0"
# The image's PATH is /opt/spindle/bin first: here that venv is ours.
LOCAL_PATH = f"{BIN}:/usr/local/bin:/usr/bin:/bin"
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
PORT_WAIT_S = 30.0  # how long a chart port held by another connection of the host may take to free


class WiringError(AssertionError):
    """The rendered chart asks for something that could not work in a cluster."""


@dataclass
class Pod:
    name: str
    component: str
    ip: str
    labels: dict[str, str]
    spec: dict[str, Any]
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local directory
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def container(self) -> dict[str, Any]:
        containers = self.spec["containers"]
        if len(containers) != 1:
            raise WiringError(f"{self.name}: expected one container, found {len(containers)}")
        return containers[0]

    def container_port(self, port: int | str) -> int:
        """A probe's or Service's port: a number, or the name of a container port."""
        if isinstance(port, int):
            return port
        for item in self.container.get("ports", []):
            if item.get("name") == port:
                return int(item["containerPort"])
        raise WiringError(f"{self.name}: no container port named {port!r}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _bind_error(port: int) -> OSError | None:
    """Why a server could not listen on `port` on every address now (None: it could)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc
    return None


def _cpus(quantity: str) -> float:
    """A Kubernetes CPU quantity in CPUs: "2" -> 2.0, "500m" -> 0.5."""
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class LocalCluster:
    """The workloads of `manifests` as local processes (see the module docstring)."""

    def __init__(self, manifests: tuple[Manifest, ...], image: ImageConfig, workdir: Path,
                 claims: dict[str, Path]) -> None:
        self.manifests = manifests
        self.image = image
        self.workdir = workdir
        self.claims = claims
        self.pods = self._pods()
        self.hosts = self._dns()
        self._host_pattern = re.compile(
            r"(?<![\w.-])(" + "|".join(re.escape(h) for h in sorted(self.hosts, key=len, reverse=True))
            + r")(?::(\d+))?(?![\w.-])")

    # -- objects ----------------------------------------------------------------------------

    def _objects(self, kind: str) -> dict[str, Manifest]:
        return {m["metadata"]["name"]: m for m in self.manifests if m["kind"] == kind}

    def _pods(self) -> list[Pod]:
        """Pods of every Deployment and StatefulSet, named as Kubernetes names them (near enough)."""
        pods: list[Pod] = []
        for m in self.manifests:
            if m["kind"] not in ("Deployment", "StatefulSet"):
                continue
            template = m["spec"]["template"]
            replicas = m["spec"].get("replicas", 1)  # no replicas: an autoscaler's minimum, 1 here
            for i in range(replicas):
                suffix = str(i) if m["kind"] == "StatefulSet" else f"local-{i}"
                pods.append(Pod(name=f"{m['metadata']['name']}-{suffix}", component=component_of(m) or "",
                                ip=f"{POD_NETWORK}.{len(pods) + 2}", labels=template["metadata"]["labels"],
                                spec=template["spec"]))
        return pods

    def _statefulset_pods(self, service: str) -> list[Pod]:
        owners = [m for m in self._objects("StatefulSet").values() if m["spec"].get("serviceName") == service]
        return [p for p in self.pods for m in owners if p.name.startswith(m["metadata"]["name"] + "-")]

    def _dns(self) -> dict[str, tuple[str, Manifest | None, Pod | None]]:
        """host name -> (kind, Service, Pod): every name cluster DNS would answer for."""
        hosts: dict[str, tuple[str, Manifest | None, Pod | None]] = {}

        def names(base: str) -> list[str]:
            return [base, f"{base}.{NAMESPACE}", f"{base}.{NAMESPACE}.svc", f"{base}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"]

        for name, service in self._objects("Service").items():
            headless = service["spec"].get("clusterIP") == "None"
            for host in names(name):
                hosts[host] = ("headless" if headless else "service", service, None)
            for pod in self._statefulset_pods(name):
                for host in names(f"{pod.name}.{name}"):
                    hosts[host] = ("pod", service, pod)
        return hosts

    def backends(self, service: Manifest) -> list[Pod]:
        return [p for p in self.pods if _matches(service["spec"]["selector"], p.labels)]

    def service_address(self, service_name: str, port_name: str) -> str:
        """host:port a client outside the cluster reaches a Service's port through (kube-proxy)."""
        service = self._objects("Service").get(service_name)
        if service is None:
            raise WiringError(f"no Service {service_name}")
        port = next((p for p in service["spec"]["ports"] if p["name"] == port_name), None)
        if port is None:
            raise WiringError(f"Service {service_name} has no port {port_name}")
        pods = self.backends(service)
        if not pods:
            raise WiringError(f"Service {service_name} selects no pod")
        return f"{pods[0].ip}:{pods[0].container_port(port.get('targetPort', port['port']))}"

    # -- what a container sees -----------------------------------------------------------

    def resolve_hosts(self, text: str, where: str) -> str:
        """Rewrite in-cluster names (with their ports) to the pod addresses they would reach."""

        def replace(match: re.Match[str]) -> str:
            kind, service, pod = self.hosts[match[1]]
            assert service is not None
            if match[2] is None:
                target = pod or next(iter(self.backends(service)), None)
                if target is None:
                    raise WiringError(f"{where}: {match[1]} resolves to no pod")
                return target.ip
            port = int(match[2])
            if kind == "service":
                spec = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
                if spec is None:
                    raise WiringError(f"{where}: Service {service['metadata']['name']} has no port {port}")
                backends = self.backends(service)
                if not backends:
                    raise WiringError(f"{where}: Service {service['metadata']['name']} selects no pod")
                target = backends[0]
                return f"{target.ip}:{target.container_port(spec.get('targetPort', port))}"
            if kind == "pod":
                assert pod is not None
                return f"{pod.ip}:{port}"
            backends = self.backends(service)
            if not backends:
                raise WiringError(f"{where}: headless Service {service['metadata']['name']} selects no pod")
            return f"{backends[0].ip}:{port}"

        out = self._host_pattern.sub(replace, text) if self.hosts else text
        leftover = re.search(rf"[\w.-]+\.svc(\.{re.escape(CLUSTER_DOMAIN)})?\b", out)
        if leftover:
            raise WiringError(f"{where}: {leftover[0]} names no Service of this release")
        return out

    def resolve_paths(self, text: str, pod: Pod) -> str:
        """Rewrite paths under a mountPath to the local directory mounted there (one pass, longest first)."""
        if not pod.mounts:
            return text
        alternatives = "|".join(re.escape(m) for m in sorted(pod.mounts, key=len, reverse=True))
        pattern = rf"(?<![\w./-])({alternatives})(?=/|$|[^\w.-])"
        return re.sub(pattern, lambda match: str(pod.mounts[match[1]]), text)

    def _volume_dir(self, pod: Pod, volume: dict[str, Any]) -> Path:
        local = self.workdir / "pods" / pod.name / "volumes" / volume["name"]
        if "emptyDir" in volume:
            local.mkdir(parents=True, exist_ok=True)
            return local
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.claims:
                raise WiringError(f"{pod.name}: no local directory for claim {claim}")
            return self.claims[claim]
        for kind, key, name_key in (("secret", "Secret", "secretName"), ("configMap", "ConfigMap", "name")):
            if kind in volume:
                source = self._objects(key).get(volume[kind][name_key])
                if source is None:
                    raise WiringError(f"{pod.name}: volume {volume['name']} needs {key} {volume[kind][name_key]}, "
                                      "which the chart does not create")
                local.mkdir(parents=True, exist_ok=True)
                for file, content in self._data(source).items():
                    (local / file).write_text(content)
                return local
        raise WiringError(f"{pod.name}: volume {volume['name']} is of a kind the wiring test cannot provide")

    @staticmethod
    def _data(source: Manifest) -> dict[str, str]:
        data = dict(source.get("stringData", {}))
        if source["kind"] == "Secret":
            data |= {k: base64.b64decode(v).decode() for k, v in source.get("data", {}).items()}
        else:
            data |= source.get("data", {})
        return data

    def _mount(self, pod: Pod) -> None:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for mount in pod.container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                raise WiringError(f"{pod.name}: mount {mount['name']} has no volume")
            local = self._volume_dir(pod, volumes[mount["name"]])
            pod.mounts[mount["mountPath"]] = local / mount.get("subPath", "")

    def _field(self, pod: Pod, path: str) -> str:
        fields = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": pod.ip,
                  "spec.nodeName": "local-node", "spec.serviceAccountName": pod.spec.get("serviceAccountName", "")}
        if path not in fields:
            raise WiringError(f"{pod.name}: fieldRef {path} is not supported by the wiring test")
        return fields[path]

    @staticmethod
    def _resource(pod: Pod, ref: dict[str, str]) -> str:
        """A CPU request or limit over the divisor, rounded up, as the kubelet gives it (a request
        not set is the limit; a limit not set is the node's CPUs)."""
        resources = pod.container.get("resources", {})
        section, _, kind = ref["resource"].partition(".")
        if kind != "cpu" or section not in ("requests", "limits"):
            raise WiringError(f"{pod.name}: resourceFieldRef {ref['resource']} is not supported by the wiring test")
        quantity = resources.get(section, {}).get("cpu") or resources.get("limits", {}).get("cpu")
        node = float(os.cpu_count() or 1)
        cpus = _cpus(str(quantity)) if quantity is not None else (node if section == "limits" else 0.0)
        return str(math.ceil(cpus / _cpus(str(ref.get("divisor", "1")))))

    def environment(self, pod: Pod) -> dict[str, str]:
        """The container's environment, resolved as the kubelet resolves it."""
        env = {k: v for k, v in self.image.env.items() if k != "PATH"}
        env["PATH"] = LOCAL_PATH
        for source in pod.container.get("envFrom", []):
            for kind, key in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if kind in source:
                    found = self._objects(key).get(source[kind]["name"])
                    if found is None:
                        raise WiringError(f"{pod.name}: envFrom {key} {source[kind]['name']} is not rendered")
                    env |= {source.get("prefix", "") + k: v for k, v in self._data(found).items()}
        for item in pod.container.get("env", []):
            if "value" in item or "valueFrom" not in item:
                env[item["name"]] = self._expand(item.get("value", ""), env)
                continue
            ref = item["valueFrom"]
            if "fieldRef" in ref:
                env[item["name"]] = self._field(pod, ref["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in ref:
                env[item["name"]] = self._resource(pod, ref["resourceFieldRef"])
            elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
                kind, key = ("configMapKeyRef", "ConfigMap") if "configMapKeyRef" in ref else ("secretKeyRef", "Secret")
                found = self._objects(key).get(ref[kind]["name"])
                if found is None:
                    raise WiringError(f"{pod.name}: env {item['name']} reads {key} {ref[kind]['name']}, not rendered")
                env[item["name"]] = self._data(found)[ref[kind]["key"]]
            else:
                raise WiringError(f"{pod.name}: env {item['name']}: {sorted(ref)} is not supported")
        where = f"{pod.name} env"
        resolved = {k: self.resolve_paths(self.resolve_hosts(v, where), pod) for k, v in env.items()}
        if KERNEL_CACHE_ENV in resolved:
            # The image's prebuilt kernels: here the ones `make install` built, a path on this
            # machine that no mount may rewrite (a cache under /tmp is not the pod's emptyDir /tmp).
            resolved[KERNEL_CACHE_ENV] = str(kernel_cache_root())
        return resolved

    @staticmethod
    def _expand(text: str, env: dict[str, str]) -> str:
        """Kubernetes' $(VAR) expansion: defined variables only; `$$` is a literal `$`."""

        def replace(match: re.Match[str]) -> str:
            if match[0] == "$$":
                return "$"
            return env.get(match[1], match[0])

        return _VAR_REF.sub(replace, text)

    def argv(self, pod: Pod, container: dict[str, Any] | None = None) -> list[str]:
        container = container or pod.container
        env = self.environment(pod)
        command = container.get("command") or self.image.entrypoint
        args = container.get("args") if "command" in container else container.get("args", self.image.cmd)
        argv = [self.resolve_paths(self.resolve_hosts(self._expand(a, env), f"{pod.name} args"), pod)
                for a in [*command, *(args or [])]]
        executable = shutil.which(argv[0], path=LOCAL_PATH)
        if executable is None:
            raise WiringError(f"{pod.name}: {argv[0]} is not on the image's PATH")
        return [executable, *argv[1:]]

    # -- running -----------------------------------------------------------------------

    def check_ports_free(self, wait_s: float = PORT_WAIT_S) -> None:
        """Every chart port can be bound on this host, waiting up to `wait_s` for each: the chart's
        ports lie inside the kernel's ephemeral range, where any outgoing connection of the host (a
        package download, a test's client) may hold one for a while."""
        for pod in self.pods:
            for item in pod.container.get("ports", []):
                deadline = time.monotonic() + wait_s
                while (error := _bind_error(item["containerPort"])) is not None:
                    if time.monotonic() > deadline:
                        raise WiringError(f"port {item['containerPort']} ({pod.name} {item['name']}) is in use "
                                          f"on this host: {error}")
                    time.sleep(0.5)

    def start(self) -> None:
        for pod in self.pods:
            if pod.spec.get("initContainers"):
                raise WiringError(f"{pod.name}: the wiring test does not run init containers")
            self._mount(pod)
        for pod in self.pods:
            env = self.environment(pod)
            argv = self.argv(pod)
            cwd = Path(self.resolve_paths(pod.container.get("workingDir", self.image.workdir), pod))
            pod.log = self.workdir / f"{pod.name}.log"
            with pod.log.open("wb") as log:
                pod.process = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM each process group, SIGKILL after the pod's grace period (at most 15 s here)."""
        for pod in self.pods:
            if pod.process is not None and pod.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.process.pid, signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for pod in self.pods:
            if pod.process is None:
                continue
            grace = min(pod.spec.get("terminationGracePeriodSeconds", 30), 15)
            try:
                codes[pod.name] = pod.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pod.process.pid, signal.SIGKILL)
                pod.process.wait()
                codes[pod.name] = None  # killed: did not stop within its grace period
        return codes

    def probe(self, pod: Pod, name: str) -> str | None:
        """Run one of the pod's probes as the kubelet would; None when it passes, else why not."""
        probe = pod.container.get(name)
        if probe is None:
            return None
        timeout = probe.get("timeoutSeconds", 1)
        if "grpc" in probe:
            address = f"{pod.ip}:{probe['grpc']['port']}"
            service = probe["grpc"].get("service", "")
            with grpc.insecure_channel(address) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                except grpc.RpcError as exc:
                    return f"{name} gRPC {address} {service!r}: {exc.code().name}"
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return None if status == "SERVING" else f"{name} gRPC {address} {service!r}: {status}"
        if "httpGet" in probe:
            url = f"http://{pod.ip}:{pod.container_port(probe['httpGet']['port'])}{probe['httpGet'].get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    return None if 200 <= response.status < 400 else f"{name} {url}: {response.status}"
            except (urllib.error.URLError, OSError) as exc:
                return f"{name} {url}: {exc}"
        if "tcpSocket" in probe:
            try:
                socket.create_connection((pod.ip, pod.container_port(probe["tcpSocket"]["port"])), timeout).close()
            except OSError as exc:
                return f"{name} tcp: {exc}"
            return None
        raise WiringError(f"{pod.name}: {name} is of a kind the wiring test cannot run")

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every pod's readiness probe passes; fail at once if a process exits."""
        deadline = time.monotonic() + timeout_s
        waiting: list[str] = []
        while time.monotonic() < deadline:
            for pod in self.pods:
                assert pod.process is not None
                if pod.process.poll() is not None:
                    raise WiringError(f"{pod.name} exited with {pod.process.returncode}:\n{pod.log_tail()}")
            waiting = [f"{pod.name}: {why}" for pod in self.pods if (why := self.probe(pod, "readinessProbe"))]
            if not waiting:
                return
            time.sleep(0.5)
        logs = "\n\n".join(f"--- {pod.name}\n{pod.log_tail()}" for pod in self.pods)
        raise WiringError(f"not ready after {timeout_s} s:\n" + "\n".join(waiting) + "\n" + logs)

    def run_once(self, manifest: Manifest, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run a bare Pod (a helm test hook) to completion, with this cluster's DNS and volumes."""
        spec = manifest["spec"]
        pod = Pod(name=manifest["metadata"]["name"], component=component_of(manifest) or "",
                  ip=f"{POD_NETWORK}.250", labels=manifest["metadata"].get("labels", {}), spec=spec)
        self._mount(pod)
        cwd = Path(self.resolve_paths(pod.container.get("workingDir", self.image.workdir), pod))
        return subprocess.run(self.argv(pod), env=self.environment(pod), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def __iter__(self) -> Iterator[Pod]:
        return iter(self.pods)
