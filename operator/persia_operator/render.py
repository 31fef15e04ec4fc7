"""`render(job) -> manifests`: every child of a PersiaJob, as plain dicts.

Pure and deterministic (same job in, same list out), so it is tested without a cluster
and shared by the operator and `persia-operator render`.

Workload kinds per role:
- embedding PS and embedding workers: StatefulSets (Parallel) + headless Services;
  REPLICA_INDEX is the pod ordinal (label apps.kubernetes.io/pod-index).
- NN workers and data loaders: Indexed Jobs in batch mode (REPLICA_INDEX = completion
  index), Deployments in online mode (no REPLICA_INDEX: ranks come from a NATS
  rendezvous, PERSIA_RENDEZVOUS=nats), each with a headless Service.
- NATS (unless external): see nats.py.
"""

from __future__ import annotations

from typing import Any

import yaml

from . import constants as C
from . import naming
from .job import PersiaJob
from .nats import render_nats
from .overlay import merge
from .spec import EnvVar, PersiaJobSpec, RoleSpec

CONFIG_VOLUME = "persia-config"

STATEFUL_ROLES = (C.ROLE_PS, C.ROLE_EMBEDDING_WORKER)
RUN_TO_COMPLETION_ROLES = (C.ROLE_NN_WORKER, C.ROLE_DATALOADER)

_POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
_COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def owner_references(job: PersiaJob) -> list[dict[str, Any]]:
    """Owner reference to the job, or none when the job has no uid yet (CLI render)."""
    if not job.metadata.uid:
        return []
    return [
        {
            "apiVersion": C.API_VERSION,
            "kind": C.KIND,
            "name": job.name,
            "uid": job.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def workload_kind(spec: PersiaJobSpec, role: str) -> str:
    if role in STATEFUL_ROLES:
        return "StatefulSet"
    return "Job" if spec.training_mode == "batch" else "Deployment"


def _env(name: str, value: str | int) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _dedupe_env(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Last definition of a name wins (as in the kubelet), listed once."""
    last = {var["name"]: n for n, var in enumerate(env)}
    return [var for n, var in enumerate(env) if last[var["name"]] == n]


def config_paths(spec: PersiaJobSpec) -> tuple[str, str]:
    """PERSIA_GLOBAL_CONFIG and PERSIA_EMBEDDING_CONFIG as the pods see them."""
    configs = spec.configs
    global_path = spec.persia_env.PERSIA_GLOBAL_CONFIG
    embedding_path = spec.persia_env.PERSIA_EMBEDDING_CONFIG
    if configs is not None and configs.global_config is not None:
        global_path = f"{C.CONFIG_MOUNT_PATH}/{C.GLOBAL_CONFIG_FILE}"
    if configs is not None and configs.embedding_config is not None:
        embedding_path = f"{C.CONFIG_MOUNT_PATH}/{C.EMBEDDING_CONFIG_FILE}"
    return global_path or "", embedding_path or ""


def role_env(job: PersiaJob, role: str, role_spec: RoleSpec) -> list[dict[str, Any]]:
    """The PERSIA env contract, then spec.env, then the role's env."""
    spec = job.spec
    online = spec.training_mode == "online" and role in RUN_TO_COMPLETION_ROLES
    global_path, embedding_path = config_paths(spec)
    env = [
        _env("PERSIA_NATS_URL", spec.nats_url(job.name, job.namespace)),
        _env("PERSIA_JOB_NAME", job.name),
        _env("PERSIA_GLOBAL_CONFIG", global_path),
        _env("PERSIA_EMBEDDING_CONFIG", embedding_path),
        _env("LOG_LEVEL", spec.log_level),
    ]
    if online:
        env.append(_env("PERSIA_RENDEZVOUS", "nats"))
    elif role in STATEFUL_ROLES:
        env.append(_field_env("REPLICA_INDEX", _POD_INDEX_FIELD))
    else:
        env.append(_field_env("REPLICA_INDEX", _COMPLETION_INDEX_FIELD))
    env.append(_env("REPLICA_SIZE", role_spec.replicas))
    if role == C.ROLE_NN_WORKER:
        env.append(_env("NPROC_PER_NODE", spec.nn_worker.nproc_per_node))
        env.append(_env("PERSIA_NN_WORKER_ENTRY", spec.persia_env.PERSIA_NN_WORKER_ENTRY or ""))
    if role == C.ROLE_DATALOADER:
        env.append(_env("PERSIA_DATALOADER_ENTRY", spec.persia_env.PERSIA_DATALOADER_ENTRY or ""))
    env.append(_env("PERSIA_METRICS_PORT", C.METRICS_PORT))
    user: list[EnvVar] = [*spec.env, *role_spec.env]
    env += [v.model_dump(by_alias=True, exclude_none=True) for v in user]
    return _dedupe_env(env)


def launcher_args(spec: PersiaJobSpec, role: str) -> list[str]:
    """`persia-launcher` arguments per role (PERSIA's, plus the server ports)."""
    online = spec.training_mode == "online"
    command = C.LAUNCHER_COMMANDS[role]
    if role in STATEFUL_ROLES:
        return [
            command,
            "--embedding-config", "$(PERSIA_EMBEDDING_CONFIG)",
            "--global-config", "$(PERSIA_GLOBAL_CONFIG)",
            "--replica-index", "$(REPLICA_INDEX)",
            "--replica-size", "$(REPLICA_SIZE)",
            "--port", str(C.SERVICE_PORTS[role]),
        ]  # fmt: skip
    if role == C.ROLE_NN_WORKER:
        args = [
            command, "$(PERSIA_NN_WORKER_ENTRY)",
            "--nproc-per-node", "$(NPROC_PER_NODE)",
            "--nnodes", "$(REPLICA_SIZE)",
        ]  # fmt: skip
        return args if online else [*args, "--node-rank", "$(REPLICA_INDEX)"]
    args = [command, "$(PERSIA_DATALOADER_ENTRY)"]
    if not online:
        args += ["--replica-index", "$(REPLICA_INDEX)"]
    return [*args, "--replica-size", "$(REPLICA_SIZE)"]


def default_image(spec: PersiaJobSpec, role: str, role_spec: RoleSpec) -> str:
    if role_spec.image:
        return role_spec.image
    if spec.image:
        return spec.image
    return C.DEFAULT_CUDA_IMAGE if role == C.ROLE_NN_WORKER else C.DEFAULT_CPU_IMAGE


def _pod_template(job: PersiaJob, role: str, role_spec: RoleSpec, kind: str) -> dict[str, Any]:
    spec = job.spec
    labels = {
        **naming.common_labels(job.name, role),
        C.LABEL_ATTEMPT: str(job.status.attempt),
    }
    ports = [{"name": "metrics", "containerPort": C.METRICS_PORT}]
    if role in C.SERVICE_PORTS:
        ports.insert(0, {"name": "rpc", "containerPort": C.SERVICE_PORTS[role]})
    container: dict[str, Any] = {
        "name": C.LAUNCHER_COMMANDS[role],
        "image": default_image(spec, role, role_spec),
        "command": ["persia-launcher"],
        "args": launcher_args(spec, role),
        "env": role_env(job, role, role_spec),
        "ports": ports,
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    if role_spec.resources:
        container["resources"] = role_spec.resources
    if role in C.SERVICE_PORTS:
        container["readinessProbe"] = {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5}
    mounts = [dict(m) for m in role_spec.volume_mounts]
    volumes = [dict(v) for v in spec.volumes]
    if spec.configs is not None:
        mounts.append({"name": CONFIG_VOLUME, "mountPath": C.CONFIG_MOUNT_PATH, "readOnly": True})
        volumes.append(
            {"name": CONFIG_VOLUME, "configMap": {"name": naming.config_map_name(job.name)}}
        )
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {"enableServiceLinks": False, "containers": [container]}
    if volumes:
        pod_spec["volumes"] = volumes
    if kind == "Job":
        pod_spec["subdomain"] = naming.workload_name(job.name, role)
    if spec.run_policy.scheduler_name:
        pod_spec["schedulerName"] = spec.run_policy.scheduler_name
    if spec.run_policy.priority_class_name:
        pod_spec["priorityClassName"] = spec.run_policy.priority_class_name
    annotations = {}
    if spec.enable_metrics:
        annotations = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(C.METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }
    template: dict[str, Any] = {"metadata": {"labels": labels}, "spec": pod_spec}
    if annotations:
        template["metadata"]["annotations"] = annotations
    if role_spec.template is not None:
        template = merge(template, role_spec.template.model_dump(by_alias=True, exclude_none=True))
        template["metadata"]["labels"].update(labels)
    template["spec"]["restartPolicy"] = spec.restart_policy if kind == "Job" else "Always"
    return template


def _meta(job: PersiaJob, name: str, role: str, attempt: bool) -> dict[str, Any]:
    labels = naming.common_labels(job.name, role)
    if attempt:
        labels[C.LABEL_ATTEMPT] = str(job.status.attempt)
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace, "labels": labels}
    owner = owner_references(job)
    if owner:
        meta["ownerReferences"] = owner
    return meta


def render_role(job: PersiaJob, role: str) -> list[dict[str, Any]]:
    """Headless Service + workload of one training role (nothing if the role is absent)."""
    role_spec = job.spec.role(role)
    if role_spec is None:
        return []
    name = naming.workload_name(job.name, role)
    kind = workload_kind(job.spec, role)
    selector = naming.selector_labels(job.name, role)
    ports = [{"name": "metrics", "port": C.METRICS_PORT, "targetPort": "metrics"}]
    if role in C.SERVICE_PORTS:
        ports.insert(0, {"name": "rpc", "port": C.SERVICE_PORTS[role], "targetPort": "rpc"})
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, name, role, attempt=False),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(selector),
            "ports": ports,
        },
    }
    template = _pod_template(job, role, role_spec, kind)
    workload_spec: dict[str, Any]
    if kind == "StatefulSet":
        workload_spec = {
            "replicas": role_spec.replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(selector)},
            "template": template,
        }
        api_version = "apps/v1"
    elif kind == "Job":
        workload_spec = {
            "completionMode": "Indexed",
            "completions": role_spec.replicas,
            "parallelism": role_spec.replicas,
            # Never: the first failed pod fails the Job and the operator decides about a
            # whole-job restart. OnFailure: containers retry in place up to backoffLimit.
            "backoffLimit": (
                0 if job.spec.restart_policy == "Never" else job.spec.run_policy.backoff_limit
            ),
            "template": template,
        }
        api_version = "batch/v1"
    else:
        workload_spec = {
            "replicas": role_spec.replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": dict(selector)},
            "template": template,
        }
        api_version = "apps/v1"
    workload = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _meta(job, name, role, attempt=True),
        "spec": workload_spec,
    }
    return [service, workload]


def render_config_map(job: PersiaJob) -> list[dict[str, Any]]:
    configs = job.spec.configs
    if configs is None:
        return []
    data = {}
    if configs.global_config is not None:
        data[C.GLOBAL_CONFIG_FILE] = yaml.safe_dump(configs.global_config, sort_keys=False)
    if configs.embedding_config is not None:
        data[C.EMBEDDING_CONFIG_FILE] = yaml.safe_dump(configs.embedding_config, sort_keys=False)
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(job, naming.config_map_name(job.name), "config", attempt=False),
            "data": data,
        }
    ]


def render(job: PersiaJob) -> list[dict[str, Any]]:
    """All children of `job` for its current attempt (job.status.attempt)."""
    children = render_config_map(job)
    if job.spec.nats_managed():
        children += render_nats(job.name, job.namespace, job.spec.nats, owner_references(job))
    for role in C.TRAINING_ROLES:
        children += render_role(job, role)
    return children
