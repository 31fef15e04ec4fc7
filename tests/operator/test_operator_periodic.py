"""The periodic reconcile loop (handlers.py): a job whose pass raises something other
than an API error is named in the log with its traceback and in a Warning event, and the
other jobs go on being reconciled; a finished job whose last pass changed nothing is not read
again until it or its children change or its TTL is due.

What KMock cannot check (see operator_testkit.py): nothing here depends on it beyond
storing the jobs, their status and the events."""

from __future__ import annotations

import collections
import logging

from datetime import timedelta

from operator_testkit import NOW, PJ, Sim, failed, failed_pod_status, job_body, start_pods, wait_for

from persia_operator import constants as C
from persia_operator.events import JobEvent
from persia_operator.handlers import (API_ERRORS_BEFORE_EVENT, api_error_streaks, events_due, failed_passes,
                                      failure_event)
from persia_operator.kube import ApiError
from persia_operator.settled import Settled, pass_due, settled_after

NS = "ns1"


def test_failed_passes_names_the_job_of_each_error():
    boom, bad = KeyError("x"), ValueError("y")
    keys = [("a", "one"), ("a", "two"), ("b", "three")]
    assert failed_passes(keys, [None, boom, bad]) == {("a", "two"): boom, ("b", "three"): bad}
    assert failed_passes([], []) == {}


def test_failure_event_is_a_short_warning():
    event = failure_event(KeyError("replicaStatuses"))
    assert event == JobEvent("Warning", "ReconcileFailed",
                             "Reconcile failed, retried every pass: KeyError: 'replicaStatuses'")  # fmt: skip
    long = failure_event(ValueError("first line\nsecond line" + "x" * 5000))
    assert "second line" not in long.message and len(long.message) <= 1024


def test_api_error_streaks_count_consecutive_failed_passes():
    a, b = ("ns", "a"), ("ns", "b")
    err = ApiError(403, "Forbidden", "persiajobs/status")
    streaks = api_error_streaks({}, [a, b], [err, None])
    assert streaks == {a: 1}
    streaks = api_error_streaks(streaks, [a, b], [err, err])
    assert streaks == {a: 2, b: 1}
    assert api_error_streaks(streaks, [a, b], [None, err]) == {b: 2}  # a pass that works resets it


def test_events_due_only_for_new_or_changed_failures():
    a, b, c = ("ns", "a"), ("ns", "b"), ("ns", "c")
    assert events_due({a: "E1", b: "E2"}, {a: "E1", b: "E3", c: "E4"}) == [b, c]
    assert events_due({a: "E1"}, {}) == []


async def misbehaving_pass(cluster, operator, names: tuple[str, ...], odd_one: str, misbehave):
    """Create the jobs ``names`` and wait for their children; from then on ``odd_one``'s passes
    run ``await misbehave()`` first (raise, or hang), the others pass as usual. Returns the count
    of passes per job, growing as the operator (in its own thread) runs them."""
    for name in names:
        await cluster.create(job_body(name))
    for name in names:
        await wait_for(lambda name=name: cluster.condition(NS, name, C.COND_CREATED), what=f"{name} created")
    real_pass = operator._pass
    calls: collections.Counter[str] = collections.Counter()

    async def wrapped(body, summaries, logger):
        name = body["metadata"]["name"]
        calls[name] += 1
        if name == odd_one:
            await misbehave()
        return await real_pass(body, summaries, logger)

    operator._pass = wrapped  # the operator runs in its own thread; its next passes use it
    return calls


async def test_a_failing_job_is_logged_and_reported_and_the_others_go_on(cluster, operator, caplog):
    caplog.set_level(logging.INFO, logger="persia_operator")

    async def bug():
        raise KeyError("unexpected child")  # a bug, not an API error

    calls = await misbehaving_pass(cluster, operator, ("good", "bad"), "bad", bug)
    await wait_for(lambda: calls["bad"] >= 3 and calls["good"] >= 3, what="several periodic passes of both jobs")

    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "ns1/bad" in r.getMessage()]
    assert errors, "the failing job is not named in the log"
    assert errors[0].exc_info and errors[0].exc_info[0] is KeyError  # with its traceback
    assert "unexpected child" in errors[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and "ns1/good" in r.getMessage()]
    # One event for the same failure, however many passes it fails.
    bad_uid = cluster.job(NS, "bad")["metadata"]["uid"]
    events = [e for e in cluster.events(NS) if e.get("reason") == "ReconcileFailed"]
    assert len(events) == 1, events
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "bad"
    assert events[0]["involvedObject"]["uid"] == bad_uid
    assert "KeyError" in events[0]["message"]


