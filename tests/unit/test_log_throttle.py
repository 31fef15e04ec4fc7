"""The bus's log throttle (``persia.bus._LogThrottle``): one line per interval, then one again."""

from __future__ import annotations

from persia import bus as bus_module


def test_one_line_per_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(bus_module.time, "monotonic", lambda: now[0])
    throttle = bus_module._LogThrottle(10.0)
    assert throttle.due()  # the first failure is always logged
    now[0] = 109.9
    assert not throttle.due()
    now[0] = 110.0
    assert throttle.due()
    assert not throttle.due()
