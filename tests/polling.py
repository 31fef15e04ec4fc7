"""Waiting in tests for a condition another thread or process makes true: a poll with a deadline,
never a fixed sleep, and a failure that names what did not happen."""

from __future__ import annotations

import time
from typing import Callable


def poll_until(condition: Callable[[], object], what: str, deadline_s: float = 30.0) -> None:
    """Return once ``condition()`` is true; fail naming ``what`` after ``deadline_s`` (generous:
    it costs a passing test nothing, and a loaded CI machine can stall a process for seconds)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"not within {deadline_s}s: {what}"
        time.sleep(0.005)
