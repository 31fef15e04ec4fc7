"""PERSIA's ``persia.service``: where a serving process finds the embedding workers.

PERSIA's TorchServe handler does ``InferCtx(get_embedding_worker_services(), device_id)``. The
list comes from ``EMBEDDING_WORKER_SERVICE`` (PERSIA read one ``host:port``; a comma-separated
list of several is accepted too), else PERSIA's default ``embedding_worker:8887``.
"""

from __future__ import annotations

import os
from typing import List

EMBEDDING_WORKER_SERVICE_ENV = "EMBEDDING_WORKER_SERVICE"
DEFAULT_EMBEDDING_WORKER_SERVICE = "embedding_worker:8887"


def parse_services(value: str, variable: str) -> List[str]:
    """``host:port[,host:port...]`` -> addresses; an entry without a port is an error naming it."""
    out = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{variable}: {entry!r} is not host:port")
        out.append(entry)
    if not out:
        raise ValueError(f"{variable} is set but names no service: {value!r}")
    return out


def get_embedding_worker_services() -> List[str]:
    """The embedding workers' gRPC addresses (``$EMBEDDING_WORKER_SERVICE`` or PERSIA's default)."""
    value = os.environ.get(EMBEDDING_WORKER_SERVICE_ENV)
    if not value:
        return [DEFAULT_EMBEDDING_WORKER_SERVICE]
    return parse_services(value, EMBEDDING_WORKER_SERVICE_ENV)
