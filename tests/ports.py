"""Ports for tests whose roles bind fixed ports (metrics exporters): chosen below the kernel's
ephemeral range, so no server binding port 0 can take one between the check and the bind."""

from __future__ import annotations

import secrets
import socket
from contextlib import contextmanager

from persia.utils import ephemeral_port_floor


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports below the kernel's ephemeral range, so that no
    server binding port 0 (gRPC, nats-server, the DDP store, ``find_free_port``) can take one of
    them between this check and the roles' binds (that race made a role fall back to another port)."""
    # SystemRandom: tests seed the random module (setup_seed), which made every run pick the same
    # ports, and the same ports as an earlier test of the session
    random = secrets.SystemRandom()

    top = max(ephemeral_port_floor(), 10000 + n + 1)
    for _ in range(200):
        base = random.randint(10000, top - n - 1) if top - n - 1 > 10000 else random.randint(40000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


@contextmanager
def refusing_port():
    """A loopback port where a connect is refused, for the life of the block: bound, never
    listening. A port merely closed again is not enough: Linux may pick the very port as a
    connect's own source port, and the socket then connects to itself (TCP simultaneous open)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
