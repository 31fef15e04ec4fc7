"""The NN worker's SIGTERM watchdog: the handler only stores a time; a thread warns once and ends
the process at the grace period (persia.nn_worker.periodic)."""

from __future__ import annotations

import threading
import time

import pytest

from persia.nn_worker import periodic


class _Stub:
    _say_sigterm = periodic.PeriodicCheckpointing._say_sigterm
    _sigterm_watchdog = periodic.PeriodicCheckpointing._sigterm_watchdog

    def __init__(self):
        self._sigterm_at = None
        self._sigterm_said = False
        self._grace = 5.0
        self._watchdog_off = False


class _OutOfTime(Exception):
    pass


def test_the_watchdog_warns_once_and_ends_the_process_at_the_grace_period(monkeypatch, caplog):
    ended: list[float] = []

    def out_of_time(grace):
        ended.append(grace)
        raise _OutOfTime

    monkeypatch.setattr(periodic, "_out_of_time", out_of_time)
    stub = _Stub()
    stub._sigterm_at = time.monotonic() - 10  # SIGTERM 10 s ago, grace 5 s
    with caplog.at_level("WARNING"), pytest.raises(_OutOfTime):
        stub._sigterm_watchdog(5.0, poll_s=0.01)
    assert ended == [5.0]
    assert [r.message for r in caplog.records].count("SIGTERM: stopping after the current step (grace period 5s)") == 1


def test_the_watchdog_ends_quietly_when_the_context_exits_without_sigterm(monkeypatch):
    monkeypatch.setattr(periodic, "_out_of_time", lambda grace: pytest.fail("ended the process without SIGTERM"))
    stub = _Stub()
    t = threading.Thread(target=stub._sigterm_watchdog, args=(5.0, 0.01), daemon=True)
    t.start()
    stub._watchdog_off = True
    t.join(10)
    assert not t.is_alive() and not stub._sigterm_said


def test_a_sigterm_being_honoured_keeps_the_watchdog_after_the_context_exits(monkeypatch):
    monkeypatch.setattr(periodic, "_out_of_time", lambda grace: (_ for _ in ()).throw(_OutOfTime()))
    stub = _Stub()
    stub._watchdog_off = True  # the context exited...
    stub._sigterm_at = time.monotonic() - 10  # ...while a SIGTERM was being honoured
    with pytest.raises(_OutOfTime):
        stub._sigterm_watchdog(5.0, poll_s=0.01)
