"""Small helpers PERSIA users import (setup_seed, find_free_port, yaml) and the result line."""

from __future__ import annotations

import json
import os
import random
import logging
import socket
import subprocess
import sys
from typing import Any, Collection, Mapping, Sequence

import numpy as np
import yaml

RESULT_PREFIX = "PERSIA_RESULT "
RESULT_EXTRAS: list = []
"""Callables returning more fields for the result line; role packages register theirs."""


_embedding_seed: int | None = None


def setup_seed(seed: int) -> None:
    """Seeds random, numpy, torch (deterministic algorithms) and, unlike PERSIA, the embeddings:
    contexts entered afterwards push ``seed`` to the PS unless their EmbeddingConfig has one."""
    import torch

    global _embedding_seed
    _embedding_seed = _check_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


log = logging.getLogger(__name__)


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 1 << 63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return int(seed)


def embedding_seed(explicit: int | None = None) -> int:
    """The seed the PS initialises and admits embeddings with: ``explicit`` (an EmbeddingConfig's),
    else the last ``setup_seed``, else 0."""
    if explicit is not None:
        return _check_seed(explicit)
    return 0 if _embedding_seed is None else _embedding_seed


def find_free_port(port: int | None = None, interval: int = 1, *, host: str = "127.0.0.1") -> int:
    """A port nothing listens on. PERSIA's ``find_free_port(port=10000, interval=1)`` scans
    ``port, port + interval, ...``; without ``port`` the OS picks one (no scan, no race between
    tests that all start at 10000)."""
    if isinstance(port, str):  # the old find_free_port(host) call
        port, host = None, port
    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    if not 0 < int(port) <= 65535 or int(interval) < 1:
        raise ValueError(f"find_free_port: port must be in 1..65535 and interval >= 1, got port={port} interval={interval}")
    for candidate in range(int(port), 65536, int(interval)):
        if _port_is_free(host, candidate):
            return candidate
    raise RuntimeError(f"find_free_port: no free port on {host} from {port} in steps of {interval}")


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out to port-0 binds and to connects' source ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def unclaimed_ports(n: int, host: str = "127.0.0.1", taken: Collection[int] = ()) -> list[int]:
    """``n`` distinct free ports below the kernel's ephemeral range, for processes that bind them
    later. A port from a port-0 bind, closed again, can meanwhile be taken by any other port-0
    bind, or picked as a connecting socket's own source port (a client connecting early to the
    server that will listen there then connects to itself)."""
    pick = random.SystemRandom()
    top = ephemeral_port_floor() - 1
    low = 10000 if top > 11000 else 1024
    out: list[int] = []
    for _ in range(1000 * n):
        if len(out) == n:
            return out
        candidate = pick.randint(low, top)
        if candidate not in out and candidate not in taken and _port_is_free(host, candidate):
            out.append(candidate)
    raise RuntimeError(f"no {n} free ports on {host} below the ephemeral range ({low}..{top})")


def load_yaml(filepath: str) -> Any:
    """PERSIA's ``load_yaml(filepath)``; a missing file is a FileNotFoundError naming it."""
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"filepath {filepath} not found")
    with open(filepath) as f:
        return yaml.safe_load(f)


def dump_yaml(content: Any, filepath: str) -> None:
    with open(filepath, "w") as f:
        yaml.safe_dump(content, f)


def run_command(cmd: Sequence[Any], env: Mapping[str, str] | None = None) -> None:
    """PERSIA's ``run_command``: run ``cmd`` (no shell), raise ``CalledProcessError`` if it fails."""
    cmd = [str(c) for c in cmd]
    log.info("execute command: %s", cmd)
    subprocess.check_call(cmd, env=None if env is None else dict(env))


SOCKET_IFNAME_ENV = "PERSIA_SOCKET_IFNAME"


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (``SIOCGIFADDR``), None when it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _route_ipv4() -> str | None:
    """The source address of this host's default route (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return None


def _hostname_ipv4() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def choose_advertise_host(env: Mapping[str, str], bound: str, interface_ip, hostname_ip, route_ip) -> str:
    """The address other roles reach this process on (pure; the lookups are passed in):
    ``PERSIA_ADVERTISE_HOST``; else the bind address when it is one address (where we listen);
    else ``PERSIA_SOCKET_IFNAME``'s address (PERSIA's setting; an interface without an IPv4
    address is an error naming it); else the hostname's address, unless that is loopback (Debian
    maps the hostname to 127.0.1.1: peers on other hosts would connect to themselves), then the
    default route's source address; loopback only when nothing else is there."""
    host = env.get("PERSIA_ADVERTISE_HOST")
    if host:
        return host
    if bound not in ("0.0.0.0", "::"):
        return bound
    ifname = env.get(SOCKET_IFNAME_ENV)
    if ifname:
        address = interface_ip(ifname)
        if address is None:
            names = sorted(n for _, n in socket.if_nameindex())
            raise ValueError(f"{SOCKET_IFNAME_ENV}={ifname!r}: no such interface with an IPv4 address "
                             f"(interfaces here: {', '.join(names)})")
        return address
    for address in (hostname_ip(), route_ip()):
        if address is not None and not address.startswith("127."):
            return address
    return "127.0.0.1"


def advertise_host() -> str:
    """The address other roles reach this process on (``choose_advertise_host``)."""
    from persia.security import bind_address

    return choose_advertise_host(os.environ, bind_address(), interface_ipv4, _hostname_ipv4, _route_ipv4)


def report_result(**metrics: Any) -> None:
    """Print the run's headline metrics as one machine-readable line (read by the local launcher),
    with what the roles in this process add (the NN worker: its batch accounting)."""
    for extra in RESULT_EXTRAS:
        metrics = {**extra(), **metrics}
    # one write for the line and its newline: under unbuffered IO print() makes two, and the ranks
    # that share one pipe could put another line between them (the launcher could not parse it)
    sys.stdout.write(RESULT_PREFIX + json.dumps(metrics, sort_keys=True) + "\n")
    sys.stdout.flush()
