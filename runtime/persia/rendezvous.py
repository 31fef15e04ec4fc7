"""Replica indices over NATS for roles run as Deployments (online training), where Kubernetes
gives pods no ordinal: ``PERSIA_RENDEZVOUS=nats``.

PS replica 0 (a StatefulSet pod, always present) keeps the table. A member (pod name) claims the
lowest free index below the role's size and keeps it by renewing a lease; a pod that disappears
frees its index after ``ttl_s``, and its replacement gets it. While every index is held the
claimant is answered "busy" and retries, so a scale-up never produces two ranks with one index.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from persia import messages as M
from persia.bus import BUSY, NatsBus, subject

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 30.0


@dataclass
class Assignments:
    """Pure lease table for one role: ``member -> (index, expiry)``."""

    ttl_s: float = DEFAULT_TTL_S
    leases: dict[str, tuple[int, float]] = field(default_factory=dict)

    def expire(self, now: float) -> None:
        for member in [m for m, (_, exp) in self.leases.items() if exp <= now]:
            del self.leases[member]

    def claim(self, member: str, size: int, now: float) -> int | None:
        """The member's index (the same one again if it already holds it), or None when full."""
        if size < 1:
            raise ValueError(f"rendezvous size must be >= 1, got {size}")
        self.expire(now)
        if member in self.leases:
            index = self.leases[member][0]
            if index < size:
                self.leases[member] = (index, now + self.ttl_s)
                return index
            del self.leases[member]  # scaled down below its index
        taken = {i for i, _ in self.leases.values()}
        for index in range(size):
            if index not in taken:
                self.leases[member] = (index, now + self.ttl_s)
                return index
        return None

    def renew(self, member: str, now: float) -> bool:
        self.expire(now)
        if member not in self.leases:
            return False
        index, _ = self.leases[member]
        self.leases[member] = (index, now + self.ttl_s)
        return True


class RendezvousServer:
    def __init__(self, bus: NatsBus, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic):
        self._tables: dict[str, Assignments] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.ttl_s = ttl_s
        bus.serve(subject("rdzv", "claim"), self._claim, blocking=False, schema=M.RendezvousClaim)
        bus.serve(subject("rdzv", "renew"), self._renew, blocking=False, schema=M.RendezvousRenew)

    def _table(self, role: str) -> Assignments:
        return self._tables.setdefault(role, Assignments(self.ttl_s))

    def _claim(self, req: dict):
        with self._lock:
            index = self._table(str(req["role"])).claim(str(req["member"]), int(req["size"]), self._clock())
        return BUSY if index is None else {"index": index, "ttl_s": self.ttl_s}

    def _renew(self, req: dict):
        with self._lock:
            return {"held": self._table(str(req["role"])).renew(str(req["member"]), self._clock())}


def member_name() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()


def claim_index(bus: NatsBus, role: str, size: int, deadline_s: float = 600.0) -> tuple[int, threading.Event]:
    """Claim an index and keep it renewed in a daemon thread until the returned event is set."""
    member = member_name()
    reply = bus.request_retry(subject("rdzv", "claim"), {"role": role, "member": member, "size": size},
                              deadline_s=deadline_s, timeout=2.0, max_backoff=2.0,
                              what=f"rendezvous index for {role}")
    index, ttl = int(reply["index"]), float(reply["ttl_s"])
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 3):
            try:
                held = bus.request(subject("rdzv", "renew"), {"role": role, "member": member}, timeout=2.0)["held"]
                if not held:
                    log.error("rendezvous lease of %s index %d was lost", role, index)
            except Exception as exc:  # noqa: BLE001 - retried on the next tick
                log.warning("rendezvous renew failed: %s", exc)

    threading.Thread(target=renew, name="persia-rdzv", daemon=True).start()
    log.info("rendezvous: %s %s holds index %d of %d", role, member, index, size)
    return index, stop


def rendezvous_enabled() -> bool:
    return os.environ.get("PERSIA_RENDEZVOUS", "").lower() == "nats"
