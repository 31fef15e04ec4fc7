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
- PodDisruptionBudgets for the PS and the managed NATS; a PodGroup when asked.

Pod hygiene is rendered here too: restricted security contexts, an emptyDir /tmp (the
servers' root filesystem is read-only), an in-memory /dev/shm for NN workers, soft
spreading of PS replicas over nodes, a wait-for-NATS init container (a role started
before its NATS waits instead of exiting non-zero), and termination grace matching the
runtime's graceful shutdown. Credentials come from Secrets by reference only: nothing
secret is ever in a rendered manifest except the generated Secret itself.
"""

from __future__ import annotations

from typing import Any

import yaml

from . import constants as C
from . import naming
from .job import PersiaJob
from .nats import PASSWORD_KEY, ROUTE_PASSWORD_KEY, ROUTE_USER_KEY, USER_KEY, render_nats
from .overlay import merge
from .podsecurity import container_security_context, pod_security_context
from .spec import EnvVar, PersiaJobSpec, RoleSpec

CONFIG_VOLUME = "persia-config"
CHECKPOINT_VOLUME = "persia-checkpoints"
TMP_VOLUME = "tmp"
SHM_VOLUME = "dshm"
SECRETS_DIR = "/var/run/persia"
NATS_CREDS_DIR = f"{SECRETS_DIR}/nats-creds"
NATS_TLS_DIR = f"{SECRETS_DIR}/nats-tls"
GRPC_TLS_DIR = f"{SECRETS_DIR}/grpc-tls"
NATS_USER = "persia"
NATS_ROUTE_USER = "persia-route"
SERVER_PRESTOP_SECONDS = 2  # let Service endpoints drop the pod before SIGTERM
CHECKPOINT_ROLES = (C.ROLE_PS, C.ROLE_EMBEDDING_WORKER, C.ROLE_NN_WORKER)

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


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def security_env(job: PersiaJob) -> list[dict[str, Any]]:
    """NATS credentials, TLS file paths and the per-job control secret (CONTRACTS.md)."""
    spec = job.spec
    generated = naming.auth_secret_name(job.name)
    env: list[dict[str, Any]] = [_secret_env("PERSIA_JOB_SECRET", generated, "job-secret")]
    auth = spec.nats.auth
    if spec.nats_managed():
        env += [_secret_env("PERSIA_NATS_USER", generated, USER_KEY),
                _secret_env("PERSIA_NATS_PASSWORD", generated, PASSWORD_KEY)]  # fmt: skip
    elif auth is not None and auth.type == "userPassword":
        env += [_secret_env("PERSIA_NATS_USER", auth.secret_name, "user"),
                _secret_env("PERSIA_NATS_PASSWORD", auth.secret_name, "password")]  # fmt: skip
    elif auth is not None and auth.type == "token":
        env.append(_secret_env("PERSIA_NATS_TOKEN", auth.secret_name, "token"))
    elif auth is not None:
        env.append(_env("PERSIA_NATS_CREDS", f"{NATS_CREDS_DIR}/creds"))
    for prefix, ref, directory in (("PERSIA_NATS_TLS", spec.nats.tls, NATS_TLS_DIR),
                                   ("PERSIA_GRPC_TLS", spec.grpc_tls, GRPC_TLS_DIR)):  # fmt: skip
        if ref is not None:
            env += [_env(f"{prefix}_CA", f"{directory}/ca.crt"), _env(f"{prefix}_CERT", f"{directory}/tls.crt"),
                    _env(f"{prefix}_KEY", f"{directory}/tls.key")]  # fmt: skip
    return env


def secret_volumes(spec: PersiaJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the Secrets a PERSIA pod reads as files (read-only, 0400)."""
    volumes, mounts = [], []
    refs = []
    if spec.nats.auth is not None and spec.nats.auth.type == "creds":
        refs.append(("nats-creds", spec.nats.auth.secret_name, NATS_CREDS_DIR))
    if spec.nats.tls is not None:
        refs.append(("nats-tls", spec.nats.tls.secret_name, NATS_TLS_DIR))
    if spec.grpc_tls is not None:
        refs.append(("grpc-tls", spec.grpc_tls.secret_name, GRPC_TLS_DIR))
    for name, secret, path in refs:
        # readable by every uid: with `securityContext: none` there is no fsGroup, the files are
        # root's, and the images' user could not read a 0440 key (TLS material, creds)
        volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": 0o444}})
        mounts.append({"name": name, "mountPath": path, "readOnly": True})
    return volumes, mounts


def run_id(job: PersiaJob) -> str:
    """What ties every attempt of this PersiaJob together, and not a later job of the same name:
    its uid. A restart resumes from the checkpoints its run wrote, whatever ``checkpoint.resume``
    says (``never`` and a path say where the job starts)."""
    meta = job.metadata
    return meta.uid or f"{meta.namespace}/{meta.name}@{meta.creation_timestamp or ''}"


def checkpoint_env(job: PersiaJob) -> list[dict[str, Any]]:
    ckpt = job.spec.checkpoint
    if ckpt is None:
        return []
    env = [_env("PERSIA_CHECKPOINT_DIR", ckpt.directory(job.name)), _env("PERSIA_CHECKPOINT_KEEP", ckpt.keep),
           _env("PERSIA_RESUME", ckpt.resume), _env("PERSIA_RUN_ID", run_id(job))]  # fmt: skip
    if ckpt.interval_steps is not None:
        env.append(_env("PERSIA_CHECKPOINT_INTERVAL_STEPS", ckpt.interval_steps))
    if ckpt.interval_seconds is not None:
        env.append(_env("PERSIA_CHECKPOINT_INTERVAL_SECONDS", ckpt.interval_seconds))
    return env


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
        _env("PERSIA_JOB_NAMESPACE", job.namespace),  # subjects are persia.<namespace>_<job>...
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
        # a CPU of its own for each rank's training thread when the pod's CPUs are its own (the
        # static CPU manager); elsewhere the runtime places nothing and says why (cpu_placement.py)
        env.append(_env("PERSIA_TRAINING_CPUS", "auto"))
    if role == C.ROLE_DATALOADER:
        env.append(_env("PERSIA_DATALOADER_ENTRY", spec.persia_env.PERSIA_DATALOADER_ENTRY or ""))
    env.append(_env("PERSIA_METRICS_PORT", C.METRICS_PORT))
    env.append(_field_env("PERSIA_BIND_ADDRESS", "status.podIP"))
    env.append(_env("PERSIA_GRACE_PERIOD_SECONDS", spec.run_policy.grace_period_seconds))
    if role in CHECKPOINT_ROLES:
        env += checkpoint_env(job)
    env += security_env(job)
    if spec.grpc_tls is not None and role in STATEFUL_ROLES:
        # Clients verify the server's certificate against the advertised address: the
        # pod's DNS name under its headless Service, which *.<service>.<ns>.svc covers.
        env.append(_field_env("POD_NAME", "metadata.name"))
        env.append(_env("PERSIA_ADVERTISE_HOST",
                        f"$(POD_NAME).{naming.workload_name(job.name, role)}.{job.namespace}.svc"))  # fmt: skip
    if spec.security_context == "restricted":
        env.append(_env("HOME", "/tmp"))  # a writable home on a read-only root filesystem
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


WAIT_FOR_NATS = """\
import os, socket, sys, time, urllib.parse
urls = [u if "://" in u else "nats://" + u for u in os.environ["PERSIA_NATS_URL"].split(",")]
while True:
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        try:
            socket.create_connection((parts.hostname, parts.port or 4222), 2).close()
            sys.exit(0)
        except OSError as err:
            print(f"waiting for NATS at {parts.hostname}:{parts.port or 4222}: {err}", flush=True)
    time.sleep(2)
"""


def _ps_spread(job: PersiaJob) -> list[dict[str, Any]]:
    """Soft: spread PS replicas over nodes (one node lost costs one shard, not all)."""
    return [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": {**naming.selector_labels(job.name, C.ROLE_PS),
                                               C.LABEL_ATTEMPT: str(job.status.attempt)}}}]  # fmt: skip