async def test_an_api_error_that_persists_is_reported_on_the_job(cluster, operator, caplog):
    """An API error is transient until it persists: logged as a warning each pass, and after
    API_ERRORS_BEFORE_EVENT passes in a row one Warning event on the job (it was only logged:
    a job whose status the server refused for ever showed nothing)."""
    caplog.set_level(logging.INFO, logger="persia_operator")

    async def forbidden():
        raise ApiError(403, "Forbidden", 'persiajobs.persia.com "denied" is forbidden: cannot patch persiajobs/status')

    calls = await misbehaving_pass(cluster, operator, ("denied",), "denied", forbidden)
    await wait_for(lambda: calls["denied"] >= API_ERRORS_BEFORE_EVENT + 1, what="passes that keep failing")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "ns1/denied" in r.getMessage()]
    assert len(warnings) >= API_ERRORS_BEFORE_EVENT
    events = [e for e in cluster.events(NS) if e.get("reason") == "ReconcileFailed"]
    assert len(events) == 1, events
    assert "ApiError: 403 Forbidden" in events[0]["message"] and events[0]["involvedObject"]["name"] == "denied"


async def test_a_pass_that_hangs_is_cut_short_and_the_other_jobs_go_on(cluster, operator, monkeypatch):
    """The periodic round waits for its slowest pass: one job whose calls hang (a webhook timing
    out on every create) held up every other job's passes, so their failures, restarts and
    deadlines waited too. A pass is cut short after PASS_TIMEOUT_S and reported like a failure."""
    import asyncio

    from persia_operator import handlers

    monkeypatch.setattr(handlers, "PASS_TIMEOUT_S", 0.5)

    async def hang():
        await asyncio.Event().wait()  # a call that never answers

    calls = await misbehaving_pass(cluster, operator, ("good", "stuck"), "stuck", hang)
    await wait_for(lambda: calls["good"] >= 3 and calls["stuck"] >= 3, what="rounds that go on past a hung pass")
    await wait_for(lambda: [e for e in cluster.events(NS) if e.get("reason") == "ReconcileFailed"
                            and e["involvedObject"]["name"] == "stuck"], what="the hung pass reported")


def test_a_finished_job_that_changed_nothing_settles_until_its_ttl():
    sim = Sim(job_body(runPolicy={"ttlSecondsAfterFinished": 60})).running()
    sim.step(sim.children(overrides={"demo-embedding-ps-0": failed(2)}))
    assert sim.status.phase == "Failed"
    memo = settled_after(sim.status, False, "7", "children")
    assert memo == Settled("7", "children", sim.now.replace(microsecond=0) + timedelta(seconds=60))
    assert not pass_due(memo, "7", "children", sim.now + timedelta(seconds=59))
    assert pass_due(memo, "7", "children", sim.now + timedelta(seconds=61))  # its TTL
    assert pass_due(memo, "8", "children", sim.now) and pass_due(memo, "7", "a pod went", sim.now)
    assert settled_after(sim.status, True, "7", "children") is None  # it wrote or acted: again
    assert pass_due(None, "7", "children", sim.now)
    running = Sim().running()
    assert settled_after(running.status, False, "7", "children") is None
    no_ttl = Sim().running()
    no_ttl.step(no_ttl.children(overrides={"demo-embedding-ps-0": failed(2)}))
    assert not pass_due(settled_after(no_ttl.status, False, "7", "c"), "7", "c", NOW + timedelta(days=365))


def operator_reads(cluster, job: str) -> int:
    """GETs of the operator's own client of ``job`` and of its children read by name."""
    return sum(1 for r in list(cluster.k) if r.method == "GET" and r.headers.get("User-Agent") == C.FIELD_MANAGER
               and r.name is not None and (r.name == job or r.name.startswith(f"{job}-")))  # fmt: skip


