"""HTTP/JSON front of the model server (stdlib ``ThreadingHTTPServer``: no new dependency).

``POST /v1/predict`` (JSON, or ``application/x-persia-batch`` = ``PersiaBatch.to_bytes()``) ->
``{"predictions": [[...], ...]}`` (a value that is not finite is ``null``: JSON has no NaN);
``GET /ready``, ``GET /live`` (200 or 503 with a reason), ``GET /metrics`` (Prometheus text).

Each connection holds a thread, so clients are bounded twice. A slow client holds its thread for a
bounded time: every socket write waits at most ``http_timeout_s``; the request line and headers
must arrive within ``http_timeout_s`` of the server waiting for them (an idle keep-alive
connection is closed after it, and a client trickling its headers a byte at a time is cut off
there, not after every byte); then the body within ``http_timeout_s`` (else 408 and the
connection is closed). At most ``max_connections`` connections are open at once: another goes to
the probe lane (``_ProbeLane``): one thread that reads every such connection's request head without
blocking, answers ``GET /live``, ``/ready`` and ``/metrics`` (so a full pool, or a slowloris holding
it, never fails the kubelet's probes) and anything else 503 (``overloaded``), then closes it.

Framing (RFC 9112 section 6.3): the body is delimited by one Content-Length only. A request with
Transfer-Encoding (not implemented), more than one Content-Length, or a malformed header line (e.g.
whitespace before a header's colon, which the parser would skip with every header after it) is answered 400 and the connection closed; a Content-Length that is not ASCII digits 411 and
closed. Every answer either reads the declared body (a body on a request that takes none, up to
``_DISCARD_MAX`` bytes, is read and dropped) or closes the connection, so a body is never read as
the next request. A connection closed with input unread is shut for writing first and its input
read and dropped for up to a second (a lingering close), so the client reads the answer instead of
a reset.
"""

from __future__ import annotations

import io
import json
import logging
import select
import selectors
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from persia.serving.request import RequestError, batch_from_bytes, batch_from_json, parse_json
from persia.serving.answers import ServeError

log = logging.getLogger(__name__)

BINARY_TYPES = ("application/x-persia-batch", "application/octet-stream")
_MAX_LENGTH_DIGITS = 18  # a longer Content-Length is over any max_request_bytes (and int() stays cheap)
_DISCARD_MAX = 64 << 10  # a body on a request that takes none: read and dropped up to this, else close
_LINGER_S = 1.0  # a connection closed with input unread: how long that input is read and dropped first
PROBE_PATHS = ("/live", "/ready", "/metrics")
BODY_BUDGET_WAIT_S = 1.0  # a body that finds no room in --max-bytes-in-flight this long is answered 503
_PROBE_HEAD_MAX = 8 << 10  # a probe's request head; a longer one is refused
_PROBE_HEAD_S = 1.0  # a connection over max_connections has this long (at most) to send its request head
_PROBE_LANE_MAX = 256  # connections the probe lane holds at once; one more refuses the oldest
_PROBE_ANSWERS_MAX = 32  # probe answers waiting for a thread; more are refused
_NEW_CONN_GRACE_S = 2.0  # stopping: a connection that has sent no request yet has this long to send one


def probe_answer(server: Any, path: str) -> tuple[int, bytes, str]:
    """(status, body, content type) of ``GET /live``, ``/ready`` or ``/metrics``."""
    if path == "/metrics":
        return 200, server.metrics.render(), "text/plain; version=0.0.4"
    ok, why = server.ready() if path == "/ready" else server.live()
    body = json.dumps({"status": "ok" if ok else "unavailable", "reason": why}).encode()
    return (200 if ok else 503), body, "application/json"


def _raw_answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 503: "Service Unavailable"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def linger_close(sock: socket.socket, seconds: float) -> None:
    """Shut ``sock`` for writing, then read and drop its input until the peer closes or ``seconds``
    pass: closing with input unread would send a reset, which can destroy the answer just sent
    before the peer reads it."""
    try:
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:  # TimeoutError included: the time is up
        pass


