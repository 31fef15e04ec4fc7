"""Serving rendered beside training (``spec.serving``; docs/serving.md, "On Kubernetes").

* ``<job>-infer-ps``: StatefulSet + headless Service. Each replica owns the rows of its shard, so
  it needs a stable index (the pod ordinal), and the embedding workers list the replicas by DNS
  name in replica order (``infer_config.servers``).
* ``<job>-infer-ew``: Deployment + Service (gRPC 8887): inference embedding workers.
* ``<job>-model-server``: Deployment with ``/ready`` and ``/live`` probes + Service (HTTP 8080,
  gRPC 8081): what clients call.
* ``<job>-serving-config``: the inference ``global_config.yml`` (the job's inline global config
  with ``job_type: Infer`` and the PS addresses), so incremental-update settings carry over.

None of these carry the attempt label: a training restart leaves serving running, and a finished
job's cleanup (cleanPodPolicy) leaves it too (deleting the PersiaJob removes it). Scaling is
``replicas`` (the plan patches Deployments' replicas in place).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from . import constants as C
from . import naming
from .job import PersiaJob
from .podsecurity import container_security_context, pod_security_context
from .render import (
    _POD_INDEX_FIELD,
    CHECKPOINT_VOLUME,
    CONFIG_VOLUME,
    TMP_VOLUME,
    _dedupe_env,
    _meta,
    config_paths,
    secret_volumes,
    security_env,
)
from .spec import RoleSpec

ROLE_INFER_PS = "infer-ps"
ROLE_INFER_EW = "infer-ew"
ROLE_MODEL_SERVER = "model-server"
SERVING_ROLES = (ROLE_INFER_PS, ROLE_INFER_EW, ROLE_MODEL_SERVER)
PS_PORT, EW_PORT, HTTP_PORT, GRPC_PORT = 8888, 8887, 8080, 8081
SERVING_CONFIG_PATH = "/etc/persia-serving"
SERVING_CONFIG_VOLUME = "persia-serving-config"


def serving_config_map_name(job: str) -> str:
    return f"{job}-serving-config"


def ps_addresses(job: PersiaJob) -> list[str]:
    """The inference PS replicas' stable DNS names, in replica order."""
    name = naming.workload_name(job.name, ROLE_INFER_PS)
    replicas = job.spec.serving.embedding_parameter_server.replicas
    return [f"{name}-{i}.{name}.{job.namespace}.svc:{PS_PORT}" for i in range(replicas)]


def infer_global_config(job: PersiaJob) -> dict[str, Any]:
    """Pure: the job's inline global config (if any) made an inference one."""
    configs = job.spec.configs
    gc = copy.deepcopy(configs.global_config) if configs is not None and configs.global_config else {}
    common = gc.setdefault("common_config", {})
    common["job_type"] = "Infer"
    infer: dict[str, Any] = {"servers": ps_addresses(job)}
    if job.spec.serving.embedding_checkpoint:
        infer["embedding_checkpoint"] = job.spec.serving.embedding_checkpoint
    common["infer_config"] = infer
    return gc


