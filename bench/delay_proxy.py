"""A user-space TCP proxy on loopback that delays every byte by a fixed one-way time, for
``make bench-latency`` (the kernel's netem needs privileges this machine does not give).

Two kinds of listener, both delaying each direction of each connection by ``delay_s``:

* **forward**: every connection goes to one fixed upstream (NATS: the roles are given the
  proxy's URL instead of the server's);
* **connect**: an HTTP ``CONNECT host:port`` proxy, which gRPC uses for every channel of a process
  whose environment has ``grpc_proxy=http://127.0.0.1:<port>`` (NN worker -> embedding worker,
  embedding worker -> PS), so no address has to be rewritten. Only loopback targets are accepted.

A chunk read at time ``t`` is written at ``t + delay_s``, in order, with no bandwidth limit: a
one-way delay, as netem's ``delay`` gives. A half-close (EOF) travels like data, after what was
sent before it; a reset or error on either side closes both.

    python -m bench.delay_proxy --delay-ms 2 --forward 127.0.0.1:4222 --connect
prints ``{"connect": port, "forward": {"127.0.0.1:4222": port}}`` and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

CHUNK = 256 * 1024
MAX_CONNECT_HEAD = 8192


@dataclass
class Stats:
    connections: int = 0
    bytes_up: int = 0  # client -> upstream
    bytes_down: int = 0  # upstream -> client
    refused: int = 0  # CONNECT requests answered with an error

    def as_dict(self) -> dict[str, int]:
        return {"connections": self.connections, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "refused": self.refused}


def parse_hostport(text: str, what: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); an error names ``what`` and the value."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port with a port in 1..65535, got {text!r}")
    return host.strip("[]"), int(port)


def parse_connect_request(head: bytes) -> tuple[str, int]:
    """Target of an HTTP CONNECT request head (up to the blank line); only loopback hosts, since
    this proxy exists to delay traffic between processes of one machine."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"expected 'CONNECT host:port HTTP/1.x', got {line[:100]!r}")
    host, port = parse_hostport(parts[1], "CONNECT target")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"CONNECT target must be a loopback address, got {parts[1]!r}")
    return host, port


