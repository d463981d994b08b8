"""The chart renders, validates against the Kubernetes schemas, and says what operators rely on.

Run over the chart's defaults and each helm/spindle/ci/*-values.yaml (GPU workers, Redis and
every other option on, everything optional off). Behaviour that needs the services running
is in test_wiring.py.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import (
    CHART,
    CI_VALUES,
    HEALTH_SERVICE,
    NAMESPACE,
    RELEASE,
    SERVICES,
    VALUES_SETS,
    Manifest,
    component_of,
    config_data,
    env_value,
    find,
    flag,
    fqdn,
    helm,
    main_container,
    one,
    pod_spec,
    pod_specs,
    port_named,
    render,
    render_error,
    workload,
)

FULLNAME = f"{RELEASE}-spindle"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes are GA
# in 1.27) and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.utils.latest_version())
# Custom resources: no schema ships offline; test_service_monitor_scrapes_every_metrics_port
# checks the ServiceMonitor's structure instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.fixture(params=sorted(VALUES_SETS), ids=str)
def values_set(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def manifests(values_set: str) -> tuple[Manifest, ...]:
    return render(VALUES_SETS[values_set])


def test_chart_lints_strictly(values_set: str) -> None:
    args = ["lint", "--strict", str(CHART)]
    for path in VALUES_SETS[values_set]:
        args += ["--values", str(path)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_matches_the_kubernetes_schemas(manifests: tuple[Manifest, ...]) -> None:
    errors = []
    for m in manifests:
        if (m["apiVersion"], m["kind"]) in CUSTOM_KINDS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(m, version, strict=True)
            except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
                errors.append(f"{m['kind']}/{m['metadata']['name']} on {version}: {exc}")
    assert not errors, "\n".join(errors)


def test_every_pod_meets_the_restricted_pod_security_standard(manifests: tuple[Manifest, ...]) -> None:
    for name, spec in pod_specs(manifests):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        assert spec.get("automountServiceAccountToken") is False, f"{name}: mounts an API token it never uses"
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name} container {container['name']}"
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert not sc.get("privileged"), where
            # A read-only root needs somewhere to write: /tmp is an emptyDir everywhere.
            mounts = {mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]], f"{where}: /tmp is not an emptyDir"


@pytest.mark.parametrize("component", SERVICES)
def test_services_have_native_grpc_health_probes(manifests: tuple[Manifest, ...], component: str) -> None:
    container = main_container(manifests, component)
    grpc_port = port_named(container, "grpc")
    for probe, service in (("startupProbe", ""), ("livenessProbe", ""), ("readinessProbe", HEALTH_SERVICE[component])):
        assert container[probe]["grpc"] == {"port": grpc_port, "service": service}, f"{component} {probe}"
    startup = container["startupProbe"]
    budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    if component == "worker":
        assert budget_s >= 15 * 60, f"worker startup probe allows only {budget_s} s to load a model"


def test_scheduler_is_one_replica_replaced_by_recreate(manifests: tuple[Manifest, ...]) -> None:
    scheduler = workload(manifests, "scheduler")
    assert scheduler["kind"] == "Deployment"
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"] == {"type": "Recreate"}


def test_gpu_requests_and_cuda_image_only_for_gpu_workers(values_set: str, manifests: tuple[Manifest, ...]) -> None:
    gpu = values_set == "gpu"
    for name, spec in pod_specs(manifests):
        for container in spec["containers"]:
            resources = container.get("resources", {})
            wants_gpu = "nvidia.com/gpu" in resources.get("requests", {})
            is_worker = name == f"StatefulSet/{FULLNAME}-worker"
            assert wants_gpu == (gpu and is_worker), f"{name}: nvidia.com/gpu request is {wants_gpu}"
            if wants_gpu:
                assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
            if container["image"].startswith("spindle:"):
                assert container["image"].endswith("-cuda" if gpu and is_worker else "-cpu"), container["image"]
    assert (config_data(manifests, "worker").get("SPINDLE_DEVICE") == "cuda") == gpu
    worker = pod_spec(workload(manifests, "worker"))
    if gpu:
        assert worker["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker["tolerations"]
        assert "podAntiAffinity" in worker["affinity"]


@pytest.mark.parametrize("replicas", [1, 3])
def test_scheduler_workers_addr_lists_each_stable_worker_name(replicas: int) -> None:
    manifests = render(sets=(f"worker.replicas={replicas}", "worker.grpcPort=50099"))
    workers = workload(manifests, "worker")
    service = one(manifests, "Service", "worker")
    assert workers["kind"] == "StatefulSet" and workers["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None", "per-pod DNS names need a headless Service"
    expected = [f"{FULLNAME}-worker-{i}.{fqdn(f'{FULLNAME}-worker')}:50099" for i in range(replicas)]
    assert flag(main_container(manifests, "scheduler")["args"], "--workers-addr").split(",") == expected
    # helm test asks each of them too.
    hook = find(manifests, "Pod")[0]
    assert all(address in hook["spec"]["containers"][0]["args"] for address in expected)


@functools.cache
def _service_env_vars(component: str) -> frozenset[str]:
    """The SPINDLE_* variables `spindle <component>` reads, from its --help."""
    module = importlib.import_module(f"services.{component}.__main__")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return frozenset(re.findall(r"\[(SPINDLE_[A-Z0-9_]+)\]", parser.format_help()))


def _config_variable(key: str) -> str:
    """What the chart makes of a `config` key: maxNumSeqs -> SPINDLE_MAX_NUM_SEQS."""
    return "SPINDLE_" + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper()


# Variables the chart sets beyond each component's `config` block.
CHART_VARIABLES = {
    "frontend": {"SPINDLE_API_KEY_FILE", "SPINDLE_STATE_STORE"},
    "scheduler": {"SPINDLE_STATE_STORE"},
    "worker": {"SPINDLE_DEVICE"},
}
COMMON_VARIABLES = {"SPINDLE_LOG_FORMAT", "SPINDLE_LOG_LEVEL", "SPINDLE_LOG_REQUESTS", "SPINDLE_METRICS_PORT"}
# Read outside argparse: shared/logs.py takes the level from the environment.
READ_WITHOUT_FLAG = {"SPINDLE_LOG_LEVEL"}


def _chart_variables() -> dict[str, set[str]]:
    """Per component, every SPINDLE_* variable the chart can set (from values.yaml, no helm needed)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return {c: {_config_variable(k) for k in values[c]["config"]} | CHART_VARIABLES[c] | COMMON_VARIABLES
            for c in SERVICES}


