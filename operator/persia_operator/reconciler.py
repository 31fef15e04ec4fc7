"""One reconcile pass of one PersiaJob: the thin I/O shell around the pure functions.

read the job (fresh, not kopf's possibly stale body) -> derive_status -> plan_actions ->
call the API -> write status (a merge-patch of what changed) -> post events.
Passes of one job never overlap (a lock per job), so restart counting cannot race.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import kopf

from . import constants as C
from .children import Children
from .events import JobEvent, transition_events
from .job import JobStatus
from .kube import ApiError, KubeApi
from .plan import Action, Create, Delete, DeleteJob, Patch, plan_actions
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


def post_kopf_event(body: dict[str, Any], event: JobEvent) -> None:
    kopf.event(body, type=event.type, reason=event.reason, message=event.message)


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        clock: Callable[[], datetime] = utcnow,
        post_event: Callable[[dict[str, Any], JobEvent], None] = post_kopf_event,
    ):
        self.api = api
        self.clock = clock
        self.post_event = post_event
        self.passes = 0
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def reconcile(
        self, namespace: str, name: str, summaries: Iterable[dict[str, Any]], logger: Logger
    ) -> JobStatus | None:
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            body = await self.api.get(C.KIND, namespace, name)
            if body is None:
                self._locks.pop((namespace, name), None)
                return None
            if (body.get("metadata") or {}).get("deletionTimestamp"):
                return None
            status = await self._pass(body, list(summaries), logger)
            self.passes += 1
            return status

    async def _pass(self, body: dict[str, Any], summaries: list[dict[str, Any]], logger: Any) -> JobStatus:
        observed = ObservedJob.from_body(body)
        meta = observed.metadata
        children = Children.from_summaries(summaries, owner_uid=meta.uid)
        now = self.clock()
        status = derive_status(observed, children, now)
        actions = plan_actions(meta, status, children, now)
        child_actions = [a for a in actions if not isinstance(a, DeleteJob)]
        errors = await self._execute(meta.namespace, meta.uid, child_actions, logger)
        if errors:
            status = derive_status(observed, children, now, errors)
        await self._write_status(body, observed.status, status, logger)
        for action in actions:
            if isinstance(action, DeleteJob):
                logger.info(f"Deleting PersiaJob {meta.namespace}/{meta.name}: {action.why}")
                await self.api.delete(C.KIND, meta.namespace, meta.name)
        return status

    async def _execute(self, namespace: str, uid: str | None, actions: list[Action], logger: Any) -> list[ChildError]:
        errors: list[ChildError] = []
        for action in actions:
            try:
                if isinstance(action, Create):
                    await self._create(action, uid, logger)
                elif isinstance(action, Patch):
                    logger.info(f"Patching {action.kind}/{action.name}")
                    await self.api.merge_patch(action.kind, namespace, action.name, action.patch)
                elif isinstance(action, Delete):
                    logger.info(f"Deleting {action.kind}/{action.name}: {action.why}")
                    await self.api.delete(action.kind, namespace, action.name)
            except ApiError as err:
                if isinstance(action, Delete):
                    logger.warning(f"Deleting {action.kind}/{action.name} failed: {err}")
                    continue
                kind, name = action.key if isinstance(action, Create) else (action.kind, action.name)
                logger.warning(f"{type(action).__name__} {kind}/{name} failed: {err}")
                errors.append(ChildError(kind, name, err.code, f"{err.code} {err.reason}: {err.message}"))
        return errors

    async def _create(self, action: Create, uid: str | None, logger: Any) -> None:
        kind, name = action.key
        try:
            await self.api.create(action.manifest)
            logger.info(f"Created {kind}/{name}")
        except ApiError as err:
            if err.code != 409:
                raise
            existing = await self.api.get(kind, action.manifest["metadata"]["namespace"], name)
            owners = [r.get("uid") for r in ((existing or {}).get("metadata") or {}).get("ownerReferences") or []]
            if existing is not None and uid is not None and uid not in owners:
                message = f"{kind} {name} exists and is not owned by this PersiaJob"
                raise ApiError(409, "AlreadyExists", message) from None

    async def _write_status(self, body: dict[str, Any], prev: JobStatus, status: JobStatus, logger: Any) -> None:
        new = status.model_dump(by_alias=True, mode="json", exclude_none=True)
        patch = merge_patch_diff(body.get("status") or {}, new, owned=_STATUS_KEYS)
        if not patch:
            return
        meta = body["metadata"]
        await self.api.merge_patch(C.KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status")
        for event in transition_events(prev, status):
            try:
                self.post_event(body, event)
            except Exception as err:  # events are best effort
                logger.debug(f"Could not post event {event}: {err}")
