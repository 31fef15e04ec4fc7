"""Deterministic child names and labels (never generateName: retries must not duplicate)."""

from __future__ import annotations

from . import constants as C


def workload_name(job: str, role: str) -> str:
    """StatefulSet / Job / Deployment of a role; also its headless Service."""
    return f"{job}-{role}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def auth_secret_name(job: str) -> str:
    """Generated per-job Secret: managed-NATS credentials and PERSIA_JOB_SECRET."""
    return f"{job}-auth"


def pod_group_name(job: str) -> str:
    return f"{job}-gang"


def nats_name(job: str) -> str:
    """NATS StatefulSet and client Service."""
    return f"{job}-nats"


def nats_headless_name(job: str) -> str:
    return f"{job}-nats-headless"


def nats_config_name(job: str) -> str:
    return f"{job}-nats-config"


def subject_job(job: str, namespace: str) -> str:
    """The job's token in its NATS subjects, ``persia.<token>.<service>...``: its pods get
    ``PERSIA_JOB_NAMESPACE`` beside ``PERSIA_JOB_NAME``, and the runtime joins them so
    (``persia.bus.subject_job``). A job name is unique only in its namespace: two jobs of one name
    on one external NATS answered each other's discovery and took each other's batches."""
    return f"{namespace}_{job}"


def selector_labels(job: str, role: str) -> dict[str, str]:
    """Immutable selector of a role's pods."""
    return {C.LABEL_JOB: job, C.LABEL_ROLE: role}


def common_labels(job: str, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "persia",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": C.MANAGED_BY,
        **selector_labels(job, role),
    }
