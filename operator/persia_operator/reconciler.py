"""One reconcile pass of one PersiaJob: the thin I/O shell around the pure functions.

read the job (fresh, not kopf's possibly stale body) -> derive_status -> plan_actions ->
call the API -> write status (a merge-patch of what changed) -> post events.
Passes of one job never overlap (a lock per job), so restart counting cannot race.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from . import constants as C
from . import naming, opmetrics, refusals, settled
from .children import WORKLOAD_KINDS, Children, summarize
from .events import JobEvent, transition_events
from .job import JobStatus
from .kube import ApiError, KubeApi
from .plan import Action, Create, Delete, DeleteJob, Patch, plan_actions
from .natsinfo import NatsObservation
from .natswatch import NatsTarget, NatsWatcher, secret_data
from .spec import PersiaJobSpec, SpecError, parse_spec
from .status import ChildError, ObservedJob, derive_status

Logger = logging.Logger | logging.LoggerAdapter  # kopf passes an adapter
_STATUS_KEYS = {field.alias or name for name, field in JobStatus.model_fields.items()}


def utcnow() -> datetime:
    return datetime.now(UTC)


def merge_patch_diff(old: Any, new: Any, owned: set[str] | None = None) -> Any:
    """RFC 7386 merge patch turning `old` into `new` (None removes a key). At the top
    level only keys in `owned` are removed, so fields written by others survive."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new and (owned is None or key in owned):
            patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch_diff(old[key], value) if isinstance(value, dict) else value
    return patch


