"""A thread that stamps the clock as fast as it can while a block runs: whether other Python
threads ran during a call. A call that releases the GIL lets it stamp throughout; one that holds
the GIL stops it dead for the whole call, whatever else the machine runs."""

from __future__ import annotations

import threading
import time


class Ticker:
    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._stop, self._ticking = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._tick, name="test-ticker")

    def _tick(self) -> None:
        self._ticking.set()
        while not self._stop.is_set():
            self.stamps.append(time.perf_counter())

    def __enter__(self) -> "Ticker":
        self._thread.start()
        self._ticking.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def between(self, t0: float, t1: float) -> list[float]:
        """The stamps strictly inside ``(t0, t1)``."""
        return [s for s in self.stamps if t0 < s < t1]

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest time in ``[t0, t1]`` with no stamp."""
        inside = [t0, *self.between(t0, t1), t1]
        return max(b - a for a, b in zip(inside, inside[1:]))
