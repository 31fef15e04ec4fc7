"""The periodic reconcile loop (handlers.py): a job whose pass raises something other
than an API error is named in the log with its traceback and in a Warning event, and the
other jobs go on being reconciled.

What KMock cannot check (see operator_testkit.py): nothing here depends on it beyond
storing the jobs, their status and the events."""

from __future__ import annotations

import collections
import logging

from operator_testkit import job_body, wait_for

from persia_operator import constants as C
from persia_operator.events import JobEvent
from persia_operator.handlers import (API_ERRORS_BEFORE_EVENT, api_error_streaks, events_due, failed_passes,
                                      failure_event)
from persia_operator.kube import ApiError

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
