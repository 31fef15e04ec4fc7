"""Leader election on a coordination.k8s.io Lease: several operator replicas, one active.

kopf has no leader election of its own (its peering pauses operators but needs its own
CRDs and a cluster-wide peering object); a Lease is what Kubernetes' controllers use.
A replica that does not hold the lease waits (standby) and serves its liveness endpoint;
the holder renews every `renew_period`; a holder that cannot renew within
`renew_deadline` (2/3 of the lease) stops its operator and exits, before any other
replica can see the lease expired, so two replicas are never active at once (given
clocks that agree to within the remaining third). On a clean shutdown the holder releases the lease and a standby takes
over within `retry_period`; when the holder dies, within `lease_duration + retry_period`.

`decide` is the pure decision; `LeaderElector` the I/O around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from .kube import ApiError, KubeApi

log = logging.getLogger(__name__)
MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"

Decision = Literal["create", "renew", "take", "wait"]


def _parse(value: str | None) -> datetime | None:
    if not value:
        return None
    for fmt in (MICROTIME, "%Y-%m-%dT%H:%M:%SZ"):
        with contextlib.suppress(ValueError):
            return datetime.strptime(value, fmt).replace(tzinfo=UTC)
    return None


def decide(lease: dict[str, Any] | None, me: str, now: datetime) -> Decision:
    """What `me` does about the lease: create it, renew it (ours), take it (free or
    expired) or wait (someone else holds it)."""
    if lease is None:
        return "create"
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if holder == me:
        return "renew"
    renewed = _parse(spec.get("renewTime"))
    duration = spec.get("leaseDurationSeconds") or 0
    if not holder or renewed is None or now > renewed + timedelta(seconds=duration):
        return "take"
    return "wait"


@dataclass
class LeaderElector:
    api: KubeApi
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_period: float = 5.0
    retry_period: float = 2.0
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)

    def _lease(self, now: datetime, transitions: int, acquire: str | None, rv: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if rv:
            meta["resourceVersion"] = rv  # optimistic concurrency: a stale writer gets 409
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.lease_duration),
                "acquireTime": acquire or now.strftime(MICROTIME),
                "renewTime": now.strftime(MICROTIME),
                "leaseTransitions": transitions,
            },
        }

    async def try_acquire(self) -> bool:
        """One attempt to hold (or keep) the lease."""
        now = self.clock()
        lease = await self.api.get("Lease", self.namespace, self.name)
        action = decide(lease, self.identity, now)
        if action == "wait":
            return False
        try:
            if action == "create":
                await self.api.create(self._lease(now, 0, None, None))
            else:
                spec = (lease or {}).get("spec") or {}
                transitions = int(spec.get("leaseTransitions") or 0) + (action == "take")
                acquire = spec.get("acquireTime") if action == "renew" else None
                body = self._lease(now, transitions, acquire, (lease or {}).get("metadata", {}).get("resourceVersion"))
                await self.api.merge_patch("Lease", self.namespace, self.name, {"metadata": body["metadata"],
                                                                                 "spec": body["spec"]})  # fmt: skip
        except ApiError as err:
            if err.code in (409, 422):
                return False  # someone else won the race
            raise
        if action != "renew":
            log.info(f"{self.identity} became the leader (lease {self.namespace}/{self.name})")
        return True

    async def acquire(self) -> None:
        """Wait (standby) until this replica holds the lease."""
        while True:
            try:
                if await self.try_acquire():
                    return
            except ApiError as err:
                log.warning(f"leader election: {err}")
            await asyncio.sleep(self.retry_period)

    @property
    def renew_deadline(self) -> float:
        """Step down this long after the last renewal (as client-go: 10 s of a 15 s
        lease), so the old leader has stopped before anyone may see the lease expired."""
        return self.lease_duration * 2 / 3

    async def hold(self) -> None:
        """Renew until renewing fails for `renew_deadline`; then return (lost)."""
        last = self.clock()
        while True:
            await asyncio.sleep(self.renew_period)
            attempt = self.clock()  # the renewTime a successful renewal writes
            try:
                if await self.try_acquire():
                    last = attempt
                    continue
                log.error(f"{self.identity} lost the lease to another replica")
                return
            except ApiError as err:
                log.warning(f"leader election: cannot renew the lease: {err}")
            if (self.clock() - last).total_seconds() + self.renew_period >= self.renew_deadline:
                log.error(f"{self.identity} could not renew the lease for {self.renew_deadline:.0f}s: stepping down")
                return

    async def release(self) -> None:
        """Give the lease up (clean shutdown): a standby takes over at its next retry."""
        with contextlib.suppress(ApiError):
            lease = await self.api.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                await self.api.merge_patch("Lease", self.namespace, self.name,
                                           {"spec": {"holderIdentity": None, "renewTime": None}})  # fmt: skip


async def run_as_leader(elector: LeaderElector, operator: Callable[[], Any], standby: Callable[[], Any] | None = None) -> int:
    """Standby until leader, then run `operator()` (a coroutine function) while holding
    the lease. Returns 1 when the lease was lost (the process should exit and restart)."""
    standby_task = asyncio.get_running_loop().create_task(standby()) if standby else None
    try:
        await elector.acquire()
    finally:
        if standby_task is not None:
            standby_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await standby_task
    work = asyncio.get_running_loop().create_task(operator())
    holding = asyncio.get_running_loop().create_task(elector.hold())
    try:
        done, _ = await asyncio.wait({work, holding}, return_when=asyncio.FIRST_COMPLETED)
        return 1 if holding in done else 0
    finally:
        for task in (work, holding):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await elector.release()
