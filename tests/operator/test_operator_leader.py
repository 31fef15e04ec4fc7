"""Leader election: the pure decision tables, two electors against KMock (one active,
failover when the leader dies or steps down, never two active at once), and a holder
against a fake API whose renewals hang or fail (it steps down before its lease ends;
it retries a failed renewal).

What KMock cannot check: it does not enforce resourceVersion preconditions, so two
replicas racing for a free lease in the same instant are not exercised (a real API
server answers the loser 409, which `try_acquire` treats as "not the leader")."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from datetime import UTC, datetime, timedelta

import kopf
import pytest
from operator_testkit import wait_for

from persia_operator.kube import ApiError, KubeApi
from persia_operator.leader import (MICROTIME, LeaderElector, RenewalStep, decide, exit_status, next_renewal,
                                    renewal_due, run_as_leader)  # fmt: skip

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def lease(holder, renewed_ago, duration=15):
    renew = (NOW - timedelta(seconds=renewed_ago)).strftime(MICROTIME) if renewed_ago is not None else None
    return {"spec": {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": duration}}


@pytest.mark.parametrize("current, expected", [
    (None, "create"),
    (lease("me", 3), "renew"),
    (lease("me", 60), "renew"),  # ours, even if late: keep it (the others see it expired and may take it)
    (lease("other", 3), "wait"),
    (lease("other", 16), "take"),  # expired
    (lease(None, None), "take"),  # released
    (lease("other", None), "take"),
])  # fmt: skip
def test_decide(current, expected):
    assert decide(current, "me", NOW) == expected


LEASE_S = 6.0  # step-down deadline 4 s after a renewal: a test process stalled for a second or two
# (a loaded CI machine, a garbage collection) must not make the leader step down mid-test


class Replica:
    """One operator replica: an elector and a stand-in for the kopf operator that
    records when it is active."""

    def __init__(self, server: str, name: str, log: list):
        self.api = KubeApi(login=lambda: kopf.ConnectionInfo(server=server))
        self.elector = LeaderElector(self.api, "persia-system", "persia-operator", name,
                                     lease_duration=LEASE_S, renew_period=1.0, retry_period=0.2)  # fmt: skip
        self.name, self.log = name, log
        self.task: asyncio.Task | None = None

    async def operate(self):
        self.log.append((time.monotonic(), self.name, "start"))
        try:
            await asyncio.Event().wait()
        finally:
            self.log.append((time.monotonic(), self.name, "stop"))

    def start(self):
        self.task = asyncio.get_running_loop().create_task(run_as_leader(self.elector, self.operate))

    def crash_network(self):
        """The API server becomes unreachable for this replica (it cannot renew)."""
        self.api._login = None
        self.api._info = kopf.ConnectionInfo(server="http://127.0.0.1:9")


def active(log):
    state = {}
    for _, name, what in log:
        state[name] = what == "start"
    return {n for n, on in state.items() if on}


async def test_one_active_replica_and_failover(cluster):
    server = str(cluster.k.url).rstrip("/")
    log: list = []
    a, b = Replica(server, "a", log), Replica(server, "b", log)
    a.start()
    await wait_for(lambda: active(log) == {"a"}, what="a active")
    b.start()
    await asyncio.sleep(1.0)  # b would have taken over by now if it could (it retries every 0.2 s)
    assert active(log) == {"a"}
    # The leader loses the API server: it steps down, b takes over after the lease expires.
    lost = time.monotonic()
    a.crash_network()
    await wait_for(lambda: active(log) == {"b"}, what="b active")
    assert await asyncio.wait_for(a.task, 30) == 1  # a's operator stopped: it lost the lease
    took_over = next(t for t, n, w in log if n == "b" and w == "start")
    a_stopped = next(t for t, n, w in log if n == "a" and w == "stop")
    assert a_stopped <= took_over  # never two active
    print(f"failover after a lost leader: {took_over - lost:.2f}s (lease {LEASE_S:g}s, retry 0.2s)")
    # A clean shutdown releases the lease: a standby takes over at its next retry.
    c = Replica(server, "c", log)
    c.start()
    await asyncio.sleep(1.0)
    assert active(log) == {"b"}
    released = time.monotonic()
    b.task.cancel()
    await wait_for(lambda: active(log) == {"c"}, what="c active")
    took_over = next(t for t, n, w in log if n == "c" and w == "start")
    print(f"failover after a clean shutdown: {took_over - released:.2f}s")
    c.task.cancel()
    for replica in (a, b, c):
        await asyncio.gather(replica.task, return_exceptions=True)
        await replica.api.close()


class FakeElector:
    """An elector that becomes the leader at once and holds until told otherwise."""

    def __init__(self, hold=None):
        self.released = False
        self._hold = hold

    async def acquire(self):
        await asyncio.sleep(0.05)  # long enough for a standby task to run

    async def hold(self):
        if self._hold is not None:
            return await self._hold()
        await asyncio.Event().wait()

    async def release(self):
        self.released = True


def errors(caplog, text):
    return [r for r in caplog.records if r.levelno >= logging.ERROR and text in r.getMessage()]


@pytest.mark.parametrize("lost, work, hold, expected", [
    (False, None, None, 0),  # the operator returned by itself: a clean shutdown
    (True, None, None, 1),  # lost the lease
    (False, RuntimeError(), None, 1),  # the operator crashed
    (False, None, ValueError(), 1),  # the renewal loop crashed
])  # fmt: skip
def test_exit_status(lost, work, hold, expected):
    assert exit_status(lost, work, hold) == expected


async def test_a_crashed_operator_exits_non_zero_and_is_logged(caplog):
    async def operate():
        raise RuntimeError("kopf died")

    elector = FakeElector()
    assert await run_as_leader(elector, operate) == 1
    assert elector.released
    logged = errors(caplog, "kopf died")
    assert logged and logged[0].exc_info[0] is RuntimeError


async def test_a_clean_operator_stop_exits_zero():
    async def operate():
        return None

    elector = FakeElector()
    assert await run_as_leader(elector, operate) == 0
    assert elector.released


async def test_a_crashed_renewal_loop_exits_non_zero_and_is_logged(caplog):
    async def operate():
        await asyncio.Event().wait()

    async def hold():
        raise ValueError("bad lease")

    elector = FakeElector(hold=hold)
    assert await run_as_leader(elector, operate) == 1
    assert elector.released
    logged = errors(caplog, "bad lease")
    assert logged and logged[0].exc_info[0] is ValueError


async def test_a_failed_standby_liveness_server_is_logged_when_it_fails(caplog):
    async def standby():
        raise OSError("address already in use")

    async def operate():
        return None

    assert await run_as_leader(FakeElector(), operate, standby=standby) == 0
    logged = errors(caplog, "address already in use")
    assert logged and "standby liveness server" in logged[0].getMessage() and logged[0].exc_info


def test_the_lease_is_never_shorter_than_the_holders_deadline_assumes():
    # leaseDurationSeconds is whole seconds: rounding 1.5 down would let a standby take
    # the lease 0.5 s before the holder steps down.
    elector = LeaderElector(None, "ns", "lease", "me", lease_duration=1.5)
    assert elector._lease(NOW, 0, None, None)["spec"]["leaseDurationSeconds"] == 2
    assert LeaderElector(None, "ns", "lease", "me")._lease(NOW, 0, None, None)["spec"]["leaseDurationSeconds"] == 15


# --- A renewal call that hangs or fails: the holder never acts past its lease. ---


@pytest.mark.parametrize("since, due, deadline, expected", [
    (0, 5, 10, RenewalStep(wait=5, timeout=5)),  # just renewed: sleep, then the call may take the rest
    (5, 5, 10, RenewalStep(wait=0, timeout=5)),  # due now
    (5.5, 5, 10, RenewalStep(wait=0, timeout=4.5)),  # woke late: less time for the call
    (6, 8, 10, RenewalStep(wait=2, timeout=2)),  # failed at 6: retry after retry_period
    (9, 11, 10, None),  # a retry would come after the deadline: step down now
    (10, 5, 10, None),  # the deadline passed (a hung call timed out at it)
    (12, 5, 10, None),
])  # fmt: skip
def test_next_renewal(since, due, deadline, expected):
    assert next_renewal(since, due, deadline) == expected


@pytest.mark.parametrize("renew_period, deadline, expected", [
    (5, 10, 5),
    (10, 10, 5),  # the longest period the config allows would leave the call no time
    (0.2, 2 / 3, 0.2),
])  # fmt: skip
def test_renewal_due(renew_period, deadline, expected):
    assert renewal_due(renew_period, deadline) == expected


class FakeLeaseApi:
    """A Lease held in memory; each write (create or renewal) does what the next entry
    of `writes` says ("ok", "fail": a 503, "hang": never answers), then `then`; a
    release does what `release` says."""

    def __init__(self, writes=(), then="ok", release="ok"):
        self.lease = None
        self.writes, self.then, self.release = list(writes), then, release
        self.done: list[str] = []  # what each create or renewal did, in order
        self.renewed: list[str] = []  # the renewTime of each create or renewal that was written

    async def _write(self, what=None):
        if what is None:
            what = self.writes.pop(0) if self.writes else self.then
            self.done.append(what)
        if what == "hang":
            await asyncio.Event().wait()
        if what == "fail":
            raise ApiError(503, "ServiceUnavailable", "etcd leader changed")

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.lease)

    async def create(self, body):
        await self._write()
        self.lease = copy.deepcopy(body)
        self.renewed.append(body["spec"]["renewTime"])
        return body

    async def merge_patch(self, kind, namespace, name, patch):
        await self._write(self.release if patch["spec"]["holderIdentity"] is None else None)
        self.lease["spec"].update(patch["spec"])
        if patch["spec"]["renewTime"]:
            self.renewed.append(patch["spec"]["renewTime"])
        return self.lease


def renew_time(api):
    """The renewTime of the last renewal written."""
    return datetime.strptime(api.renewed[-1], MICROTIME).replace(tzinfo=UTC)


@pytest.mark.parametrize("renewed_first", [0, 2])
async def test_a_hanging_renewal_stops_the_holder_before_its_lease_expires(renewed_first):
    lease = 4.5  # step-down deadline 3.0 s after the last renewal (1.5 s to spare for a stalled test)
    api = FakeLeaseApi(["ok"] * (1 + renewed_first), then="hang")  # create, renewals, then no answer
    elector = LeaderElector(api, "ns", "lease", "me", lease_duration=lease, renew_period=0.6, retry_period=0.15)
    stopped = []

    async def operate():
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(datetime.now(UTC))

    # The old holder awaited the hung call for ever (in production: the 60 s request timeout).
    assert await asyncio.wait_for(run_as_leader(elector, operate), timeout=20) == 1
    assert api.done[: 2 + renewed_first] == ["ok"] * (1 + renewed_first) + ["hang"]
    acted_for = (stopped[0] - renew_time(api)).total_seconds()
    assert acted_for < lease, f"the operator ran {acted_for:.2f}s after its last renewal (lease {lease}s)"


async def test_a_failed_renewal_is_retried_and_the_holder_keeps_leading():
    # renew_period = half the 3.0 s deadline: the old holder, which retried only
    # renew_period after a failure, stepped down at the first one.
    api = FakeLeaseApi(["ok", "fail", "ok"])
    elector = LeaderElector(api, "ns", "lease", "me", lease_duration=4.5, renew_period=1.5, retry_period=0.3)
    await elector.acquire()
    holding = asyncio.get_running_loop().create_task(elector.hold())
    try:
        # Three renewals after the failure span more than the deadline: still the leader.
        await wait_for(lambda: holding.done() or len(api.done) >= 5, what="renewals after a failure")
        assert not holding.done() and api.done[:5] == ["ok", "fail", "ok", "ok", "ok"]
    finally:
        holding.cancel()
        await asyncio.gather(holding, return_exceptions=True)


async def test_renewals_that_keep_failing_are_retried_until_the_deadline_then_the_holder_steps_down():
    api = FakeLeaseApi(["ok"], then="fail")
    elector = LeaderElector(api, "ns", "lease", "me", lease_duration=4.5, renew_period=1.5, retry_period=0.3)
    await elector.acquire()
    await asyncio.wait_for(elector.hold(), timeout=30)
    stepped_down = (datetime.now(UTC) - renew_time(api)).total_seconds()
    assert api.done.count("fail") >= 3  # retried every retry_period, not once
    assert 2.4 <= stepped_down < 4.5  # at the 3.0 s deadline (less a retry period), before the lease ends


async def test_a_hanging_release_is_abandoned_when_the_lease_would_have_expired():
    # A holder that stepped down because the API hangs exits; the lease expires by itself.
    api = FakeLeaseApi(release="hang")
    elector = LeaderElector(api, "ns", "lease", "me", lease_duration=0.3, renew_period=0.1, retry_period=0.05)
    await elector.acquire()
    await asyncio.wait_for(elector.release(), timeout=5)
    assert api.lease["spec"]["holderIdentity"] == "me"


async def test_a_hanging_acquisition_is_abandoned_and_retried():
    api = FakeLeaseApi(["hang", "ok"])
    elector = LeaderElector(api, "ns", "lease", "me", lease_duration=0.3, renew_period=0.1, retry_period=0.05)
    await asyncio.wait_for(elector.acquire(), timeout=10)
    assert api.done == ["hang", "ok"] and elector.renewed == renew_time(api)
