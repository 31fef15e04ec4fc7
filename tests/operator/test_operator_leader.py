"""Leader election: the pure decision table, and two electors against KMock (one active,
failover when the leader dies or steps down, never two active at once).

What KMock cannot check: it does not enforce resourceVersion preconditions, so two
replicas racing for a free lease in the same instant are not exercised (a real API
server answers the loser 409, which `try_acquire` treats as "not the leader")."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta

import kopf
import pytest
from operator_testkit import wait_for

from persia_operator.kube import KubeApi
from persia_operator.leader import MICROTIME, LeaderElector, decide, exit_status, run_as_leader

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


class Replica:
    """One operator replica: an elector and a stand-in for the kopf operator that
    records when it is active."""

    def __init__(self, server: str, name: str, log: list):
        self.api = KubeApi(login=lambda: kopf.ConnectionInfo(server=server))
        self.elector = LeaderElector(self.api, "persia-system", "persia-operator", name,
                                     lease_duration=1.0, renew_period=0.2, retry_period=0.1)  # fmt: skip
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
    await asyncio.sleep(0.5)  # b would have taken over by now if it could
    assert active(log) == {"a"}
    # The leader loses the API server: it steps down, b takes over after the lease expires.
    lost = time.monotonic()
    a.crash_network()
    await wait_for(lambda: active(log) == {"b"}, what="b active")
    assert await asyncio.wait_for(a.task, 5) == 1  # a's operator stopped: it lost the lease
    took_over = next(t for t, n, w in log if n == "b" and w == "start")
    a_stopped = next(t for t, n, w in log if n == "a" and w == "stop")
    assert a_stopped <= took_over  # never two active
    print(f"failover after a lost leader: {took_over - lost:.2f}s (lease 1.0s, retry 0.1s)")
    # A clean shutdown releases the lease: a standby takes over at its next retry.
    c = Replica(server, "c", log)
    c.start()
    await asyncio.sleep(0.3)
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