class _Pipe:
    """One direction of one connection: a reader thread stamps each chunk with its due time, a
    writer thread sends it then. ``None`` in the queue is the EOF, passed on as a half-close."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, count: Callable[[int], None],
                 on_done: Callable[[bool], None], clock: Callable[[], float], sleep: Callable[[float], None], name: str):
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self._count, self._on_done, self._clock, self._sleep = count, on_done, clock, sleep
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._ready = threading.Condition()
        self._stopped = False
        self.threads = [
            threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
            threading.Thread(target=self._write, name=f"{name}-write", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()

    def _put(self, data: bytes | None) -> None:
        with self._ready:
            self._queue.append((self._clock() + self.delay_s, data))
            self._ready.notify()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK)
                if not data:
                    break
                self._put(data)
        except OSError:
            self.stop()  # the writer ends and reports the failure (once per pipe)
            return
        self._put(None)

    def _write(self) -> None:
        clean = False
        try:
            while True:
                with self._ready:
                    while not self._queue and not self._stopped:
                        self._ready.wait()
                    if self._stopped:
                        return
                    due, data = self._queue.popleft()
                wait = due - self._clock()
                if wait > 0:
                    self._sleep(wait)
                if data is None:
                    self.dst.shutdown(socket.SHUT_WR)
                    clean = True
                    return
                self.dst.sendall(data)
                self._count(len(data))
        except OSError:
            clean = False
        finally:
            self._on_done(clean)


class _Connection:
    """Two pipes; both sockets are closed when both directions ended, or at once on an error."""

    def __init__(self, client: socket.socket, upstream: socket.socket, proxy: "DelayProxy"):
        self.client, self.upstream, self.proxy = client, upstream, proxy
        self._lock = threading.Lock()
        self._open = 2
        self.closed = threading.Event()
        name = f"delay-{client.fileno()}"
        common = dict(on_done=self._done, clock=proxy.clock, sleep=proxy.sleep)
        self.pipes = [
            _Pipe(client, upstream, proxy.delay_s, proxy._add_up, name=f"{name}-up", **common),
            _Pipe(upstream, client, proxy.delay_s, proxy._add_down, name=f"{name}-down", **common),
        ]

    def start(self) -> None:
        for p in self.pipes:
            p.start()

    def _done(self, clean: bool) -> None:
        with self._lock:
            self._open -= 1
            last = self._open <= 0
        if last or not clean:
            self.close()

    def close(self) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for p in self.pipes:
            p.stop()
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.proxy._forget(self)


class DelayProxy:
    """One listener on loopback. ``upstream=None`` makes it an HTTP CONNECT proxy; otherwise every
    connection is forwarded to ``upstream``. ``clock``/``sleep`` are injectable for tests."""

    def __init__(self, delay_s: float, upstream: tuple[str, int] | None = None, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if not 0 <= delay_s < 10:
            raise ValueError(f"delay_s must be in [0, 10) seconds, got {delay_s!r}")
        self.delay_s, self.upstream, self.clock, self.sleep = delay_s, upstream, clock, sleep
        self.stats = Stats()
        self._stats_lock = threading.Lock()
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self._connections: set[_Connection] = set()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name=f"delay-proxy-{self.port}", daemon=True)

    def start(self) -> "DelayProxy":
        self._acceptor.start()
        return self

    def _add_up(self, n: int) -> None:
        with self._stats_lock:
            self.stats.bytes_up += n

    def _add_down(self, n: int) -> None:
        with self._stats_lock:
            self.stats.bytes_down += n

    def _forget(self, conn: _Connection) -> None:
        with self._stats_lock:
            self._connections.discard(conn)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.upstream is None:
                target, rest = self._handshake(client)
            else:
                target, rest = self.upstream, b""
            upstream = socket.create_connection(target, timeout=10)
            upstream.settimeout(None)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ValueError) as exc:
            if self.upstream is None:
                self._refuse(client, exc)
            client.close()
            return
        if self.upstream is None:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            upstream.sendall(rest)
        conn = _Connection(client, upstream, self)
        with self._stats_lock:
            if self._closing:
                closing = True
            else:
                closing = False
                self._connections.add(conn)
                self.stats.connections += 1
        if closing:
            conn.close()
            return
        conn.start()

    def _handshake(self, client: socket.socket) -> tuple[tuple[str, int], bytes]:
        client.settimeout(10)
        head = b""
        while b"\r\n\r\n" not in head:
            data = client.recv(4096)
            if not data:
                raise ValueError("connection closed before a complete CONNECT request")
            head += data
            if len(head) > MAX_CONNECT_HEAD:
                raise ValueError(f"CONNECT request head longer than {MAX_CONNECT_HEAD} bytes")
        client.settimeout(None)
        head, rest = head.split(b"\r\n\r\n", 1)
        return parse_connect_request(head), rest

    def _refuse(self, client: socket.socket, exc: Exception) -> None:
        with self._stats_lock:
            self.stats.refused += 1
        status = "403 Forbidden" if isinstance(exc, ValueError) else "502 Bad Gateway"
        try:
            client.sendall(f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\n\r\n{exc}\n".encode())
        except OSError:
            pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection and wait for the threads."""
        with self._stats_lock:
            self._closing = True
            conns = list(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            c.close()
        self._acceptor.join(timeout_s)
        for c in conns:
            for p in c.pipes:
                for t in p.threads:
                    t.join(timeout_s)

    @property
    def open_connections(self) -> int:
        with self._stats_lock:
            return len(self._connections)


@dataclass
class ProxySet:
    """The proxies of one benchmark run: a CONNECT proxy for gRPC, forwarders for fixed upstreams."""

    delay_s: float
    connect: DelayProxy | None = None
    forward: dict[str, DelayProxy] = field(default_factory=dict)

    @classmethod
    def start(cls, delay_s: float, forward: list[str] = (), connect: bool = True) -> "ProxySet":
        ps = cls(delay_s)
        try:
            if connect:
                ps.connect = DelayProxy(delay_s).start()
            for up in forward:
                ps.forward[up] = DelayProxy(delay_s, upstream=parse_hostport(up, "--forward")).start()
        except BaseException:
            ps.close()
            raise
        return ps

    def ports(self) -> dict:
        return {"connect": self.connect.port if self.connect else None, "forward": {k: p.port for k, p in self.forward.items()}}

    def stats(self) -> dict:
        out = {"delay_ms": self.delay_s * 1e3, "forward": {k: p.stats.as_dict() for k, p in self.forward.items()}}
        if self.connect:
            out["connect"] = self.connect.stats.as_dict()
        return out

    def close(self) -> None:
        for p in [self.connect, *self.forward.values()]:
            if p is not None:
                p.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay per direction")
    p.add_argument("--forward", action="append", default=[], metavar="HOST:PORT", help="a forwarding listener to this upstream")
    p.add_argument("--connect", action="store_true", help="also an HTTP CONNECT listener (for grpc_proxy)")
    a = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        proxies = ProxySet.start(a.delay_ms / 1e3, a.forward, a.connect)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(proxies.ports()), flush=True)
    stop.wait()
    proxies.close()
    print(json.dumps(proxies.stats()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