def _pod_template(job: PersiaJob, role: str, role_spec: RoleSpec, kind: str) -> dict[str, Any]:
    spec = job.spec
    restricted = spec.security_context == "restricted"
    labels = {
        **naming.common_labels(job.name, role),
        C.LABEL_ATTEMPT: str(job.status.attempt),
        **gang_labels(job),
    }
    ports = [{"name": "metrics", "containerPort": C.METRICS_PORT}]
    if role in C.SERVICE_PORTS:
        ports.insert(0, {"name": "rpc", "containerPort": C.SERVICE_PORTS[role]})
    image = default_image(spec, role, role_spec)
    container: dict[str, Any] = {
        "name": C.LAUNCHER_COMMANDS[role],
        "image": image,
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
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": SERVER_PRESTOP_SECONDS}}}
    mounts = [dict(m) for m in role_spec.volume_mounts]
    volumes = [dict(v) for v in spec.volumes]
    if spec.configs is not None:
        mounts.append({"name": CONFIG_VOLUME, "mountPath": C.CONFIG_MOUNT_PATH, "readOnly": True})
        volumes.append(
            {"name": CONFIG_VOLUME, "configMap": {"name": naming.config_map_name(job.name)}}
        )
    ckpt = spec.checkpoint
    if ckpt is not None and role in CHECKPOINT_ROLES:
        if ckpt.persistent_volume_claim:
            volumes.append({"name": CHECKPOINT_VOLUME,
                            "persistentVolumeClaim": {"claimName": ckpt.persistent_volume_claim}})  # fmt: skip
        source = ckpt.volume or CHECKPOINT_VOLUME
        if not any(m["mountPath"] == ckpt.mount_path for m in mounts):
            mounts.append({"name": source, "mountPath": ckpt.mount_path})
    extra_volumes, extra_mounts = secret_volumes(spec)
    volumes += extra_volumes
    mounts += extra_mounts
    if restricted:
        volumes.append({"name": TMP_VOLUME, "emptyDir": {}})
        mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
        container["securityContext"] = container_security_context(read_only=role in STATEFUL_ROLES)
    if role == C.ROLE_NN_WORKER:
        shm: dict[str, Any] = {"medium": "Memory"}
        if spec.nn_worker.shm_size:
            shm["sizeLimit"] = spec.nn_worker.shm_size
        volumes.append({"name": SHM_VOLUME, "emptyDir": shm})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if mounts:
        container["volumeMounts"] = mounts
    wait: dict[str, Any] = {
        "name": "wait-for-nats",
        "image": image,
        "command": ["python", "-c", WAIT_FOR_NATS],
        "env": [dict(e) for e in container["env"] if e["name"] == "PERSIA_NATS_URL"],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
    }
    if spec.image_pull_policy:
        wait["imagePullPolicy"] = spec.image_pull_policy
    if restricted:
        wait["securityContext"] = container_security_context(read_only=True)
    pod_spec: dict[str, Any] = {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.run_policy.grace_period_seconds + 5,
        "initContainers": [wait],
        "containers": [container],
    }
    if restricted:
        pod_spec["securityContext"] = pod_security_context()
    if volumes:
        pod_spec["volumes"] = volumes
    if role == C.ROLE_PS:
        pod_spec["topologySpreadConstraints"] = _ps_spread(job)
    if kind == "Job":
        pod_spec["subdomain"] = naming.workload_name(job.name, role)
    scheduler = spec.run_policy.scheduler_name or gang_scheduler(spec)
    if scheduler:
        pod_spec["schedulerName"] = scheduler
    if spec.run_policy.priority_class_name:
        pod_spec["priorityClassName"] = spec.run_policy.priority_class_name
    annotations = {**gang_annotations(job)}
    if spec.enable_metrics:
        annotations.update({
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(C.METRICS_PORT),
            "prometheus.io/path": "/metrics",
        })  # fmt: skip
    template: dict[str, Any] = {"metadata": {"labels": labels}, "spec": pod_spec}
    if annotations:
        template["metadata"]["annotations"] = annotations
    if role_spec.template is not None:
        template = merge(template, role_spec.template.model_dump(by_alias=True, exclude_none=True))
        template["metadata"]["labels"].update(labels)
    template["spec"]["restartPolicy"] = spec.restart_policy if kind == "Job" else "Always"
    return template


# --- gang scheduling (PodGroup) and Kueue -----------------------------------------------


def total_pods(spec: PersiaJobSpec) -> int:
    """Every pod of the job (training roles and the managed NATS): a gang's minMember."""
    count = sum(r.replicas for r in spec.roles().values())
    return count + (spec.nats.replicas if spec.nats_managed() else 0)


def gang_scheduler(spec: PersiaJobSpec) -> str | None:
    return {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}.get(spec.scheduling.gang)


def gang_labels(job: PersiaJob) -> dict[str, str]:
    """Pod labels joining the job's gang (a coscheduling PodGroup)."""
    if job.spec.scheduling.gang == "coscheduling":
        return {"scheduling.x-k8s.io/pod-group": naming.pod_group_name(job.name)}
    return {}


def gang_annotations(job: PersiaJob) -> dict[str, str]:
    if job.spec.scheduling.gang == "volcano":
        return {"scheduling.k8s.io/group-name": naming.pod_group_name(job.name)}
    return {}


def render_pod_group(job: PersiaJob) -> list[dict[str, Any]]:
    sched = job.spec.scheduling
    if sched.gang == "none":
        return []
    meta = _meta(job, naming.pod_group_name(job.name), "gang", attempt=False)
    if sched.gang == "volcano":
        spec: dict[str, Any] = {"minMember": total_pods(job.spec)}
        if sched.queue:
            spec["queue"] = sched.queue
        if job.spec.run_policy.priority_class_name:
            spec["priorityClassName"] = job.spec.run_policy.priority_class_name
        return [{"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup", "metadata": meta, "spec": spec}]
    spec = {"minMember": total_pods(job.spec)}
    if sched.schedule_timeout_seconds:
        spec["scheduleTimeoutSeconds"] = sched.schedule_timeout_seconds
    return [{"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": meta, "spec": spec}]


def render_pdbs(job: PersiaJob) -> list[dict[str, Any]]:
    """No voluntary disruption of a PS (its shard would be lost: the whole job restarts);
    a NATS cluster of 3 or more may lose one server at a time. Unhealthy pods may always
    be evicted, so a crash-looping pod never blocks a node drain."""
    pdbs = [(naming.workload_name(job.name, C.ROLE_PS), C.ROLE_PS, 0)]
    if job.spec.nats_managed():
        pdbs.append((naming.nats_name(job.name), C.ROLE_NATS, 1 if job.spec.nats.replicas >= 3 else 0))
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(job, name, role, attempt=False),
            "spec": {
                "maxUnavailable": max_unavailable,
                "selector": {"matchLabels": naming.selector_labels(job.name, role)},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
        for name, role, max_unavailable in pdbs
    ]


def render_auth_secret(job: PersiaJob, nats_password: str, job_secret: str, route_password: str) -> dict[str, Any]:
    """The generated per-job Secret; only the job's pods reference it. A managed NATS gets
    client credentials and, apart from them, route credentials that only its own servers
    use to join each other (a PERSIA pod never sees them)."""
    data = {"job-secret": job_secret}
    if job.spec.nats_managed():
        data.update({USER_KEY: NATS_USER, PASSWORD_KEY: nats_password,
                     ROUTE_USER_KEY: NATS_ROUTE_USER, ROUTE_PASSWORD_KEY: route_password})  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(job, naming.auth_secret_name(job.name), "auth", attempt=False),
        "stringData": data,
    }


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
    """All children of `job` for its current attempt (job.status.attempt), except the
    generated Secret (its content is random: see render_auth_secret and plan.py)."""
    children = render_config_map(job)
    if job.spec.nats_managed():
        extras = {"labels": gang_labels(job), "annotations": gang_annotations(job),
                  "schedulerName": job.spec.run_policy.scheduler_name or gang_scheduler(job.spec),
                  "restricted": job.spec.security_context == "restricted"}  # fmt: skip
        children += render_nats(job.name, job.namespace, job.spec.nats, owner_references(job), extras)
    children += render_pdbs(job)
    children += render_pod_group(job)
    for role in C.TRAINING_ROLES:
        children += render_role(job, role)
    from .serving import render_serving  # late: serving builds on this module's helpers

    return children + render_serving(job)
