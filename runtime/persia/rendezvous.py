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
import signal
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

    def renew(self, member: str, now: float, index: int | None = None) -> bool:
        """Extend the member's lease. One the table no longer has (its keeper, PS replica 0,
        restarted; an outage longer than the TTL) is taken back at ``index`` while that index is
        free; False when another member holds it: two members would share an index."""
        self.expire(now)
        if member not in self.leases:
            if index is None or index in {i for i, _ in self.leases.values()}:
                return False
            self.leases[member] = (index, now + self.ttl_s)
            return True
        held, _ = self.leases[member]
        self.leases[member] = (held, now + self.ttl_s)
        return True

    def release(self, member: str, index: int) -> bool:
        """The member gives ``index`` back (it exits): free at once for the next claimant, instead
        of after the TTL (each step of a rolling update waited for it). False when the member does
        not hold that index (a late release after its lease expired and was taken: not its own)."""
        if self.leases.get(member, (None, 0.0))[0] != index:
            return False
        del self.leases[member]
        return True


class RendezvousServer:
    def __init__(self, bus: NatsBus, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic):
        self._tables: dict[str, Assignments] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.ttl_s = ttl_s
        bus.serve(subject("rdzv", "claim"), self._claim, blocking=False, schema=M.RendezvousClaim)
        bus.serve(subject("rdzv", "renew"), self._renew, blocking=False, schema=M.RendezvousRenew)
        bus.serve(subject("rdzv", "release"), self._release, blocking=False, schema=M.RendezvousRelease)

    def _table(self, role: str) -> Assignments:
        return self._tables.setdefault(role, Assignments(self.ttl_s))

    def _claim(self, req: dict):
        with self._lock:
            index = self._table(str(req["role"])).claim(str(req["member"]), int(req["size"]), self._clock())
        return BUSY if index is None else {"index": index, "ttl_s": self.ttl_s}

    def _renew(self, req: dict):
        index = req.get("index")
        with self._lock:
            held = self._table(str(req["role"])).renew(str(req["member"]), self._clock(),
                                                       None if index is None else int(index))
        return {"held": held}

    def _release(self, req: dict):
        with self._lock:
            released = self._table(str(req["role"])).release(str(req["member"]), int(req["index"]))
        return {"released": released}


def member_name(host: str | None = None, pid: int | None = None) -> str:
    """This process's name in the table: its host (the pod's name) and its process id. The host
    alone named every process of one machine alike (local mode's data loaders, pods sharing the
    node's network and name), and the table answered the second claimant with the first one's
    index ("the same one again"): two loaders ran as one index. Process ids tell apart the live
    processes of one machine; a container restarted in its pod starts its launcher at the same
    pid, so it still takes its index back at once (another process waits for the old lease's TTL).
    A ``HOSTNAME`` set to something other than the machine's name was given to this process by
    whoever started it: it is the member name as it is."""
    if host is None:
        named, real = os.environ.get("HOSTNAME"), socket.gethostname()
        if named and named != real:
            return named
        host = real
    return f"{host}/{os.getpid() if pid is None else pid}"


def _lost(role: str, index: int) -> None:
    """Another member holds this process's index: it stops (SIGTERM, its graceful path), so that
    its pod restarts and claims an index again, instead of running on as a second ``index``."""
    log.error("rendezvous: %s index %d is held by another member (this one could not renew in time); "
              "stopping this process so that it restarts and claims an index again", role, index)
    os.kill(os.getpid(), signal.SIGTERM)


def release_index(bus: NatsBus, role: str, index: int, stop: threading.Event, timeout: float = 2.0) -> bool:
    """Stop renewing ``index`` and give it back (best effort: if the table does not answer, the
    lease expires after its TTL as before). True when the table took it back."""
    stop.set()
    try:
        released = bool(bus.request(subject("rdzv", "release"),
                                    {"role": role, "member": member_name(), "index": index}, timeout=timeout)["released"])
    except Exception as exc:  # noqa: BLE001 - exiting anyway: the TTL frees it
        log.warning("rendezvous: could not give back %s index %d (free again after its lease): %s", role, index, exc)
        return False
    return released


def claim_index(bus: NatsBus, role: str, size: int, deadline_s: float = 600.0,
                on_lost: Callable[[str, int], None] = _lost) -> tuple[int, threading.Event]:
    """Claim an index and keep it renewed in a daemon thread until the returned event is set. A
    lease the table forgot is taken back at the same index; one another member took ends this
    process (``on_lost``). ``release_index`` gives it back when the process exits."""
    member = member_name()
    reply = bus.request_retry(subject("rdzv", "claim"), {"role": role, "member": member, "size": size},
                              deadline_s=deadline_s, timeout=2.0, max_backoff=2.0,
                              what=f"rendezvous index for {role}")
    index, ttl = int(reply["index"]), float(reply["ttl_s"])
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl / 3):
            try:
                held = bus.request(subject("rdzv", "renew"), {"role": role, "member": member, "index": index},
                                   timeout=2.0)["held"]
            except Exception as exc:  # noqa: BLE001 - retried on the next tick
                log.warning("rendezvous renew failed: %s", exc)
                continue
            if not held:
                on_lost(role, index)
                return

    threading.Thread(target=renew, name="persia-rdzv", daemon=True).start()
    log.info("rendezvous: %s %s holds index %d of %d", role, member, index, size)
    return index, stop


def rendezvous_enabled() -> bool:
    return os.environ.get("PERSIA_RENDEZVOUS", "").lower() == "nats"