def predictions_json(out: np.ndarray) -> list:
    """Output rows as JSON values: a value that is not finite becomes None (JSON has no NaN)."""
    rows = out.tolist()
    if np.isfinite(out).all():
        return rows
    mask = np.isfinite(out).tolist()
    if out.ndim == 1:
        return [v if ok else None for v, ok in zip(rows, mask)]
    return [[v if ok else None for v, ok in zip(r, m)] for r, m in zip(rows, mask)]


class DeadlineReader(io.RawIOBase):
    """A socket's reads, all due by ``deadline`` (a monotonic time; None: each read within the
    socket's own timeout): every ``recv`` waits only what is left, so a peer sending a byte at a
    time gets no more time than one sending everything at once."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock, self.timeout_s = sock, timeout_s
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            return self.sock.recv_into(buffer)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(min(left, self.timeout_s))
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.timeout_s)  # writes keep the full timeout


def _handler(server: Any):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "persia-serving"
        timeout = server.config.http_timeout_s  # StreamRequestHandler sets it on the socket

        def setup(self):
            super().setup()
            self.rfile.close()  # the plain socket file: reads go through the deadline instead
            self._reader = DeadlineReader(self.connection, self.timeout)
            self.rfile = io.BufferedReader(self._reader)
            self._linger = False  # closing with the request's body (maybe) unread
            self._t0: float | None = None
            self._length: int | None = None
            self.httpd: _Server = self.server
            self.httpd.opened(self)

        def finish(self):
            try:
                super().finish()
                if self.close_connection and self._linger:
                    linger_close(self.connection, min(self.timeout, _LINGER_S))
            finally:
                self.httpd.forget(self)

        def send_error(self, code, message=None, explain=None):
            self._linger = True  # the base class's refusals close the connection, the request maybe unread
            super().send_error(code, message, explain)

        def handle_one_request(self):
            """The request line and headers within ``timeout`` of waiting for them, altogether
            (a TimeoutError there closes the connection, in the base class)."""
            self._reader.deadline = time.monotonic() + self.timeout
            self._t0 = None
            try:
                super().handle_one_request()
            finally:
                if self._t0 is not None:
                    self.httpd.request_done(self)

        def parse_request(self) -> bool:
            """The request line has been read: the request's clock starts (its latency and its
            ``request_timeout_s`` count from here, body and parsing included); then its headers,
            and its framing is checked before anything else is read."""
            self._t0 = time.monotonic()
            self.httpd.request_started(self)
            if not super().parse_request():
                return False
            try:
                self._length = self._framing()
            except ServeError as err:
                self.close_connection = True
                self._linger = True
                server.count_refused("http", err)
                self._error(err)
                return False
            return True

        def _framing(self) -> int | None:
            """The declared body length (None: no Content-Length); raises ServeError (the caller
            closes the connection) on framing it cannot trust (RFC 9112 section 6.3)."""
            if self.headers.defects or self.headers.get_payload():
                # a line that is no header (``Transfer-Encoding : chunked``, with a space before the
                # colon): the parser would drop it and every header after it without a word
                raise ServeError(400, "bad_request", "malformed header section (a line that is not "
                                 "name: value, or whitespace before a colon)", "headers")
            for name in self.headers:
                if name != name.strip() or " " in name or "\t" in name:
                    raise ServeError(400, "bad_request", f"whitespace in header name {name!r}", name.strip())
            if self.headers.get_all("Transfer-Encoding"):
                raise ServeError(400, "bad_request", "Transfer-Encoding is not supported: send the body with "
                                 "a Content-Length", "Transfer-Encoding")
            lengths = self.headers.get_all("Content-Length") or []
            if len(lengths) > 1 or any("," in v for v in lengths):
                raise ServeError(400, "bad_request", "more than one Content-Length", "Content-Length")
            if not lengths:
                return None
            raw_len = lengths[0].strip(" \t")
            # ASCII digits only: "\u00b2" passes str.isdigit() yet int() refuses it
            if not (raw_len.isascii() and raw_len.isdigit()):
                raise ServeError(411, "bad_request", "Content-Length must be decimal digits", "Content-Length")
            return int(raw_len) if len(raw_len) <= _MAX_LENGTH_DIGITS else server.config.max_request_bytes + 1

        def log_message(self, fmt, *args):  # access logs would drown the role's log
            pass

        def _send(self, status: int, body: dict | bytes, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=False).encode()
            if self.httpd.draining:  # stopping: the client reconnects (to another replica)
                self.close_connection = True
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: ServeError) -> None:
            body = {"error": str(err), "kind": err.kind}
            if err.field:
                body["field"] = err.field
            self._send(err.status, body)

        def _discard_body(self) -> None:
            """A body on a request that takes none: read and dropped (up to ``_DISCARD_MAX``
            bytes), or the connection closes after the answer; never read as the next request."""
            if not self._length:
                return
            if self._length > _DISCARD_MAX:
                self.close_connection = True
                self._linger = True
                return
            try:
                self._read_body(self._length)
            except ServeError:  # it did not arrive: _read_body closes the connection
                pass

        def do_GET(self):  # noqa: N802
            self._discard_body()
            path = self.path.split("?", 1)[0]
            if path in PROBE_PATHS:
                self._send(*probe_answer(server, path))
            else:
                self._send(404, {"error": f"no such path {path!r} (POST /v1/predict, GET /ready /live /metrics)"})

        def do_POST(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path != "/v1/predict":
                self._discard_body()
                self._send(404, {"error": f"no such path {path!r} (POST /v1/predict)"})
                return
            try:
                if self.httpd.refusing:  # stopping, past the drain: a new request is not started
                    self.close_connection = True
                    self._linger = True
                    raise ServeError(503, "unavailable", "the model server is stopping; retry on another replica")
                batch = self._read_batch()
            except ServeError as err:
                server.count_refused("http", err)
                self._error(err)
                return
            try:
                out = server.predict(batch, "http", started=self._t0)
            except ServeError as err:
                self._error(err)
                return
            self._send(200, {"predictions": predictions_json(out)})

        def _read_body(self, length: int) -> bytes:
            """``length`` bytes within ``http_timeout_s`` altogether (a client trickling its body
            a byte at a time would restart a per-read timeout forever)."""
            self._reader.deadline = time.monotonic() + self.timeout
            chunks, got = [], 0
            try:
                while got < length:
                    chunk = self.rfile.read1(min(length - got, 1 << 20))
                    if not chunk:
                        self.close_connection = True
                        raise ServeError(400, "bad_request", f"the body ended after {got} of {length} bytes",
                                         "body")
                    chunks.append(chunk)
                    got += len(chunk)
            except TimeoutError:
                self.close_connection = True
                raise ServeError(408, "bad_request", f"the body did not arrive within {self.timeout:g} s "
                                 f"({got} of {length} bytes)", "body") from None
            return b"".join(chunks)

        def _read_batch(self):
            length = self._length  # checked by _framing
            if length is None:
                self.close_connection = True  # the body's end is unknown: the connection cannot be reused
                self._linger = True
                raise ServeError(411, "bad_request", "Content-Length is required (decimal digits)", "Content-Length")
            if length > server.config.max_request_bytes:
                self.close_connection = True
                self._linger = True
                shown = self.headers.get("Content-Length", "").strip()
                raise ServeError(413, "bad_request", f"body of {shown} bytes exceeds "
                                 f"{server.config.max_request_bytes}", "Content-Length")
            if not server.body_budget.reserve(length, min(self.timeout, BODY_BUDGET_WAIT_S)):
                self.close_connection = True
                self._linger = True
                raise ServeError(503, "overloaded", f"overloaded: {server.body_budget.capacity} bytes of request "
                                 f"bodies are being read or parsed (--max-bytes-in-flight); retry")
            try:
                return self._parse(self._read_body(length))
            finally:
                server.body_budget.release(length)

        def _parse(self, body: bytes):
            ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            try:
                if ctype == "application/json":
                    with server.json_parsing:  # one at a time: a parse takes ~20x its body in memory
                        return batch_from_json(parse_json(body))
                if ctype in BINARY_TYPES:
                    return batch_from_bytes(body)
            except RequestError as exc:
                raise ServeError(400, "bad_request", str(exc), exc.field) from None
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                # a parse failure the checks above missed: still the body's fault, never a dropped connection
                log.warning("unexpected parse failure (answered 400): %s: %s", type(exc).__name__, exc)
                raise ServeError(400, "bad_request", f"body: cannot parse: {type(exc).__name__}: {exc}",
                                 "body") from None
            raise ServeError(415, "bad_request", f"Content-Type {ctype!r} is not application/json or "
                             f"{BINARY_TYPES[0]}", "Content-Type")

    return Handler


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; one more goes to the probe
    lane. Stopping (``ModelServer.stop``): ``drain()`` (answers close their connection), then
    ``stop_accepting()``, ``refuse_new_requests()`` (and idle connections closed) and
    ``wait_requests()`` for those in flight."""

    daemon_threads = True

    def __init__(self, address, handler, server: Any):
        self.model_server = server
        self.max_connections = server.config.max_connections
        # the listen backlog: socketserver's 5 dropped the SYNs of a burst of clients (retried 1 s,
        # 3 s, ... later); the kernel caps it at net.core.somaxconn
        self.request_queue_size = max(1024, self.max_connections)
        self._open = 0
        self._open_lock = threading.Lock()
        self._conns: dict[Any, _Conn] = {}  # handler -> its connection's state
        self._changed = threading.Condition(self._open_lock)
        self._refusing_at = 0.0
        self.draining = False  # answers carry Connection: close
        self.refusing = False  # a new prediction is answered 503 (stopping)
        super().__init__(address, handler)
        self.probe_lane = _ProbeLane(self)

    # -- connections and requests (the handler's calls)

    def opened(self, handler) -> None:
        with self._open_lock:
            self._conns[handler] = _Conn(time.monotonic())

    def request_started(self, handler) -> None:
        with self._open_lock:
            self._conns[handler].busy = True

    def request_done(self, handler) -> None:
        with self._open_lock:
            conn = self._conns[handler]
            conn.busy, conn.served = False, conn.served + 1
            self._changed.notify_all()

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
                self.model_server.metrics.http_connections.set(self._open)
        if full:
            self.probe_lane.add(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed()

    def forget(self, handler) -> None:
        with self._open_lock:
            self._conns.pop(handler, None)
            self._changed.notify_all()

    def _closed(self) -> None:
        with self._open_lock:
            self._open -= 1
            self.model_server.metrics.http_connections.set(self._open)
            self._changed.notify_all()

    def refuse(self, request) -> None:
        """Answer 503 (overloaded) on a connection over ``max_connections`` and close it, on the
        calling thread (a send that cannot block)."""
        err = ServeError(503, "overloaded", f"overloaded: {self.max_connections} HTTP connections open "
                         "(max_connections); retry later")
        self.model_server.count_refused("http", err)
        try:
            request.setblocking(False)
            request.send(_raw_answer(503, json.dumps({"error": str(err), "kind": err.kind}).encode()))
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    # -- stopping

    def drain(self) -> None:
        self.draining = True

    def stop_accepting(self) -> None:
        """Stop the accept loop, serve the connections already waiting in the backlog (they get an
        answer, not a reset), close the listening socket and the probe lane."""
        self.shutdown()
        try:
            # a backlog of (nearly) none: a client connecting from now on has its SYN dropped and
            # finds the port closed when it retries, instead of being queued and then reset by
            # the close (a connection can still slip in between the last accept and the close)
            self.socket.listen(0)
            self.socket.setblocking(False)
            while True:
                try:
                    request, client_address = self.socket.accept()
                except (BlockingIOError, InterruptedError):
                    break
                request.setblocking(True)
                self.process_request(request, client_address)
        except OSError as exc:
            log.debug("HTTP backlog at stop: %s", exc)
        self.socket.close()
        self.probe_lane.stop()

    def refuse_new_requests(self) -> None:
        """From now on a new prediction on an open connection is answered 503 (stopping)."""
        with self._open_lock:
            self.refusing = True
            self._refusing_at = time.monotonic()

    def _close_idle(self) -> None:
        """Close the connections idle between requests: a kept-alive one at once, one that has not
        sent a request yet once it is ``_NEW_CONN_GRACE_S`` old (counted from the refusal's start:
        its client may be sending its request right now). One with input waiting is left to read
        it (and answer 503)."""
        now = time.monotonic()
        with self._open_lock:
            idle = [h for h, c in self._conns.items() if not c.busy and not c.shut and
                    (c.served or now - max(c.opened_at, self._refusing_at) >= _NEW_CONN_GRACE_S)]
        for handler in idle:
            sock = handler.connection
            try:
                poll = select.poll()
                poll.register(sock, select.POLLIN)
                if poll.poll(0):
                    continue
                sock.shutdown(socket.SHUT_RDWR)  # its thread's read returns: the connection ends
            except (OSError, ValueError):
                pass
            with self._open_lock:
                if handler in self._conns:
                    self._conns[handler].shut = True

    def wait_requests(self, end: float) -> bool:
        """Until every connection has closed (requests in flight answered, idle connections closed
        by ``_close_idle``), or ``end`` (monotonic); whether all have. Counted by their threads, not
        by the handlers: one accepted whose thread has not started yet counts too."""
        while True:
            self._close_idle()
            with self._changed:
                if self._open == 0:
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))

    def server_close(self) -> None:
        super().server_close()
        self.probe_lane.stop()

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-answer is not the server's error (no traceback on stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("HTTP client %s: %s", client_address, exc)
            return
        log.exception("HTTP request from %s failed", client_address)


