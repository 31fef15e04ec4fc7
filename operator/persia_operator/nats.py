"""The per-job NATS: nats.conf text and its ConfigMap, StatefulSet and Services.

PERSIA relied on the nats-operator (end of life); a small StatefulSet in the pattern of
the official NATS chart replaces it. `max_payload` is raised because PERSIA's batches
are far larger than NATS's 1 MiB default.
"""

from __future__ import annotations

from typing import Any

from . import constants as C
from . import naming
from .overlay import merge
from .podsecurity import container_security_context, pod_security_context
from .spec import NatsSpec

# Resources of a managed NATS server unless nats.resources is set: max_payload is 64 MiB
# and PERSIA's batches pass through it, so it needs more memory than NATS's examples.
DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}

CONFIG_DIR = "/etc/nats-config"
CONFIG_FILE = "nats.conf"
PID_DIR = "/var/run/nats"
# Keys of the generated Secret <job>-auth (render_auth_secret) that the NATS servers read.
USER_KEY, PASSWORD_KEY = "nats-user", "nats-password"
ROUTE_USER_KEY, ROUTE_PASSWORD_KEY = "nats-route-user", "nats-route-password"


def route_env_name(index: int) -> str:
    """Env var holding the URL, credentials included, of the route to server `index`."""
    return f"NATS_ROUTE_{index}"


def route_urls(job: str, namespace: str, replicas: int) -> list[str]:
    """Route URLs as env values: the kubelet fills in the credentials from the env vars
    defined before them, so neither the ConfigMap nor the StatefulSet holds them."""
    sts, headless = naming.nats_name(job), naming.nats_headless_name(job)
    return [
        f"nats-route://$(NATS_ROUTE_USER):$(NATS_ROUTE_PASSWORD)@{sts}-{i}.{headless}.{namespace}.svc:"
        f"{C.NATS_CLUSTER_PORT}"
        for i in range(replicas)
    ]


def nats_conf(job: str, namespace: str, nats: NatsSpec) -> str:
    """nats-server configuration; `$SERVER_NAME` is the pod name (set through env)."""
    lines = [
        f"# rendered by persia-operator for PersiaJob {namespace}/{job}",
        "server_name: $SERVER_NAME",
        f"port: {C.NATS_CLIENT_PORT}",
        f"http_port: {C.NATS_MONITOR_PORT}",
        f"max_payload: {nats.max_payload}",
        f'pid_file: "{PID_DIR}/nats.pid"',
        "lame_duck_grace_period: 10s",
        "lame_duck_duration: 30s",
        # Credentials come from the generated Secret through env (never in this ConfigMap).
        "authorization {",
        "  user: $NATS_USER",
        "  password: $NATS_PASSWORD",
        "}",
    ]
    if nats.replicas > 1:
        # Only the job's own servers join as routes: anything else reaching port 6222 could
        # otherwise read and publish every subject. nats-server expands `$VAR` only as a
        # whole value, so each route URL (with the route credentials) is an env var.
        lines += [
            "cluster {",
            f"  name: {job}",
            f"  port: {C.NATS_CLUSTER_PORT}",
            "  no_advertise: true",
            "  authorization {",
            "    user: $NATS_ROUTE_USER",
            "    password: $NATS_ROUTE_PASSWORD",
            "  }",
            "  routes: [",
            *[f"    ${route_env_name(i)}" for i in range(nats.replicas)],
            "  ]",
            "}",
        ]
    return "\n".join(lines) + "\n"


