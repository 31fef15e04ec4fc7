"""Leader election on a coordination.k8s.io Lease: several operator replicas, one active.

kopf has no leader election of its own (its peering pauses operators but needs its own
CRDs and a cluster-wide peering object); a Lease is what Kubernetes' controllers use.
A replica that does not hold the lease waits (standby) and serves its liveness endpoint;
the holder renews every `renew_period`; a holder that cannot renew within
`renew_deadline` (2/3 of the lease) stops its operator and exits, before any other
replica can see the lease expired, so two replicas are never active at once (given
clocks that agree to within the remaining third). Each renewal call is bounded by the
time left until that deadline (an API call may otherwise hang for the client's
request timeout, 60 s, far past the lease), and a failed one is retried every
`retry_period` until then. On a clean shutdown the holder releases the lease and a
standby takes over within `retry_period`; when the holder dies, within
`lease_duration + retry_period`.

`decide` and `next_renewal` are the pure decisions; `LeaderElector` the I/O around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from .config import RENEW_DEADLINE_FRACTION
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


@dataclass(frozen=True)
class RenewalStep:
    """The holder's next renewal: sleep `wait` seconds, then make a call that may take
    at most `timeout` seconds (the time then left until the step-down deadline)."""

    wait: float
    timeout: float


def next_renewal(since_renewed: float, due: float, renew_deadline: float) -> RenewalStep | None:
    """When the holder renews next and how long that call may take, or None: step down
    now. `since_renewed`: seconds since the last successful renewal (the renewTime it
    wrote); `due`: when (on that scale) the next call is due. A call that could not
    finish before `renew_deadline` is never made: the holder would act past its lease."""
    start = max(since_renewed, due)
    timeout = renew_deadline - start
    if timeout <= 0:
        return None
    return RenewalStep(wait=start - since_renewed, timeout=timeout)


def renewal_due(renew_period: float, renew_deadline: float) -> float:
    """When a renewal is due after a success: `renew_period`, but no later than half-way
    to the deadline, so that the call and its retries have time (renew_period may be as
    long as the deadline itself, which would leave none)."""
    return min(renew_period, renew_deadline / 2)


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
    renewed: datetime | None = field(default=None, init=False)  # the renewTime last written

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
                "leaseDurationSeconds": math.ceil(self.lease_duration),  # never shorter than ours
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
        self.renewed = now
        if action != "renew":
            log.info(f"{self.identity} became the leader (lease {self.namespace}/{self.name})")
        return True

    async def acquire(self) -> None:
        """Wait (standby) until this replica holds the lease. A try is bounded by the
        step-down deadline: a lease won by a call that answered later is already stale."""
        while True:
            try:
                if await asyncio.wait_for(self.try_acquire(), self.renew_deadline):
                    return
            except ApiError as err:
                log.warning(f"leader election: {err}")
            except TimeoutError:
                log.warning(f"leader election: no answer within {self.renew_deadline:g}s")
            await asyncio.sleep(self.retry_period)

    @property
    def renew_deadline(self) -> float:
        """Step down this long after the last renewal (as client-go: 10 s of a 15 s
        lease), so the old leader has stopped before anyone may see the lease expired."""
        return self.lease_duration * RENEW_DEADLINE_FRACTION

    async def hold(self) -> None:
        """Renew until the lease is lost or no renewal succeeded for `renew_deadline`;
        then return (the caller stops the operator)."""
        last = self.renewed or self.clock()
        due = renewal_due(self.renew_period, self.renew_deadline)
        while True:
            step = next_renewal((self.clock() - last).total_seconds(), due, self.renew_deadline)
            if step is None:
                log.error(f"{self.identity} could not renew the lease for {self.renew_deadline:g}s: stepping down")
                return
            if step.wait > 0:
                await asyncio.sleep(step.wait)
                continue  # re-plan: the sleep may have overrun
            try:
                renewed = await asyncio.wait_for(self.try_acquire(), step.timeout)
            except (ApiError, TimeoutError) as err:
                reason = f"no answer within {step.timeout:.1f}s" if isinstance(err, TimeoutError) else str(err)
                log.warning(f"leader election: cannot renew the lease: {reason}")
                due = (self.clock() - last).total_seconds() + self.retry_period
                continue
            if not renewed:
                log.error(f"{self.identity} lost the lease to another replica")
                return
            last = self.renewed or last
            due = renewal_due(self.renew_period, self.renew_deadline)

    async def release(self) -> None:
        """Give the lease up (clean shutdown): a standby takes over at its next retry.
        Bounded by the lease: a holder that stepped down because the API hangs should
        exit, not wait the request timeout, and by then the lease has expired anyway."""
        with contextlib.suppress(ApiError, TimeoutError):
            await asyncio.wait_for(self._release(), self.lease_duration)

    async def _release(self) -> None:
        lease = await self.api.get("Lease", self.namespace, self.name)
        if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
            rv = (lease.get("metadata") or {}).get("resourceVersion")  # never clear a new holder's lease
            await self.api.merge_patch("Lease", self.namespace, self.name,
                                       {"metadata": {"resourceVersion": rv} if rv else {},
                                        "spec": {"holderIdentity": None, "renewTime": None}})  # fmt: skip


async def _logging_errors(what: str, coro_fn: Callable[[], Any]) -> None:
    """Run `coro_fn()`; log an error it ends with when it happens (a standby's liveness
    server may fail long before the standby is cancelled, and nothing awaits it)."""
    try:
        await coro_fn()
    except Exception as err:
        log.error(f"{what} failed: {err!r}", exc_info=err)


def task_error(task: asyncio.Task[Any]) -> BaseException | None:
    """The exception a finished task ended with (None: still running, returned, or cancelled)."""
    if not task.done() or task.cancelled():
        return None
    return task.exception()


def exit_status(lost_lease: bool, work_error: BaseException | None, hold_error: BaseException | None) -> int:
    """1 (restart the process) when the lease was lost or the operator or the renewal
    loop crashed; 0 only when the operator returned by itself (a clean shutdown)."""
    return 1 if lost_lease or work_error is not None or hold_error is not None else 0


async def run_as_leader(elector: LeaderElector, operator: Callable[[], Any], standby: Callable[[], Any] | None = None) -> int:
    """Standby until leader, then run `operator()` (a coroutine function) while holding
    the lease. Returns 1 when the lease was lost or the operator crashed (the process
    should exit non-zero and be restarted), 0 when the operator stopped cleanly."""
    loop = asyncio.get_running_loop()
    standby_task = loop.create_task(_logging_errors("standby liveness server", standby)) if standby else None
    try:
        await elector.acquire()
    finally:
        if standby_task is not None:
            standby_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # its own errors are logged
                await standby_task
    work = loop.create_task(operator())
    holding = loop.create_task(elector.hold())
    tasks = {work: "the operator", holding: "leader election (renewing the lease)"}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return exit_status(holding in done, task_error(work), task_error(holding))
    finally:
        for task, what in tasks.items():
            task.cancel()  # no-op when done
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as err:  # how it ended (see the return above), or raised while stopping
                log.error(f"{what} stopped with an error: {err!r}", exc_info=err)
        await elector.release()