def event_manifest(body: dict[str, Any], event: JobEvent, now: datetime) -> dict[str, Any]:
    """A core/v1 Event about the job (what `kubectl describe pj` lists)."""
    meta = body["metadata"]
    ts = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": C.API_VERSION, "kind": C.KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},  # fmt: skip
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
        "source": {"component": C.MANAGED_BY},
        "reportingComponent": C.MANAGED_BY,
        "reportingInstance": C.MANAGED_BY,
        "firstTimestamp": ts,
        "lastTimestamp": ts,
        "count": 1,
    }


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        clock: Callable[[], datetime] = utcnow,
        nats: NatsWatcher | None = None,
    ):
        self.api = api
        self.nats = nats or NatsWatcher()
        self.clock = clock
        self.passes = 0
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # per job; also in its status.refusedWrites, read back when none is here
        self._refusals: dict[tuple[str, str], dict[refusals.Key, refusals.Refusal]] = {}
        self._settled: dict[tuple[str, str], settled.Settled] = {}  # finished jobs a pass left as they were
        self.phases = opmetrics.PhaseCounts()

    def periodic_pass_due(self, namespace: str, name: str, version: str | None,
                          summaries: Iterable[dict[str, Any]]) -> bool:  # fmt: skip
        """Whether the periodic loop runs a pass of the job (``version``: its resourceVersion in
        kopf's index): not for a finished job whose last pass changed nothing, until it or its
        children change or its TTL is due (:mod:`settled`)."""
        memo = self._settled.get((namespace, name))
        return settled.pass_due(memo, version, settled.fingerprint(summaries), self.clock())

    async def reconcile(
        self, namespace: str, name: str, summaries: Iterable[dict[str, Any]], logger: Logger
    ) -> JobStatus | None:
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            self._settled.pop((namespace, name), None)  # set again by a pass that changes nothing
            body = await self.api.get(C.KIND, namespace, name)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp") or not managed_here(body):
                if body is None:
                    self._locks.pop((namespace, name), None)
                    self._refusals.pop((namespace, name), None)
                self.nats.forget((namespace, name))
                self.phases.set((namespace, name), None)
                return None
            started = time.monotonic()
            try:
                status = await self._pass(body, list(summaries), logger)
            except BaseException:
                opmetrics.RECONCILES.labels(result="error").inc()
                raise
            finally:
                opmetrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            opmetrics.RECONCILES.labels(result="ok").inc()
            self.phases.set((namespace, name), status.phase)
            self.passes += 1
            return status

    def keep_only(self, jobs: set[tuple[str, str]]) -> None:
        """Forget what is kept per job for every job not in ``jobs`` (the jobs that exist): a
        deleted job leaves kopf's index, so no pass of it reads the 404 that forgets it, and its
        NATS probe went on connecting, with its credentials, every 10 s for ever."""
        for key in (set(self._locks) | self.phases.keys() | self.nats.keys()) - jobs:
            lock = self._locks.get(key)
            if lock is not None and lock.locked():
                continue  # a pass of it runs now: it forgets the job itself if it is gone
            self._locks.pop(key, None)
            self._refusals.pop(key, None)
            self._settled.pop(key, None)
            self.nats.forget(key)
            self.phases.set(key, None)

    async def _pass(self, body: dict[str, Any], summaries: list[dict[str, Any]], logger: Any) -> JobStatus:
        observed = ObservedJob.from_body(body)
        meta = observed.metadata
        indexed = settled.fingerprint(summaries)  # before the ghosts are read: as the loop sees them
        spec = _spec_of(observed)
        extra, secrets = await self._observe_by_get(meta.namespace, meta.name, spec)
        summaries = await self._without_ghosts(meta.namespace, summaries, observed.status.attempt)
        children = Children.from_summaries([*summaries, *extra], owner_uid=meta.uid)
        nats = self._watch_nats(observed, spec, secrets)
        now = self.clock()
        key = (meta.namespace, meta.name)
        # Kept in memory, and on the job for an operator that has none (restarted, a new leader).
        refused = self._refusals[key] if key in self._refusals else refusals.from_status(observed.status.refused_writes)
        reported = _ordered(refusals.held_errors(refused, now))  # still named on the job while held back
        status = derive_status(observed, children, now, reported, nats=nats)
        planned = plan_actions(meta, status, children, now)
        actions, held = refusals.hold(planned, refused, now)  # refused for good, not due again
        child_actions = [a for a in actions if not isinstance(a, DeleteJob)]
        # The decision is saved before it is acted on. Acted on first, a status write that then
        # failed (throttled, timed out, the pass cancelled) left the children changed under the
        # old status, and the next pass undid the decision: a finished job's workloads created
        # again, a failed job restarted, a restart not counted against backoffLimit. Saved
        # first, a failed write changes nothing, and a saved decision whose actions fail is
        # carried out by the next pass (the plan follows the status, and repeats harmlessly).
        written = await self._write_status(body, observed.status, status, logger)
        errors = await self._execute(meta.namespace, meta.uid, child_actions, logger)
        now_refused = refusals.next_refusals(refused, planned, errors, now)
        if now_refused:
            self._refusals[key] = now_refused
        else:
            self._refusals.pop(key, None)
        errors = _ordered([*held, *errors])
        final = derive_status(observed, children, now, errors, nats=nats) if errors != reported else status
        # The refusals go on the job in this second write (only when they changed, once per
        # backoff window): a restarted operator reads them back instead of trying each once more.
        final = final.model_copy(update={"refused_writes": refusals.to_status(now_refused)})
        written = await self._write_status(written, status, final, logger)
        status = final
        await self._post_events(written, refusals.refusal_events(refused, now_refused), logger)
        if status.attempt != observed.status.attempt and status.is_true(C.COND_RESTARTING):
            opmetrics.RESTARTS.labels(reason=status.condition(C.COND_RESTARTING).reason).inc()  # type: ignore[union-attr]
        for action in actions:
            if isinstance(action, DeleteJob):
                logger.info(f"Deleting PersiaJob {meta.namespace}/{meta.name}: {action.why}")
                # this job only: one deleted and applied again meanwhile has another uid (409)
                await self.api.delete(C.KIND, meta.namespace, meta.name, uid=meta.uid)
        memo = settled.settled_after(status, written is not body or bool(planned or errors),
                                     (body.get("metadata") or {}).get("resourceVersion"), indexed)  # fmt: skip
        if memo is not None:
            self._settled[key] = memo
        return status

    async def _without_ghosts(self, namespace: str, summaries: list[dict[str, Any]], attempt: int
                              ) -> list[dict[str, Any]]:  # fmt: skip
        """The summaries less the workloads that are gone although kopf's index still has them.
        kopf forgets an object only on its DELETED event; one deleted while a watch was down
        (an API server restart) stayed in the index for ever, and the pass that waits for an old
        attempt's workload to go before creating the new one waited for ever. So the workloads a
        pass waits on (being deleted, or of an earlier attempt) are read by name: few, and only
        while a job restarts."""
        out = []
        for s in summaries:
            waited_on = s["kind"] in WORKLOAD_KINDS and (
                s.get("deleting") or (s.get("role") in C.TRAINING_ROLES and s.get("attempt") != str(attempt)))
            if waited_on and await self.api.get(s["kind"], namespace, s["name"]) is None:
                continue  # a ghost
            out.append(s)
        return out

    async def _observe_by_get(self, namespace: str, name: str, spec: PersiaJobSpec | None
                              ) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:  # fmt: skip
        """Children that are read, not watched: Secrets (watching them would need list on
        every Secret), PodGroups (their CRDs may not be installed) and the job's two
        PodDisruptionBudgets (auxiliary: a job runs without them). Returns summaries and
        the decoded data of the Secrets the job's NATS needs (its credentials, TLS material,
        and the URL when the pods get PERSIA_NATS_URL from a secretKeyRef)."""
        gets: list[tuple[str, str, str | None]] = [("Secret", naming.auth_secret_name(name), None),
                                                   ("PodDisruptionBudget", naming.workload_name(name, C.ROLE_PS), None)]
        if spec is not None:
            if spec.nats_managed():
                gets.append(("PodDisruptionBudget", naming.nats_name(name), None))
            for ref in (spec.nats.auth, spec.nats.tls):
                if ref is not None:
                    gets.append(("Secret", ref.secret_name, None))
            url_secret = spec.nats_url_secret()
            if url_secret is not None and ("Secret", url_secret[0], None) not in gets:
                gets.append(("Secret", url_secret[0], None))
            from .render import render_pod_group  # the apiVersion of the job's PodGroup
            from .job import PersiaJob

            for pg in render_pod_group(PersiaJob.model_validate({"metadata": {"name": name, "namespace": namespace},
                                                                 "spec": spec})):  # fmt: skip
                gets.append(("PodGroup", pg["metadata"]["name"], pg["apiVersion"]))
        summaries, secrets = [], {}
        for kind, obj_name, api_version in gets:
            body = await self.api.get(kind, namespace, obj_name, api_version=api_version)
            if body is None:
                continue
            owners = [r.get("uid") for r in (body.get("metadata") or {}).get("ownerReferences") or []
                      if r.get("kind") == C.KIND]  # fmt: skip
            summary: dict[str, Any] = {"kind": kind, "name": obj_name, "owner_uid": owners[0] if owners else None}
            if kind == "PodGroup":
                summary["min_member"] = summarize(kind, body).get("min_member")
            summaries.append(summary)
            if kind == "Secret":
                secrets[obj_name] = secret_data(body)
        return summaries, secrets

    def _watch_nats(self, observed: ObservedJob, spec: PersiaJobSpec | None,
                    secrets: dict[str, dict[str, str]]) -> NatsObservation | None:  # fmt: skip
        key = (observed.metadata.namespace, observed.metadata.name)
        st = observed.status
        running = spec is not None and st.terminal() is None and not spec.run_policy.suspend
        target = nats_target(observed.metadata.name, observed.metadata.namespace, spec, secrets) if running else None
        return self.nats.observe(key, target)

    async def close(self) -> None:
        await self.nats.close()
        await self.api.close()

    async def _execute(self, namespace: str, uid: str | None, actions: list[Action], logger: Any) -> list[ChildError]:
        errors: list[ChildError] = []
        for action in actions:
            try:
                if isinstance(action, Create):
                    await self._create(action, uid, logger)
                elif isinstance(action, Patch):
                    logger.info(f"Patching {action.kind}/{action.name}")
                    await self.api.merge_patch(action.kind, namespace, action.name, action.patch,
                                               api_version=action.api_version)  # fmt: skip
                elif isinstance(action, Delete):
                    logger.info(f"Deleting {action.kind}/{action.name}: {action.why}")
                    await self.api.delete(action.kind, namespace, action.name)
            except ApiError as err:
                if isinstance(action, Delete):
                    logger.warning(f"Deleting {action.kind}/{action.name} failed: {err}")
                    continue
                kind, name = action.key if isinstance(action, Create) else (action.kind, action.name)
                logger.warning(f"{type(action).__name__} {kind}/{name} failed: {err}")
                errors.append(ChildError(kind, name, err.code, f"{err.code} {err.reason}: {err.message}",
                                         action="patch" if isinstance(action, Patch) else "create"))
                opmetrics.CHILD_ERRORS.labels(kind=kind, code=str(err.code)).inc()
        return errors

    async def _create(self, action: Create, uid: str | None, logger: Any) -> None:
        kind, name = action.key
        try:
            await self.api.create(action.manifest)
            logger.info(f"Created {kind}/{name}")
        except ApiError as err:
            if err.code != 409:
                raise
            existing = await self.api.get(kind, action.manifest["metadata"]["namespace"], name,
                                          api_version=action.manifest.get("apiVersion"))  # fmt: skip
            owners = [r.get("uid") for r in ((existing or {}).get("metadata") or {}).get("ownerReferences") or []]
            if existing is not None and uid is not None and uid not in owners:
                message = f"{kind} {name} exists and is not owned by this PersiaJob"
                raise ApiError(409, "AlreadyExists", message) from None

    async def _write_status(self, body: dict[str, Any], prev: JobStatus, status: JobStatus,
                            logger: Any) -> dict[str, Any]:
        """Patch the job's status from ``body``'s to ``status`` (raises if the write fails) and
        post the events of the transition from ``prev``; returns ``body`` with the status written."""
        new = status.model_dump(by_alias=True, mode="json", exclude_none=True)
        patch = merge_patch_diff(body.get("status") or {}, new, owned=_STATUS_KEYS)
        if not patch:
            return body
        meta = body["metadata"]
        await self.api.merge_patch(C.KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status")
        await self._post_events(body, transition_events(prev, status), logger)
        return {**body, "status": new}

    async def _post_events(self, body: dict[str, Any], events: Iterable[JobEvent], logger: Any) -> None:
        for event in events:
            try:
                await self.api.create(event_manifest(body, event, self.clock()))
            except ApiError as err:  # events are best effort
                logger.debug(f"Could not post event {event.reason}: {err}")


def managed_here(body: Mapping[str, Any]) -> bool:
    """spec.managedBy unset or this operator's: a job managed by another controller
    (e.g. MultiKueue) is left alone entirely. (``body``: a dict, or kopf's view of one.)"""
    accepted = (body.get("status") or {}).get("acceptedSpec")
    spec = accepted if isinstance(accepted, Mapping) else body.get("spec") or {}
    # A later edit is a rejected change. An empty one is a slip, not another controller's name:
    # this operator's job, refused with InvalidSpec (it was ignored for ever, without a word).
    return spec.get("managedBy") in (None, "", C.MANAGED_BY_VALUE)


def _ordered(errors: Iterable[ChildError]) -> list[ChildError]:
    """One order for the same errors, so that a pass can tell whether they changed."""
    return sorted(errors, key=lambda e: (e.kind, e.name, e.action, e.message))


def _spec_of(observed: ObservedJob) -> PersiaJobSpec | None:
    """The spec that runs (accepted), else the written one if valid."""
    for raw in (observed.status.accepted_spec, observed.spec):
        if raw is None:
            continue
        try:
            return parse_spec(raw)
        except SpecError:
            continue
    return None


def nats_target(job: str, namespace: str, spec: PersiaJobSpec | None,
                secrets: dict[str, dict[str, str]]) -> NatsTarget | None:  # fmt: skip
    """How the operator reaches the job's NATS, with the job's own credentials."""
    if spec is None:
        return None
    url = spec.nats_url(job, namespace)
    url_secret = spec.nats_url_secret()
    if not url and url_secret is not None:  # the pods' PERSIA_NATS_URL is a secretKeyRef
        url = secrets.get(url_secret[0], {}).get(url_secret[1], "")
    if not url:
        return None
    if spec.nats_managed():
        data = secrets.get(naming.auth_secret_name(job))
        if not data:
            return None  # the Secret is being created
        return NatsTarget(naming.subject_job(job, namespace), url, user=data.get("nats-user"), password=data.get("nats-password"))
    fields: dict[str, str | None] = {}
    auth = spec.nats.auth
    if auth is not None:
        data = secrets.get(auth.secret_name, {})
        if auth.type == "userPassword":
            fields.update(user=data.get("user"), password=data.get("password"))
        elif auth.type == "token":
            fields["token"] = data.get("token")
        else:
            fields["creds"] = data.get("creds")
    if spec.nats.tls is not None:
        data = secrets.get(spec.nats.tls.secret_name, {})
        fields.update(tls_ca=data.get("ca.crt"), tls_cert=data.get("tls.crt"), tls_key=data.get("tls.key"))
    return NatsTarget(naming.subject_job(job, namespace), url, **fields)