async def test_a_finished_job_is_not_read_every_round(cluster, operator):
    """A finished job was read with its Secrets, PDBs and PodGroup (about 5 GETs) every round
    for as long as it was kept. A running job beside it counts the rounds (its pass reads it)."""
    ttl = 10  # past the two quiet spells below, on a loaded machine too
    await cluster.create(job_body("live"))
    await cluster.create(job_body("done", runPolicy={"ttlSecondsAfterFinished": ttl}))
    await wait_for(lambda: (cluster.condition(NS, "done", C.COND_CREATED) or {}).get("status") == "True",
                   what="done created")  # fmt: skip
    await start_pods(cluster, NS, "done")
    await wait_for(lambda: cluster.status(NS, "done").get("phase") == "Running", what="done Running")
    await cluster.set_pod_status(NS, "done-nn-worker-a0-0", failed_pod_status(1))
    await wait_for(lambda: cluster.status(NS, "done").get("phase") == "Failed", what="done Failed")

    def rounds() -> int:
        return sum(1 for r in list(cluster.k) if r.method == "GET" and r.name == "live"
                   and r.headers.get("User-Agent") == C.FIELD_MANAGER)  # fmt: skip

    async def quiet(what: str) -> None:
        """Five rounds in a row without a read of the finished job."""
        mark = {"rounds": rounds(), "reads": operator_reads(cluster, "done")}

        def five_quiet_rounds() -> bool:
            if operator_reads(cluster, "done") != mark["reads"]:  # read again: count anew
                mark.update(rounds=rounds(), reads=operator_reads(cluster, "done"))
                return False
            return rounds() >= mark["rounds"] + 5

        await wait_for(five_quiet_rounds, timeout=ttl / 2, what=what)

    await quiet("five rounds without reading the finished job")  # its cleanup done, its status final
    assert cluster.job(NS, "done") is not None  # settled, not deleted
    before = operator_reads(cluster, "done")
    await cluster.patch(PJ, NS, "done", {"metadata": {"labels": {"team": "a"}}})
    await wait_for(lambda: operator_reads(cluster, "done") > before, what="the changed job read again")
    await quiet("settled again")
    await wait_for(lambda: cluster.job(NS, "done") is None, timeout=ttl + 10, what="deleted at its TTL")


async def test_a_job_of_another_controller_is_not_read_every_round(cluster, operator):
    """A job whose spec.managedBy names another controller (MultiKueue) was read every round
    (a GET per job every 10 s, for as long as it exists) only for the pass to see that it is not
    this operator's. kopf's index shows managedBy without a call: such a job is not read, and
    not written either (no status, no annotation of this operator's on it)."""
    await cluster.create(job_body("live"))
    await cluster.create(job_body("theirs", managedBy="kueue.x-k8s.io/multikueue"))
    await wait_for(lambda: cluster.condition(NS, "live", C.COND_CREATED), what="live created")

    def rounds() -> int:
        return sum(1 for r in list(cluster.k) if r.method == "GET" and r.name == "live"
                   and r.headers.get("User-Agent") == C.FIELD_MANAGER)  # fmt: skip

    start = rounds()
    await wait_for(lambda: rounds() >= start + 5, what="five more rounds")
    assert operator_reads(cluster, "theirs") == 0
    writes = [r for r in list(cluster.k) if r.method in ("PATCH", "PUT", "POST", "DELETE") and r.name == "theirs"]
    assert not writes, [(r.method, r.path) for r in writes]
    theirs = cluster.job(NS, "theirs")
    assert not theirs.get("status") and not (theirs["metadata"].get("annotations") or {})
    assert not [n for n in cluster.names("v1/services", NS) if n.startswith("theirs-")]
    # Handed over to this operator (managedBy removed): it is this operator's from then on.
    await cluster.patch(PJ, NS, "theirs", {"spec": {"managedBy": None}})
    await wait_for(lambda: (cluster.condition(NS, "theirs", C.COND_CREATED) or {}).get("status") == "True",
                   what="the handed-over job reconciled")  # fmt: skip
