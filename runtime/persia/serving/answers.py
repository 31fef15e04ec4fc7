"""How a failed request is answered, the same on HTTP and gRPC (pure).

A bad request is 400 / INVALID_ARGUMENT naming the field (features the model does not take too);
a full queue, a missing model, an unreachable embedding worker or a server that is stopping is 503 /
UNAVAILABLE; a request
not answered within ``request_timeout_s``, or whose embedding lookup ran out of that time, is
504 / DEADLINE_EXCEEDED; anything else is 500 / INTERNAL and logged.
"""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout

from persia.errors import RemoteError
from persia.serving.batcher import QueueFull, Stopping
from persia.serving.predictor import ModelInputError, ModelNotLoaded
from persia.serving.request import RequestError


class ServeError(Exception):
    """A request that failed, with its HTTP status and error kind (the metrics label)."""

    def __init__(self, status: int, kind: str, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.field = status, kind, field


def classify(exc: BaseException) -> ServeError:
    """Pure: which answer an exception gets."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, RequestError):
        return ServeError(400, "bad_request", str(exc), exc.field)
    if isinstance(exc, ModelInputError):
        return ServeError(400, "bad_request", str(exc))
    if isinstance(exc, QueueFull):
        return ServeError(503, "overloaded", f"overloaded: {exc}")
    if isinstance(exc, Stopping):  # a drain refusal or leftover: retry on another replica, never a 500
        return ServeError(503, "unavailable", f"{exc}; retry on another replica")
    if isinstance(exc, ModelNotLoaded):
        return ServeError(503, "unavailable", f"no model loaded: {exc}")
    if isinstance(exc, RemoteError):
        if exc.kind == "DEADLINE_EXCEEDED":  # the lookup ran out of the request's time
            return ServeError(504, "timeout", f"embedding lookup not answered in time: {exc}")
        return ServeError(503, "unavailable", f"embedding lookup failed: {exc}")
    if isinstance(exc, (TimeoutError, FutureTimeout)):
        return ServeError(504, "timeout", f"no answer in time{': ' + str(exc) if str(exc) else ''}")
    return ServeError(500, "internal", f"{type(exc).__name__}: {exc}")