class _Conn:
    __slots__ = ("busy", "opened_at", "served", "shut")

    def __init__(self, opened_at: float):
        self.opened_at, self.busy, self.served, self.shut = opened_at, False, 0, False


class _Pending:
    __slots__ = ("buf", "deadline", "lingering", "sock")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.buf, self.deadline, self.lingering = sock, b"", deadline, False


class _ProbeLane:
    """Connections over ``max_connections``: one thread reads each one's request head without
    blocking (all of them at once, ``_PROBE_HEAD_S`` each at most). ``GET /live``, ``/ready`` and
    ``/metrics`` are answered (on one of two threads: ``/ready`` may wait on the embedding
    workers); anything else, a head that does not come in time, or the oldest connection when
    ``_PROBE_LANE_MAX`` are held, is answered 503 (``overloaded``). Every answer closes the
    connection (lingering). Ordinary clients cannot exhaust it: it holds no thread per connection,
    a connection stays at most ``_PROBE_HEAD_S``, and a new one displaces the oldest."""

    def __init__(self, httpd: _Server):
        self.httpd = httpd
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._inbox: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()
        self._answers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="serve-http-probe")
        self._answers_waiting = 0
        self._stopped = False
        self._head_s = min(httpd.model_server.config.http_timeout_s, _PROBE_HEAD_S)
        self._thread = threading.Thread(target=self._loop, name="serve-http-probes", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            if self._stopped:
                self.httpd.refuse(sock)
                return
            self._inbox.append(sock)
        try:
            self._wake_w.send(b"x")
        except OSError:  # the wake-up pipe is full: the loop is awake anyway
            pass

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)
        self._answers.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopped:
                        break
                now = time.monotonic()
                timeout = max(0.0, min((p.deadline for p in self._pending.values()), default=now + 1.0) - now)
                for key, _ in self._sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        self._take_inbox()
                    else:
                        self._readable(key.data)
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline <= now]:
                    if p.lingering:
                        self._close(p)
                    else:
                        self._overloaded(p)
        except Exception:  # the lane must not die silently
            log.exception("HTTP probe lane failed")
        finally:
            with self._lock:
                self._stopped = True
                late, self._inbox = self._inbox, []
            for p in list(self._pending.values()):
                self._close(p)
            for sock in late:
                sock.close()
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _take_inbox(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            new, self._inbox = self._inbox, []
        for sock in new:
            try:
                sock.setblocking(False)
                p = _Pending(sock, time.monotonic() + self._head_s)
                self._sel.register(sock, selectors.EVENT_READ, p)
            except (OSError, ValueError):
                sock.close()
                continue
            self._pending[sock] = p
            if len(self._pending) > _PROBE_LANE_MAX:  # the oldest makes room
                oldest = next(iter(self._pending.values()))
                if oldest.lingering:
                    self._close(oldest)
                else:
                    self._overloaded(oldest)

    def _readable(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(p)
            return
        if p.lingering:
            return
        p.buf += data
        head_end = p.buf.find(b"\r\n\r\n")
        if head_end < 0:
            if len(p.buf) > _PROBE_HEAD_MAX:
                self._overloaded(p)
            return
        path = self._probe_path(p.buf[:head_end])
        if path is None:
            self._overloaded(p)
            return
        with self._lock:
            full = self._answers_waiting >= _PROBE_ANSWERS_MAX
            if not full:
                self._answers_waiting += 1
        if full:
            self._overloaded(p)
            return
        self._unregister(p)
        self._answers.submit(self._answer, p.sock, path)

    @staticmethod
    def _probe_path(head: bytes) -> str | None:
        """The path of a bodiless ``GET /live|/ready|/metrics``, else None."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or parts[0] != "GET" or not parts[2].startswith("HTTP/1."):
            return None
        path = parts[1].split("?", 1)[0]
        if path not in PROBE_PATHS:
            return None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.lower()
            if name == "transfer-encoding" or (name == "content-length" and value.strip() != "0"):
                return None
        return path

    def _answer(self, sock: socket.socket, path: str) -> None:
        try:
            status, body, ctype = probe_answer(self.httpd.model_server, path)
            sock.settimeout(self._head_s + 1.0)
            sock.sendall(_raw_answer(status, body, ctype))
        except Exception as exc:  # noqa: BLE001
            log.debug("HTTP probe over max_connections: %s", exc)
        finally:
            with self._lock:
                self._answers_waiting -= 1
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _overloaded(self, p: _Pending) -> None:
        """503 (overloaded), then linger: the request's unread rest is read and dropped."""
        err = ServeError(503, "overloaded", f"overloaded: {self.httpd.max_connections} HTTP connections open "
                         "(max_connections); retry later")
        self.httpd.model_server.count_refused("http", err)
        try:
            p.sock.send(_raw_answer(503, json.dumps({"error": str(err), "kind": err.kind}).encode()))
            p.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(p)
            return
        p.lingering, p.buf = True, b""
        p.deadline = time.monotonic() + _LINGER_S
        self._pending.move_to_end(p.sock)

    def _unregister(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def _close(self, p: _Pending) -> None:
        self._unregister(p)
        p.sock.close()


def start_http(server: Any, host: str, port: int) -> ThreadingHTTPServer:
    httpd = _Server((host, port), _handler(server), server)
    threading.Thread(target=httpd.serve_forever, name="serve-http", daemon=True).start()
    return httpd
