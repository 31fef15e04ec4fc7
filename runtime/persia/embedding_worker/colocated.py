"""An embedding worker and a PS replica in one process: the worker calls that replica directly.

Over loopback a gRPC call costs the two ends far more CPU than the PS's own work on a batch:
measured on a batch of 256 samples (2,500 distinct rows, a lookup and the previous batch's
gradients in one ``Step``), 0.08 ms in the PS's handler against 0.7 ms for the same call through
gRPC with both ends in one process, and more between processes (docs/benchmarks.md, item 3).
When a worker and a replica share a machine anyway (``persia-launcher local --colocate-ps``,
or the ``embedding-worker --with-ps`` role), the worker calls the replica's handlers in its own
process and skips that cost.

The replica is otherwise a full PS: it serves gRPC to every other embedding worker, registers on
NATS, and answers the NN workers' configure, optimizer, checkpoint and stats requests as before.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from persia import rpc
from persia.errors import RemoteError
from persia.messages import validate


class InProcessPs:
    """What the embedding worker's PS client does (``call``, ``future``/``result``), on handlers in
    this process: no serialization, no gRPC, no thread hand-off. A handler's error comes back as
    the same :class:`RemoteError` (same ``kind``) a gRPC answer would have given.

    Requests are checked against the same wire schemas as over gRPC (``persia.messages``, about
    5 us for a Step of three dims): they are built in this process, but a request the gRPC path
    would refuse (a gradient whose width is not its ``dim``, a signed ID array) must not be
    applied here, or a colocated replica would quietly differ from the others."""

    def __init__(self, address: str, service: str, methods: dict[str, rpc.Method]):
        self.address = address
        self.service = service
        self._methods = {name: (m if isinstance(m, tuple) else (m, None)) for name, m in methods.items()}

    def call(self, name: str, request: Any = None, timeout: float = 60.0) -> Any:
        method = self._methods.get(name)
        if method is None:
            raise RemoteError(f"{self.service}/{name}@{self.address}", "Method not found!", kind="UNIMPLEMENTED")
        fn, schema = method
        try:
            return fn(validate(schema, request, f"{self.service}/{name}"))
        except Exception as exc:  # noqa: BLE001 - answered as gRPC would answer it
            code, detail = rpc.error_status(exc)
            raise RemoteError(f"{self.service}/{name}@{self.address}", detail, kind=code) from exc

    def future(self, name: str, request: Any = None, timeout: float = 60.0) -> Future:
        """Runs now (the PS's work on a batch is shorter than a thread hand-off) and returns the
        settled future; :meth:`result` raises what :meth:`call` would."""
        fut: Future = Future()
        try:
            fut.set_result(self.call(name, request, timeout))
        except RemoteError as exc:
            fut.set_exception(exc)
        return fut

    def result(self, name: str, fut: Future) -> Any:
        return fut.result()

    def close(self) -> None:
        pass
