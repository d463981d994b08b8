{{/*
Helpers shared by every template, all named spindle.*. The three services' pods are built by
one helper (spindle.podTemplate) so that security, volumes, probes and environment cannot
drift apart between them; each workload template only says what is its own (arguments, ports,
the health service its readiness probe asks for).
*/}}

{{- define "spindle.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name; component names add at most 10 characters. */}}
{{- define "spindle.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of a component's resources: (dict "ctx" $ "component" "worker") */}}
{{- define "spindle.componentName" -}}
{{- printf "%s-%s" (include "spindle.fullname" .ctx) .component }}
{{- end }}

{{- define "spindle.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: (dict "ctx" $ "component" "frontend") */}}
{{- define "spindle.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spindle.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Common labels: (dict "ctx" $ "component" "frontend") */}}
{{- define "spindle.labels" -}}
helm.sh/chart: {{ include "spindle.chart" .ctx }}
{{ include "spindle.selectorLabels" . }}
app.kubernetes.io/part-of: spindle
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{- define "spindle.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spindle.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
In-cluster DNS name of a Service: (dict "ctx" $ "component" "scheduler"). Fully qualified, so
it resolves the same from any namespace and never hits the resolver's search list.
*/}}
{{- define "spindle.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "spindle.componentName" .) .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{- define "spindle.schedulerAddress" -}}
{{- printf "%s:%d" (include "spindle.serviceHost" (dict "ctx" . "component" "scheduler")) (int .Values.scheduler.grpcPort) }}
{{- end }}

{{/*
The scheduler's --workers-addr: one stable StatefulSet pod name per worker replica,
<sts>-<i>.<headless service>, in replica order.
*/}}
{{- define "spindle.workerAddresses" -}}
{{- $sts := include "spindle.componentName" (dict "ctx" . "component" "worker") }}
{{- $svc := include "spindle.serviceHost" (dict "ctx" . "component" "worker") }}
{{- $addrs := list }}
{{- range $i := until (int .Values.worker.replicas) }}
{{- $addrs = append $addrs (printf "%s-%d.%s:%d" $sts $i $svc (int $.Values.worker.grpcPort)) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* "true" when the chart runs its own Redis: asked for, and no external one named. */}}
{{- define "spindle.redisBundled" -}}
{{- $r := .Values.redis }}
{{- if and $r.enabled (not $r.externalUrl) (not $r.externalUrlSecret.name) }}true{{ end }}
{{- end }}

{{/* The state store URL when it is not in a Secret; empty: state stays in each process's memory. */}}
{{- define "spindle.redisUrl" -}}
{{- if .Values.redis.externalUrl }}
{{- .Values.redis.externalUrl }}
{{- else if include "spindle.redisBundled" . }}
{{- printf "redis://%s:%d/0" (include "spindle.serviceHost" (dict "ctx" . "component" "redis")) (int .Values.redis.port) }}
{{- end }}
{{- end }}

{{/*
ConfigMap of a component that uses the state store, (dict "ctx" $ "component" "scheduler"): the
scheduler journals accepted requests there, frontends count per-key rate limits there (shared by
every replica). Carries SPINDLE_STATE_STORE unless the URL is in a Secret (stateStoreSecretEnv).
*/}}
{{- define "spindle.stateStoreConfigMap" -}}
{{- $extra := dict }}
{{- with include "spindle.redisUrl" .ctx }}
{{- $_ := set $extra "SPINDLE_STATE_STORE" . }}
{{- end }}
{{- include "spindle.configMap" (dict "ctx" .ctx "component" .component "extra" $extra) }}
{{- end }}

{{/* SPINDLE_STATE_STORE from `redis.externalUrlSecret`, as a YAML list of container env entries (none without it). */}}
{{- define "spindle.stateStoreSecretEnv" -}}
{{- with .Values.redis.externalUrlSecret.name }}
- name: SPINDLE_STATE_STORE
  valueFrom:
    secretKeyRef:
      name: {{ . | quote }}
      key: {{ $.Values.redis.externalUrlSecret.key | quote }}
{{- end }}
{{- end }}

{{/* Image of a component: (dict "ctx" $ "gpu" bool). Variant suffix -cuda for GPU workers. */}}
{{- define "spindle.image" -}}
{{- $image := .ctx.Values.image }}
{{- $tag := default .ctx.Chart.AppVersion $image.tag }}
{{- printf "%s:%s-%s" $image.repository $tag (ternary "cuda" "cpu" .gpu) }}
{{- end }}

{{- define "spindle.modelDir" -}}
{{- $v := .Values.model.volume }}
{{- if .Values.model.path }}
{{- printf "%s/%s" (trimSuffix "/" $v.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- else }}
{{- $v.mountPath }}
{{- end }}
{{- end }}

{{- define "spindle.apiKeysSecretName" -}}
{{- default (include "spindle.componentName" (dict "ctx" . "component" "api-keys")) .Values.apiKeys.existingSecret }}
{{- end }}

{{- define "spindle.apiKeysEnabled" -}}
{{- if or .Values.apiKeys.keys .Values.apiKeys.existingSecret }}true{{ end }}
{{- end }}

{{/*
ConfigMap data of a component: (dict "ctx" $ "component" "worker" "extra" dict). Settings
every service shares (logs, metrics, tracing), the chart's own for the component (`extra`),
then its `config` block mapped 1:1 onto SPINDLE_* variables (maxNumSeqs ->
SPINDLE_MAX_NUM_SEQS), which wins over `extra`.
*/}}
{{- define "spindle.configData" -}}
{{- $ctx := .ctx }}
{{- $values := index $ctx.Values .component }}
{{- $data := dict
      "SPINDLE_LOG_FORMAT" $ctx.Values.logging.format
      "SPINDLE_LOG_LEVEL" $ctx.Values.logging.level
      "SPINDLE_LOG_REQUESTS" (toString $ctx.Values.logging.logRequests)
      "SPINDLE_METRICS_PORT" (ternary $values.metricsPort 0 $ctx.Values.metrics.enabled | toString)
      "OTEL_SERVICE_NAME" (printf "spindle-%s" .component) }}
{{- with $ctx.Values.tracing.otlpEndpoint }}
{{- $_ := set $data "OTEL_EXPORTER_OTLP_ENDPOINT" . }}
{{- $_ := set $data "OTEL_TRACES_SAMPLER" "parentbased_traceidratio" }}
{{- $_ := set $data "OTEL_TRACES_SAMPLER_ARG" ($ctx.Values.tracing.samplingRatio | toString) }}
{{- range $k, $v := $ctx.Values.tracing.extraEnv }}
{{- $_ := set $data $k (include "spindle.envValue" $v) }}
{{- end }}
{{- end }}
{{- range $k, $v := .extra }}
{{- $_ := set $data $k (include "spindle.envValue" $v) }}
{{- end }}
{{- range $key, $value := $values.config }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $data (printf "SPINDLE_%s" (snakecase $key | upper)) (include "spindle.envValue" $value) }}
{{- end }}
{{- end }}
{{- toYaml $data }}
{{- end }}

{{/*
A value as an environment variable's text. YAML integers reach templates as float64, and
toString writes 1073741824 as "1.073741824e+09", which int() in the services rejects:
whole numbers are written as integers.
*/}}
{{- define "spindle.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}
{{- int64 . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* A component's ConfigMap: (dict "ctx" $ "component" "worker" "extra" dict) */}}
{{- define "spindle.configMap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "spindle.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "spindle.labels" . | nindent 4 }}
data:
  {{- include "spindle.configData" . | nindent 2 }}
{{- end }}

{{/*
The three probes of a service container: (dict "port" 50061 "service" "spindle.v1.WorkerService"
"probes" .Values.worker.probes). Startup and liveness ask the server as a whole (""),
readiness the named service; all are native gRPC probes on grpc.health.v1.
*/}}
{{- define "spindle.probes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
    service: ""
  {{- toYaml .probes.startup | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ .port }}
    service: ""
  {{- toYaml .probes.liveness | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: {{ .service | quote }}
  {{- toYaml .probes.readiness | nindent 2 }}
{{- end }}

{{/*
Writable paths under the read-only root filesystem: /tmp (HOME) and a cache directory for
Hugging Face, torch and Triton, each an emptyDir.
*/}}
{{- define "spindle.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /var/cache/spindle
- name: HF_HOME
  value: /var/cache/spindle/huggingface
- name: TORCHINDUCTOR_CACHE_DIR
  value: /var/cache/spindle/torchinductor
- name: TRITON_CACHE_DIR
  value: /var/cache/spindle/triton
{{- end }}

{{- define "spindle.cacheVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/spindle
{{- end }}

{{- define "spindle.cacheVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.podSecurity.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.podSecurity.cacheSizeLimit }}
{{- end }}

{{- define "spindle.modelVolume" -}}
{{- $v := .Values.model.volume -}}
- name: model
{{- if eq $v.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "spindle.componentName" (dict "ctx" . "component" "model") }}
{{- else if eq $v.type "existingClaim" }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.existingClaim is required with model.volume.type=existingClaim" $v.existingClaim }}
{{- else if eq $v.type "hostPath" }}
  hostPath:
    path: {{ required "model.volume.hostPath is required with model.volume.type=hostPath" $v.hostPath }}
    type: Directory
{{- else if eq $v.type "emptyDir" }}
  {{- if not .Values.model.download.enabled }}
  {{- fail "model.volume.type=emptyDir starts empty: set model.download.enabled=true" }}
  {{- end }}
  emptyDir:
    sizeLimit: {{ $v.sizeLimit }}
{{- end }}
{{- end }}

{{/* The model init container: (dict "ctx" $ "component" "worker") */}}
{{- define "spindle.modelDownloadContainer" -}}
{{- $ctx := .ctx }}
{{- $dl := $ctx.Values.model.download }}
- name: model-download
  {{- if $dl.image.repository }}
  image: {{ printf "%s:%s" $dl.image.repository (required "model.download.image.tag is required with a repository" $dl.image.tag) }}
  {{- else }}
  image: {{ include "spindle.image" (dict "ctx" $ctx "gpu" false) }}
  {{- end }}
  imagePullPolicy: {{ $dl.image.pullPolicy }}
  command:
    {{- toYaml $dl.command | nindent 4 }}
  env:
    - name: SPINDLE_MODEL_SOURCE
      value: {{ required "model.download.source is required with model.download.enabled" $dl.source | quote }}
    - name: SPINDLE_MODEL_DIR
      value: {{ include "spindle.modelDir" $ctx | quote }}
    - name: SPINDLE_COMPONENT
      value: {{ .component }}
    {{- with $dl.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $dl.tokenSecret.key }}
    {{- end }}
    {{- include "spindle.cacheEnv" $ctx | nindent 4 }}
  securityContext:
    {{- toYaml $ctx.Values.podSecurity.containerSecurityContext | nindent 4 }}
  {{- with $dl.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $ctx.Values.model.volume.mountPath }}
    {{- include "spindle.cacheVolumeMounts" $ctx | nindent 4 }}
{{- end }}

{{/*
Environment that belongs to the pod rather than the ConfigMap: the cache paths (they name the
emptyDir mounts), the API-key file (it names the Secret mount), the tracing resource
attributes (they come from the downward API) and the user's extraEnv.
*/}}
{{- define "spindle.containerEnv" -}}
{{- $ctx := .ctx }}
{{- include "spindle.cacheEnv" $ctx }}
{{- if $ctx.Values.tracing.otlpEndpoint }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),k8s.node.name=$(NODE_NAME),service.instance.id=$(POD_NAME)"
{{- end }}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The pod template of a spindle service: (dict
  "ctx" $  "component" "worker"  "values" .Values.worker
  "args" (list ...)  "healthService" "spindle.v1.WorkerService"
  "gpu" false  "mountModel" true  "env" (list EnvVar...)  "resources" (default: values.resources)
  "volumes" (list Volume...)  "volumeMounts" (list VolumeMount...))
*/}}
{{- define "spindle.podTemplate" -}}
{{- $ctx := .ctx }}
{{- $values := .values }}
{{- $containerName := .component }}
{{- with $values.config.shutdownGraceS }}
{{- if ge (float64 .) (float64 $values.terminationGracePeriodSeconds) }}
{{- fail (printf "%s.config.shutdownGraceS (%v) must be below %s.terminationGracePeriodSeconds (%v): Kubernetes kills the container then" $containerName . $containerName $values.terminationGracePeriodSeconds) }}
{{- end }}
{{- end -}}
metadata:
  labels:
    {{- include "spindle.labels" . | nindent 4 }}
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- /* Settings reach the services as environment, read once at start: roll the pods when they change. */}}
    checksum/config: {{ include (printf "%s/%s-configmap.yaml" $ctx.Template.BasePath .component) $ctx | sha256sum }}
    {{- with $values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "spindle.serviceAccountName" $ctx }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml $ctx.Values.podSecurity.podSecurityContext | nindent 4 }}
  {{- with $ctx.Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- if and .mountModel $ctx.Values.model.download.enabled }}
  initContainers:
    {{- include "spindle.modelDownloadContainer" (dict "ctx" $ctx "component" .component) | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $containerName }}
      image: {{ include "spindle.image" (dict "ctx" $ctx "gpu" .gpu) }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      args:
        {{- toYaml (concat .args $values.extraArgs) | nindent 8 }}
      envFrom:
        - configMapRef:
            name: {{ include "spindle.componentName" . }}
      env:
        {{- include "spindle.containerEnv" . | nindent 8 }}
      ports:
        {{- include "spindle.containerPorts" . | nindent 8 }}
      {{- include "spindle.probes" (dict "port" (int $values.grpcPort) "service" .healthService "probes" $values.probes) | nindent 6 }}
      securityContext:
        {{- toYaml $ctx.Values.podSecurity.containerSecurityContext | nindent 8 }}
      {{- with (default $values.resources .resources) }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "spindle.cacheVolumeMounts" $ctx | nindent 8 }}
        {{- if .mountModel }}
        - name: model
          mountPath: {{ $ctx.Values.model.volume.mountPath }}
          readOnly: true
        {{- end }}
        {{- with .volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- include "spindle.cacheVolumes" $ctx | nindent 4 }}
    {{- if .mountModel }}
    {{- include "spindle.modelVolume" $ctx | nindent 4 }}
    {{- end }}
    {{- with .volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Container ports of a component: (dict "ctx" $ "component" "frontend") */}}
{{- define "spindle.containerPorts" -}}
{{- $out := list }}
{{- range include "spindle.ports" . | fromJsonArray }}
{{- $out = append $out (dict "name" .name "containerPort" (int .port) "protocol" "TCP") }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* Service ports of a component: (dict "ctx" $ "component" "frontend"), each to the named container port. */}}
{{- define "spindle.servicePorts" -}}
{{- $out := list }}
{{- range include "spindle.ports" . | fromJsonArray }}
{{- $port := dict "name" .name "port" (int .port) "targetPort" .name "protocol" "TCP" }}
{{- if ne .name "steps" }}{{/* the step socket is plain TCP, neither gRPC nor HTTP */}}
{{- $_ := set $port "appProtocol" (ternary "grpc" "http" (eq .name "grpc")) }}
{{- end }}
{{- $out = append $out $port }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
Ports of a component as a JSON list of {name, port}, for its containers and its Service alike:
(dict "ctx" $ "component" "frontend"). `http` where the component has an httpPort, `grpc`,
`steps` where it has a stepPort (a worker's or the scheduler's step socket), and `metrics` while metrics are on.
*/}}
{{- define "spindle.ports" -}}
{{- $v := index .ctx.Values .component }}
{{- $ports := list }}
{{- if hasKey $v "httpPort" }}
{{- $ports = append $ports (dict "name" "http" "port" (int $v.httpPort)) }}
{{- end }}
{{- $ports = append $ports (dict "name" "grpc" "port" (int $v.grpcPort)) }}
{{- if hasKey $v "stepPort" }}
{{- $ports = append $ports (dict "name" "steps" "port" (int $v.stepPort)) }}
{{- end }}
{{- if .ctx.Values.metrics.enabled }}
{{- $ports = append $ports (dict "name" "metrics" "port" (int $v.metricsPort)) }}
{{- end }}
{{- toJson $ports }}
{{- end }}

{{/* PodDisruptionBudget of a component: (dict "ctx" $ "component" "worker") */}}
{{- define "spindle.podDisruptionBudget" -}}
{{- $pdb := (index .ctx.Values .component).podDisruptionBudget }}
{{- if $pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "spindle.componentName" . }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "spindle.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "spindle.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}
