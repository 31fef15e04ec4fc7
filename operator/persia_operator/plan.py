"""`plan_actions`: the API calls that move the children towards the derived status.

Level-based and idempotent: the same inputs give the same calls, and a call that
already happened (409 on create, 404 on delete) is harmless.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from . import constants as C
from .children import Children, data_hash
from .conditions import parse_time
from .job import JobStatus, PersiaJob
from . import naming
from .render import render, render_auth_secret
from .serving import SERVING_ROLES
from .spec import JobMeta, SpecError, parse_spec


@dataclass(frozen=True)
class Create:
    manifest: dict[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return self.manifest["kind"], self.manifest["metadata"]["name"]


@dataclass(frozen=True)
class Patch:
    kind: str
    name: str
    patch: dict[str, Any]
    api_version: str | None = None  # a PodGroup's: two gang schedulers share the kind


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str
    why: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the PersiaJob itself (ttlSecondsAfterFinished); owner references take the rest."""

    why: str


Action = Create | Patch | Delete | DeleteJob


def _stale_config(job: str, manifests: list[dict[str, Any]], children: Children, attempt: str) -> Patch | None:
    """The job's config ConfigMap rewritten, when its content is not what the spec renders and no
    training workload of the current attempt exists (resumed after "suspend, edit, resume", or
    between attempts): it was only ever created, so resumed pods read the configs the job was
    first submitted with. Never while the attempt runs: a pod restarted then would read other
    configs than its peers. (The NATS ConfigMap: ``_stale_nats_config``.)"""
    if any(w.role in C.TRAINING_ROLES and w.attempt == attempt and not w.deleting
           for w in children.workloads.values()):  # fmt: skip
        return None
    return _rewritten(naming.config_map_name(job), manifests, children,
                      keys=(C.GLOBAL_CONFIG_FILE, C.EMBEDDING_CONFIG_FILE))


def _rewritten(name: str, manifests: list[dict[str, Any]], children: Children,
               keys: tuple[str, ...] | None = None) -> Patch | None:
    """A patch of ConfigMap ``name`` to the rendered content (its ``keys``, or all of it) when what
    is there differs; None when it is the same or not there yet (created as it renders)."""
    for m in manifests:
        if m["kind"] == "ConfigMap" and m["metadata"]["name"] == name:
            have = children.data_hashes.get(name)
            if have is not None and have != data_hash(m["data"]):
                return Patch("ConfigMap", name, {"data": m["data"] if keys is None else
                                                 {k: m["data"].get(k) for k in keys}})
    return None


def _stale_nats_config(job: str, manifests: list[dict[str, Any]], children: Children) -> Patch | None:
    """The managed NATS's ConfigMap rewritten, when its content is not what the spec renders and
    the NATS StatefulSet is not there (suspending deletes it; "suspend, edit, resume" applies every
    change): it was only ever created, so `nats.replicas` 1 -> 3 resumed three servers without a
    `cluster` block (no routes), and a new `maxPayload` never reached the servers. Never while
    the NATS runs: a server restarted then would run another configuration than its peers."""
    if children.workload("StatefulSet", naming.nats_name(job)) is not None:
        return None  # running, or being deleted (then rewritten once it is gone)
    return _rewritten(naming.nats_config_name(job), manifests, children)


def _pod_group_resize(manifest: dict[str, Any], children: Children) -> Patch | None:
    """The job's PodGroup set to the job's size after a replica change: it was only ever
    created, so a job scaled down kept a minMember larger than its pods (the gang never
    scheduled again) and one scaled up could start partly placed. Rendered before the
    workloads, it is patched before the new attempt's pods are created."""
    name = manifest["metadata"]["name"]
    have, want = children.pod_group_sizes.get(name), manifest["spec"]["minMember"]
    if have is None or have == want:
        return None
    return Patch("PodGroup", name, {"spec": {"minMember": want}}, api_version=manifest["apiVersion"])


def _cleanup(policy: str, children: Children) -> list[Action]:
    """Workloads to delete once the job is finished, per runPolicy.cleanPodPolicy."""
    if policy == "None":
        return []
    actions: list[Action] = []
    for (kind, name), w in sorted(children.workloads.items()):
        if w.deleting or w.role in SERVING_ROLES:  # serving outlives the training that fed it
            continue
        finished = kind == "Job" and (w.complete or w.job_failed)
        if policy == "All" or not finished:
            actions.append(Delete(kind, name, f"job finished (cleanPodPolicy {policy})"))
    return actions