def test_the_chart_sets_no_spindle_variable_beyond_those_checked() -> None:
    """Every SPINDLE_* variable in a render with every option on is one the next test checks."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sets = ["redis.enabled=true", "apiKeys.keys[0]=k", "worker.gpu=1"]
    for component in SERVICES:
        sets += [f"{component}.config.{key}=1" for key in values[component]["config"]]
    sets += ["worker.config.device=cpu", "worker.config.dtype=auto", "worker.config.attentionBackend=auto",
             "worker.config.weightDtype=auto", "worker.config.kvCacheDtype=auto", "worker.config.encoderMatmul=auto",
             "scheduler.config.enablePrefixCaching=true",
             "scheduler.config.enablePriorityPreemption=false"]
    manifests = render(sets=tuple(sets))
    for component, expected in _chart_variables().items():
        container = main_container(manifests, component)
        names = set(config_data(manifests, component)) | {e["name"] for e in container.get("env", [])}
        assert {n for n in names if n.startswith("SPINDLE_")} == expected, component


@pytest.mark.parametrize(
    ("component", "variable"), [(c, v) for c, names in _chart_variables().items() for v in sorted(names)])
def test_every_spindle_variable_the_chart_sets_is_read_by_the_service(component: str, variable: str) -> None:
    assert variable in _service_env_vars(component) | READ_WITHOUT_FLAG, (
        f"the chart sets {variable} for the {component}, which reads no such variable")


def test_config_block_becomes_environment_the_services_parse(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    # From a file, as operators write them: YAML integers reach templates as floats, and written
    # naively 1073741824 would become 1.073741824e+09, which int() refuses.
    values.write_text(yaml.safe_dump({
        "worker": {"config": {"kvCacheBytes": 1073741824, "gpuMemoryFraction": 0.85, "kvCacheDtype": "bfloat16",
                              "attentionBackend": "paged", "encoderMatmul": "float32"}},
        "scheduler": {"config": {"enablePrefixCaching": False}},
        "frontend": {"config": {"requestTimeoutS": 30}},
    }))
    manifests = render((values,))
    worker = config_data(manifests, "worker")
    assert worker["SPINDLE_KV_CACHE_BYTES"] == "1073741824"
    assert worker["SPINDLE_GPU_MEMORY_FRACTION"] == "0.85"
    assert (worker["SPINDLE_KV_CACHE_DTYPE"], worker["SPINDLE_ATTENTION_BACKEND"]) == ("bfloat16", "paged")
    assert worker["SPINDLE_ENCODER_MATMUL"] == "float32"
    assert config_data(manifests, "scheduler")["SPINDLE_ENABLE_PREFIX_CACHING"] == "false"
    assert config_data(manifests, "frontend")["SPINDLE_REQUEST_TIMEOUT_S"] == "30"
    # A null config key is left out, so the service keeps its own default.
    assert "SPINDLE_MAX_NUM_SEQS" not in worker
    for component in SERVICES:
        container = main_container(manifests, component)
        assert container["envFrom"] == [{"configMapRef": {"name": f"{FULLNAME}-{component}"}}]


def test_observability_settings_reach_every_service() -> None:
    manifests = render((CI_VALUES["redis"],))
    for component in SERVICES:
        data = config_data(manifests, component)
        assert data["OTEL_SERVICE_NAME"] == f"spindle-{component}"
        assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
        assert data["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
        assert data["OTEL_EXPORTER_OTLP_TIMEOUT"] == "5000"
        assert data["SPINDLE_LOG_FORMAT"] == "json"
        container = main_container(manifests, component)
        assert data["SPINDLE_METRICS_PORT"] == str(port_named(container, "metrics"))
        # Kubernetes expands $(VAR) only from variables defined before it.
        names = [e["name"] for e in container["env"]]
        attributes = env_value(container, "OTEL_RESOURCE_ATTRIBUTES")
        assert attributes is not None
        for ref in re.findall(r"\$\((\w+)\)", attributes):
            assert ref in names[: names.index("OTEL_RESOURCE_ATTRIBUTES")], f"{component}: $({ref}) is not defined yet"


def test_service_monitor_scrapes_every_metrics_port() -> None:
    manifests = render((CI_VALUES["redis"],))
    (monitor,) = find(manifests, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    selector = monitor["spec"]["selector"]
    selected = []
    for service in find(manifests, "Service"):
        labels = service["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and all(
                labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]):
            selected.append(component_of(service))
            assert "metrics" in {p["name"] for p in service["spec"]["ports"]}, component_of(service)
    assert sorted(selected) == sorted(SERVICES)


def test_grafana_dashboard_config_map_carries_the_dashboard_file() -> None:
    manifests = render((CI_VALUES["redis"],))
    dashboard = one(manifests, "ConfigMap", "dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["spindle.json"]) == json.loads((CHART / "dashboards/spindle.json").read_text())


def test_bundled_redis_keeps_an_append_only_file_and_scheduler_and_frontend_get_its_url() -> None:
    manifests = render((CI_VALUES["redis"],))
    redis = workload(manifests, "redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--appendonly") == "yes" and flag(args, "--dir") == "/data"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    service = one(manifests, "Service", "redis")
    expected = f"redis://{fqdn(service['metadata']['name'])}:6379/0"
    # The scheduler's journal, and the frontends' rate-limit counters (shared by every replica).
    for component in ("scheduler", "frontend"):
        assert config_data(manifests, component)["SPINDLE_STATE_STORE"] == expected, component
    assert "SPINDLE_STATE_STORE" not in config_data(manifests, "worker")


def test_external_redis_replaces_the_bundled_one() -> None:
    by_url = render(sets=("redis.enabled=true", "redis.externalUrl=redis://cache:6379/2"))
    assert not find(by_url, "StatefulSet", "redis") and not find(by_url, "Service", "redis")
    by_secret = render(sets=("redis.externalUrlSecret.name=redis-url",))
    for component in ("scheduler", "frontend"):
        assert config_data(by_url, component)["SPINDLE_STATE_STORE"] == "redis://cache:6379/2"
        assert "SPINDLE_STATE_STORE" not in config_data(by_secret, component)
        env = {e["name"]: e for e in main_container(by_secret, component).get("env", [])}
        assert env["SPINDLE_STATE_STORE"]["valueFrom"] == {"secretKeyRef": {"name": "redis-url", "key": "url"}}
        assert "SPINDLE_STATE_STORE" not in config_data(render(), component), "no Redis by default"
    worker_env = {e["name"] for e in main_container(by_secret, "worker").get("env", [])}
    assert "SPINDLE_STATE_STORE" not in worker_env


def test_api_keys_are_a_secret_file_in_the_frontend_only() -> None:
    manifests = render((CI_VALUES["redis"],))
    secret = one(manifests, "Secret", "frontend")
    assert secret["stringData"]["keys"].split() == ["sk-ci-one", "sk-ci-two"]
    frontend = main_container(manifests, "frontend")
    assert env_value(frontend, "SPINDLE_API_KEY_FILE") == "/etc/spindle/api-keys/keys"
    mount = next(m for m in frontend["volumeMounts"] if m["mountPath"] == "/etc/spindle/api-keys")
    assert mount["readOnly"] is True and "subPath" not in mount, "a subPath mount never sees a rotated key"
    volume = next(v for v in pod_spec(workload(manifests, "frontend"))["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    for component in ("scheduler", "worker"):
        assert env_value(main_container(manifests, component), "SPINDLE_API_KEY_FILE") is None

    existing = render(sets=("apiKeys.existingSecret=my-keys",))
    assert not find(existing, "Secret")
    volumes = pod_spec(workload(existing, "frontend"))["volumes"]
    assert {"name": "api-keys", "secret": {"secretName": "my-keys", "defaultMode": 288}} in volumes


@pytest.mark.parametrize("source", ["pvc", "existingClaim", "hostPath", "emptyDir"])
def test_model_volume_is_mounted_read_only_where_the_model_is_read(source: str) -> None:
    sets = {
        "pvc": (),
        "existingClaim": ("model.volume.existingClaim=models",),
        "hostPath": ("model.volume.hostPath=/srv/models",),
        "emptyDir": ("model.download.enabled=true", "model.download.source=org/model"),
    }[source]
    manifests = render(sets=(f"model.volume.type={source}", "model.path=llama", *sets))
    assert bool(find(manifests, "PersistentVolumeClaim", "model")) == (source == "pvc")
    for component in SERVICES:
        spec = pod_spec(workload(manifests, component))
        container = main_container(manifests, component)
        mounts = [m for m in container["volumeMounts"] if m["name"] == "model"]
        if component == "scheduler":
            assert not mounts and not spec.get("initContainers"), "the scheduler never reads the model"
            continue
        assert mounts == [{"name": "model", "mountPath": "/models", "readOnly": True}]
        assert flag(container["args"], "--model") == "/models/llama"
        inits = spec.get("initContainers", [])
        assert len(inits) == (source == "emptyDir")
        for init in inits:
            env = {e["name"]: e.get("value") for e in init["env"]}
            assert env["SPINDLE_MODEL_DIR"] == "/models/llama" and env["SPINDLE_COMPONENT"] == component
            assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"], "the init container writes"


def test_values_that_cannot_work_are_refused() -> None:
    assert "set model.download.enabled=true" in render_error("model.volume.type=emptyDir")
    assert "model.volume.existingClaim is required" in render_error("model.volume.type=existingClaim")
    assert "worker/gpu" in render_error("worker.gpu=2"), "one worker per GPU"
    assert "additional properties" in render_error("worker.replica=2"), "a misspelt key is an error"
    # The service must finish its own graceful stop before Kubernetes' SIGKILL.
    assert "must be below frontend.terminationGracePeriodSeconds" in render_error(
        "frontend.config.shutdownGraceS=30", "frontend.terminationGracePeriodSeconds=30")


def test_disruption_budgets_and_autoscaler(values_set: str, manifests: tuple[Manifest, ...]) -> None:
    budgets = {component_of(m): m for m in find(manifests, "PodDisruptionBudget")}
    assert sorted(budgets) == ([] if values_set == "minimal" else ["frontend", "worker"])
    for component, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"] == workload(manifests, component)["spec"]["selector"][
            "matchLabels"]
    autoscalers = find(manifests, "HorizontalPodAutoscaler")
    frontend = workload(manifests, "frontend")
    if values_set == "redis":
        (hpa,) = autoscalers
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": frontend["metadata"]["name"]}
        assert "replicas" not in frontend["spec"], "the autoscaler owns the replica count"
    else:
        assert not autoscalers and frontend["spec"]["replicas"] == 1


def test_everything_optional_is_off_in_minimal_values() -> None:
    manifests = render((CI_VALUES["minimal"],))
    kinds = sorted({m["kind"] for m in manifests})
    assert kinds == ["ConfigMap", "Deployment", "Pod", "Service", "StatefulSet"]
    for component in SERVICES:
        assert config_data(manifests, component)["SPINDLE_METRICS_PORT"] == "0"
        assert "metrics" not in {p["name"] for p in main_container(manifests, component)["ports"]}
    assert pod_spec(workload(manifests, "worker"))["serviceAccountName"] == "default"


def test_services_route_to_the_container_ports(manifests: tuple[Manifest, ...]) -> None:
    for service in find(manifests, "Service"):
        component = component_of(service)
        spec = pod_spec(workload(manifests, component))
        pod_labels = (workload(manifests, component)["spec"]["template"]["metadata"]["labels"])
        assert all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items()), component
        for port in service["spec"]["ports"]:
            names = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
            assert port["targetPort"] in names, f"{component} Service port {port['name']} targets nothing"


def test_values_schema_is_valid_and_covers_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_a_worker_told_no_thread_count_gets_its_cpu_request() -> None:
    """torch would start a thread per core of the node; the pod's CPU request, rounded up, is what
    it was given (the worker caps its threads at a CPU limit itself: services/cpu_quota.py)."""
    worker = main_container(render(), "worker")
    env = {e["name"]: e for e in worker.get("env", [])}
    assert env["SPINDLE_NUM_THREADS"]["valueFrom"] == {
        "resourceFieldRef": {"containerName": worker["name"], "resource": "requests.cpu", "divisor": "1"}}
    manifests = render(sets=("worker.config.numThreads=4",))
    assert "SPINDLE_NUM_THREADS" not in {e["name"] for e in main_container(manifests, "worker").get("env", [])}
    assert config_data(manifests, "worker")["SPINDLE_NUM_THREADS"] == "4"  # as told, not overridden by env