def _env(name: str, value: Any) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _container_env(job: PersiaJob, role_spec: RoleSpec, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    _, embedding_path = config_paths(job.spec)
    env = [
        _env("PERSIA_JOB_NAME", job.name),
        _env("PERSIA_GLOBAL_CONFIG", f"{SERVING_CONFIG_PATH}/{C.GLOBAL_CONFIG_FILE}"),
        _env("PERSIA_EMBEDDING_CONFIG", embedding_path),
        _env("LOG_LEVEL", job.spec.log_level),
        {"name": "PERSIA_BIND_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *extra,
        *[e for e in security_env(job) if e["name"].startswith("PERSIA_GRPC_TLS_")],  # no NATS here
    ]
    if job.spec.security_context == "restricted":
        env.append(_env("HOME", "/tmp"))
    env += [v.model_dump(by_alias=True, exclude_none=True) for v in [*job.spec.env, *role_spec.env]]
    return _dedupe_env(env)


def _pod_template(job: PersiaJob, role: str, role_spec: RoleSpec, args: list[str], env: list[dict[str, Any]],
                  ports: list[dict[str, Any]], probes: dict[str, Any], metrics_port: str) -> dict[str, Any]:
    spec = job.spec
    container: dict[str, Any] = {
        "name": role, "image": role_spec.image or spec.image or C.DEFAULT_CPU_IMAGE,
        "command": ["persia-launcher"], "args": args, "env": env, "ports": ports, **probes,
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if role_spec.resources:
        container["resources"] = role_spec.resources
    volumes = [dict(v) for v in spec.volumes]
    volumes.append({"name": SERVING_CONFIG_VOLUME, "configMap": {"name": serving_config_map_name(job.name)}})
    mounts = [dict(m) for m in role_spec.volume_mounts]
    mounts.append({"name": SERVING_CONFIG_VOLUME, "mountPath": SERVING_CONFIG_PATH, "readOnly": True})
    if spec.configs is not None:  # the inline embedding config, from the training ConfigMap
        volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": naming.config_map_name(job.name)}})
        mounts.append({"name": CONFIG_VOLUME, "mountPath": C.CONFIG_MOUNT_PATH, "readOnly": True})
    ckpt = spec.checkpoint
    if ckpt is not None and role != ROLE_INFER_EW:  # the PS and the model server read checkpoints
        if ckpt.persistent_volume_claim:
            volumes.append({"name": CHECKPOINT_VOLUME,
                            "persistentVolumeClaim": {"claimName": ckpt.persistent_volume_claim, "readOnly": True}})
        if (ckpt.persistent_volume_claim or ckpt.volume) and not any(m["mountPath"] == ckpt.mount_path for m in mounts):
            mounts.append({"name": ckpt.volume or CHECKPOINT_VOLUME, "mountPath": ckpt.mount_path, "readOnly": True})
    tls_volumes, tls_mounts = secret_volumes(spec)
    volumes += [v for v in tls_volumes if v["name"] == "grpc-tls"]
    mounts += [m for m in tls_mounts if m["name"] == "grpc-tls"]
    pod: dict[str, Any] = {"enableServiceLinks": False, "containers": [container], "volumes": volumes}
    if spec.security_context == "restricted":
        volumes.append({"name": TMP_VOLUME, "emptyDir": {}})
        mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
        container["securityContext"] = container_security_context(read_only=True)
        pod["securityContext"] = pod_security_context()
    container["volumeMounts"] = mounts
    metadata: dict[str, Any] = {"labels": naming.common_labels(job.name, role)}
    if spec.enable_metrics:
        metadata["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": metrics_port,
                                   "prometheus.io/path": "/metrics"}
    return {"metadata": metadata, "spec": pod}


def _service(job: PersiaJob, role: str, ports: list[dict[str, Any]], headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": naming.selector_labels(job.name, role), "ports": ports}
    if headless:  # DNS names before readiness: the embedding workers resolve the PS at start
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "spec": spec,
            "metadata": _meta(job, naming.workload_name(job.name, role), role, attempt=False)}


def _workload(job: PersiaJob, kind: str, role: str, replicas: int, template: dict[str, Any]) -> dict[str, Any]:
    name = naming.workload_name(job.name, role)
    spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": naming.selector_labels(job.name, role)},
                            "template": template}
    if kind == "StatefulSet":
        spec.update(serviceName=name, podManagementPolicy="Parallel")
    return {"apiVersion": "apps/v1", "kind": kind, "spec": spec, "metadata": _meta(job, name, role, attempt=False)}


def render_serving(job: PersiaJob) -> list[dict[str, Any]]:
    """Every serving child of ``job`` (none without ``spec.serving``)."""
    serving = job.spec.serving
    if serving is None:
        return []
    metrics = [{"name": "metrics", "containerPort": C.METRICS_PORT}]
    tcp_ready = {"readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5}}
    common_extra = [_env("PERSIA_METRICS_PORT", C.METRICS_PORT)]

    ps_spec = serving.embedding_parameter_server
    ps = _pod_template(
        job, ROLE_INFER_PS, ps_spec,
        ["embedding-parameter-server", "--global-config", "$(PERSIA_GLOBAL_CONFIG)", "--replica-index",
         "$(REPLICA_INDEX)", "--replica-size", "$(REPLICA_SIZE)", "--port", str(PS_PORT)],
        _container_env(job, ps_spec, [*common_extra, {"name": "REPLICA_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": _POD_INDEX_FIELD}}}, _env("REPLICA_SIZE", ps_spec.replicas)]),
        [{"name": "rpc", "containerPort": PS_PORT}, *metrics], tcp_ready, str(C.METRICS_PORT))
    ew_spec = serving.embedding_worker
    ew = _pod_template(
        job, ROLE_INFER_EW, ew_spec,
        ["embedding-worker", "--global-config", "$(PERSIA_GLOBAL_CONFIG)", "--embedding-config",
         "$(PERSIA_EMBEDDING_CONFIG)", "--port", str(EW_PORT)],
        _container_env(job, ew_spec, common_extra),
        [{"name": "rpc", "containerPort": EW_PORT}, *metrics], tcp_ready, str(C.METRICS_PORT))
    ms_spec = serving.model_server
    ew_address = f"{naming.workload_name(job.name, ROLE_INFER_EW)}.{job.namespace}.svc:{EW_PORT}"
    ms = _pod_template(
        job, ROLE_MODEL_SERVER, ms_spec,
        ["serve", "--model", serving.model, "--embedding-worker", ew_address, "--http-port", str(HTTP_PORT),
         "--grpc-port", str(GRPC_PORT), "--max-batch-size", str(serving.max_batch_size),
         "--max-latency-ms", str(serving.max_latency_ms)],
        _container_env(job, ms_spec, []),
        [{"name": "http", "containerPort": HTTP_PORT}, {"name": "grpc", "containerPort": GRPC_PORT}],
        {"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
         "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}},
        str(HTTP_PORT))
    config = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": _meta(job, serving_config_map_name(job.name), "serving-config", attempt=False),
              "data": {C.GLOBAL_CONFIG_FILE: yaml.safe_dump(infer_global_config(job), sort_keys=False)}}
    rpc = [{"name": "rpc", "targetPort": "rpc"}, {"name": "metrics", "port": C.METRICS_PORT, "targetPort": "metrics"}]
    return [
        config,
        _service(job, ROLE_INFER_PS, [{**rpc[0], "port": PS_PORT}, rpc[1]], headless=True),
        _workload(job, "StatefulSet", ROLE_INFER_PS, ps_spec.replicas, ps),
        _service(job, ROLE_INFER_EW, [{**rpc[0], "port": EW_PORT}, rpc[1]], headless=False),
        _workload(job, "Deployment", ROLE_INFER_EW, ew_spec.replicas, ew),
        _service(job, ROLE_MODEL_SERVER, [{"name": "http", "port": HTTP_PORT, "targetPort": "http"},
                                          {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"}], headless=False),
        _workload(job, "Deployment", ROLE_MODEL_SERVER, ms_spec.replicas, ms),
    ]
