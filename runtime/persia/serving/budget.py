"""Request bodies the model server holds at once, in bytes.

Each HTTP connection may send a body of up to ``max_request_bytes`` (64 MiB by default) and there
may be ``max_connections`` (256) of them: 16 GiB of bodies read at once, and a JSON body takes
about twenty times its size again while it is parsed. A body is now read only once its bytes are
reserved here (a request that cannot reserve them within its wait is answered 503, overloaded,
before anything is read), and JSON bodies are parsed one at a time (the parser holds the GIL
anyway: parsing two at once is not faster, only twice the memory).
"""

from __future__ import annotations

import threading
import time


class ByteBudget:
    """``capacity`` bytes, reserved and released by the requests that read a body."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a byte budget needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self._cond = threading.Condition()

    def reserve(self, n: int, timeout_s: float) -> bool:
        """Take ``n`` bytes, waiting up to ``timeout_s`` for them; False when they did not come
        (or ``n`` is over the capacity: they never could)."""
        if n > self.capacity:
            return False
        end = time.monotonic() + timeout_s
        with self._cond:
            while self.held + n > self.capacity:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self.held += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            if n > self.held:
                raise ValueError(f"released {n} bytes of a byte budget holding {self.held}")
            self.held -= n
            self._cond.notify_all()