def ttl_due_at(status: JobStatus) -> datetime | None:
    """When a finished job is deleted (runPolicy.ttlSecondsAfterFinished after its completion)."""
    done = parse_time(status.completion_time)
    if done is None or status.accepted_spec is None:
        return None
    try:
        ttl = parse_spec(status.accepted_spec).run_policy.ttl_seconds_after_finished
    except SpecError:
        return None
    return None if ttl is None else done + timedelta(seconds=ttl)


def new_token() -> str:
    """32 random bytes, URL-safe, starting with a letter: nats-server parses a `$VAR` from the
    environment as a config value, and one starting with '-' or with digits and '-' (about 1
    in 50 plain token_urlsafe values) is read as a number or a date and fails: NATS never
    started."""
    return "p" + secrets.token_urlsafe(32)


def plan_actions(meta: JobMeta, status: JobStatus, children: Children, now: datetime,
                 token: Callable[[], str] = new_token) -> list[Action]:  # fmt: skip
    """`token` makes the random credentials of a generated Secret (fixed in tests)."""
    if status.accepted_spec is None:
        return []  # never valid: nothing was created
    try:
        spec = parse_spec(status.accepted_spec)
    except SpecError:
        return []  # unreadable (an older operator's); the next status pass replaces it
    if status.terminal():
        actions = _cleanup(spec.run_policy.clean_pod_policy, children)
        due = ttl_due_at(status)
        if due is not None and now >= due:
            ttl = spec.run_policy.ttl_seconds_after_finished
            actions.append(DeleteJob(f"finished {ttl}s ago (ttlSecondsAfterFinished)"))
        return actions
    if status.is_true(C.COND_SUSPENDED):
        return [
            Delete(kind, name, "job suspended")
            for (kind, name), w in sorted(children.workloads.items())
            if not w.deleting
        ]

    actions: list[Action] = []
    current = str(status.attempt)
    for (kind, name), w in sorted(children.workloads.items()):
        if w.role in C.TRAINING_ROLES and w.attempt != current and not w.deleting:
            actions.append(Delete(kind, name, f"attempt {w.attempt} replaced by attempt {current}"))
    job = PersiaJob(metadata=meta, spec=spec, status=status)
    manifests = render(job)
    config = _stale_config(meta.name, manifests, children, current)
    if config is not None:
        actions.append(config)
    nats_config = _stale_nats_config(meta.name, manifests, children)
    if nats_config is not None:
        actions.append(nats_config)
    for manifest in manifests:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind in ("StatefulSet", "Job", "Deployment"):
            w = children.workload(kind, name)
            if w is None:
                role = (manifest["metadata"].get("labels") or {}).get(C.LABEL_ROLE)
                if config is not None and role in C.TRAINING_ROLES:
                    continue  # created once the new configs show (a pass later): none reads the old
                if nats_config is not None and role == C.ROLE_NATS:
                    continue  # likewise the NATS and its configuration
                actions.append(Create(manifest))
            elif w.deleting or (w.role in C.TRAINING_ROLES and w.attempt != current):
                continue  # re-created once the old one is gone
            elif kind == "Deployment" and w.replicas != manifest["spec"]["replicas"]:
                actions.append(
                    Patch(kind, name, {"spec": {"replicas": manifest["spec"]["replicas"],
                                                "template": manifest["spec"]["template"]}})
                )  # fmt: skip
        elif (kind, name) not in children.objects:
            actions.append(Create(manifest))
        elif kind == "PodGroup":
            resize = _pod_group_resize(manifest, children)
            if resize is not None:
                actions.append(resize)
    if ("Secret", naming.auth_secret_name(meta.name)) not in children.objects:
        actions.append(Create(render_auth_secret(job, token(), token(), token())))
        # Its NATS started with the credentials that went with it: replaced, it reads the new ones
        # (derive_status restarted the job for the same reason: status.credentials_lost).
        nats = children.workload("StatefulSet", naming.nats_name(meta.name))
        if nats is not None and not nats.deleting and any(
                p.role == C.ROLE_NATS and p.started and not p.deleting for p in children.pods):  # fmt: skip
            actions.append(Delete("StatefulSet", nats.name, "its Secret was deleted: the NATS restarts with new credentials"))
    return actions