def nats_env(job: str, namespace: str, nats: NatsSpec) -> list[dict[str, Any]]:
    """Env of a managed NATS server: its name and the credentials, from the generated Secret.

    The route keys are optional so that a job whose Secret predates them (made by an older
    operator, with a ConfigMap that has no route authorization either) still starts its
    NATS; a config that references them fails to parse without them (fails closed)."""
    secret = naming.auth_secret_name(job)

    def from_secret(name: str, key: str, optional: bool = False) -> dict[str, Any]:
        ref: dict[str, Any] = {"name": secret, "key": key}
        if optional:
            ref["optional"] = True
        return {"name": name, "valueFrom": {"secretKeyRef": ref}}

    env = [
        {"name": "SERVER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        from_secret("NATS_USER", USER_KEY),
        from_secret("NATS_PASSWORD", PASSWORD_KEY),
    ]
    if nats.replicas > 1:
        env += [from_secret("NATS_ROUTE_USER", ROUTE_USER_KEY, optional=True),
                from_secret("NATS_ROUTE_PASSWORD", ROUTE_PASSWORD_KEY, optional=True)]  # fmt: skip
        env += [{"name": route_env_name(i), "value": url}
                for i, url in enumerate(route_urls(job, namespace, nats.replicas))]  # fmt: skip
    return env


def render_nats(
    job: str, namespace: str, nats: NatsSpec, owner: list[dict[str, Any]], extras: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """ConfigMap, headless + client Services and the StatefulSet of a managed NATS.

    `extras`: pod labels/annotations/schedulerName of the job's gang, and whether the
    pod gets the restricted security context."""
    extras = extras or {}
    labels = naming.common_labels(job, C.ROLE_NATS)
    selector = naming.selector_labels(job, C.ROLE_NATS)
    sts_name, headless = naming.nats_name(job), naming.nats_headless_name(job)

    def meta(name: str) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
        if owner:
            m["ownerReferences"] = owner
        return m

    ports = [
        {"name": "client", "port": C.NATS_CLIENT_PORT, "targetPort": "client"},
        {"name": "cluster", "port": C.NATS_CLUSTER_PORT, "targetPort": "cluster"},
        {"name": "monitor", "port": C.NATS_MONITOR_PORT, "targetPort": "monitor"},
    ]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(naming.nats_config_name(job)),
        "data": {CONFIG_FILE: nats_conf(job, namespace, nats)},
    }
    headless_svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(headless),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(selector),
            "ports": ports,
        },
    }
    client_svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(sts_name),
        "spec": {
            "selector": dict(selector),
            "ports": [ports[0], ports[2]],
        },
    }
    container: dict[str, Any] = {
        "name": "nats",
        "image": nats.image,
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": nats_env(job, namespace, nats),
        "ports": [
            {"name": "client", "containerPort": C.NATS_CLIENT_PORT},
            {"name": "cluster", "containerPort": C.NATS_CLUSTER_PORT},
            {"name": "monitor", "containerPort": C.NATS_MONITOR_PORT},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "monitor"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "monitor"},
            "initialDelaySeconds": 10,
            "periodSeconds": 30,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["nats-server", f"-sl=ldm={PID_DIR}/nats.pid"]}}},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "pid", "mountPath": PID_DIR},
        ],
    }
    container["resources"] = nats.resources or DEFAULT_RESOURCES
    pod_labels = {**labels, **extras.get("labels", {})}
    template: dict[str, Any] = {
        "metadata": {"labels": pod_labels},
        "spec": {
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 60,
            "containers": [container],
            "volumes": [
                {"name": "config", "configMap": {"name": naming.nats_config_name(job)}},
                {"name": "pid", "emptyDir": {}},
            ],
        },
    }
    if extras.get("annotations"):
        template["metadata"]["annotations"] = dict(extras["annotations"])
    if extras.get("schedulerName"):
        template["spec"]["schedulerName"] = extras["schedulerName"]
    if extras.get("restricted"):
        template["spec"]["securityContext"] = pod_security_context()
        container["securityContext"] = container_security_context(read_only=True)
    if nats.template is not None:
        template = merge(template, nats.template.model_dump(by_alias=True, exclude_none=True))
        template["metadata"]["labels"].update(pod_labels)
    template["spec"]["restartPolicy"] = "Always"
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(sts_name),
        "spec": {
            "replicas": nats.replicas,
            "serviceName": headless,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(selector)},
            "template": template,
        },
    }
    return [config_map, headless_svc, client_svc, statefulset]
