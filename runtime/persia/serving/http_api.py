"""HTTP/JSON front of the model server (stdlib ``ThreadingHTTPServer``: no new dependency).

``POST /v1/predict`` (JSON, or ``application/x-persia-batch`` = ``PersiaBatch.to_bytes()``) ->
``{"predictions": [[...], ...]}`` (a value that is not finite is ``null``: JSON has no NaN);
``GET /ready``, ``GET /live`` (200 or 503 with a reason), ``GET /metrics`` (Prometheus text).

Each connection holds a thread, so clients are bounded twice. A slow client holds its thread for a
bounded time: every socket write waits at most ``http_timeout_s``; the request line and headers
must arrive within ``http_timeout_s`` of the server waiting for them (an idle keep-alive
connection is closed after it, and a client trickling its headers a byte at a time is cut off
there, not after every byte); then the body within ``http_timeout_s`` (else 408 and the
connection is closed). At most ``max_connections`` connections are open at once: another is
answered 503 (``overloaded``) and closed, so a flood of connections cannot take every thread.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from persia.serving.request import MAX_JSON_DEPTH, RequestError, batch_from_bytes, batch_from_json, json_depth_over
from persia.serving.answers import ServeError

log = logging.getLogger(__name__)

BINARY_TYPES = ("application/x-persia-batch", "application/octet-stream")
_MAX_LENGTH_DIGITS = 18  # a longer Content-Length is over any max_request_bytes (and int() stays cheap)


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

        def handle_one_request(self):
            """The request line and headers within ``timeout`` of waiting for them, altogether
            (a TimeoutError there closes the connection, in the base class)."""
            self._reader.deadline = time.monotonic() + self.timeout
            super().handle_one_request()

        def log_message(self, fmt, *args):  # access logs would drown the role's log
            pass

        def _send(self, status: int, body: dict | bytes, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: ServeError) -> None:
            body = {"error": str(err), "kind": err.kind}
            if err.field:
                body["field"] = err.field
            self._send(err.status, body)

        def do_GET(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path in ("/ready", "/live"):
                ok, why = server.ready() if path == "/ready" else server.live()
                self._send(200 if ok else 503, {"status": "ok" if ok else "unavailable", "reason": why})
            elif path == "/metrics":
                self._send(200, server.metrics.render(), "text/plain; version=0.0.4")
            else:
                self._send(404, {"error": f"no such path {path!r} (POST /v1/predict, GET /ready /live /metrics)"})

        def do_POST(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path != "/v1/predict":
                self._send(404, {"error": f"no such path {path!r} (POST /v1/predict)"})
                return
            try:
                batch = self._read_batch()
            except ServeError as err:
                server.count_refused("http", err)
                self._error(err)
                return
            try:
                out = server.predict(batch, "http")
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
            raw_len = self.headers.get("Content-Length")
            # ASCII digits only: "²" passes str.isdigit() yet int() refuses it
            if raw_len is None or not (raw_len.isascii() and raw_len.isdigit()):
                self.close_connection = True  # the body's end is unknown: the connection cannot be reused
                raise ServeError(411, "bad_request", "Content-Length is required (decimal digits)", "Content-Length")
            length = int(raw_len) if len(raw_len) <= _MAX_LENGTH_DIGITS else server.config.max_request_bytes + 1
            if length > server.config.max_request_bytes:
                self.close_connection = True
                raise ServeError(413, "bad_request", f"body of {raw_len} bytes exceeds "
                                 f"{server.config.max_request_bytes}", "Content-Length")
            body = self._read_body(length)
            ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            try:
                if ctype == "application/json":
                    if json_depth_over(body):
                        raise RequestError("body", f"not valid JSON: nested more than {MAX_JSON_DEPTH} deep")
                    try:
                        parsed = json.loads(body)
                    except (ValueError, UnicodeDecodeError) as exc:  # > 4300-digit numbers too
                        raise RequestError("body", f"not valid JSON: {exc}") from None
                    except RecursionError:
                        raise RequestError("body", "not valid JSON: nested too deeply") from None
                    return batch_from_json(parsed)
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
    """A thread per connection, at most ``max_connections`` of them: one more is answered 503 and
    closed on the accepting thread (a send that cannot block: a fresh socket's buffer is empty)."""

    daemon_threads = True

    def __init__(self, address, handler, server: Any):
        self.model_server = server
        self.max_connections = server.config.max_connections
        self._open = 0
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
                self.model_server.metrics.http_connections.set(self._open)
        if full:
            self._refuse(request)
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

    def _closed(self) -> None:
        with self._open_lock:
            self._open -= 1
            self.model_server.metrics.http_connections.set(self._open)

    def _refuse(self, request) -> None:
        err = ServeError(503, "overloaded", f"overloaded: {self.max_connections} HTTP connections open "
                         "(max_connections); retry later")
        self.model_server.count_refused("http", err)
        body = json.dumps({"error": str(err), "kind": err.kind}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)
            request.send(head + body)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-answer is not the server's error (no traceback on stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("HTTP client %s: %s", client_address, exc)
            return
        log.exception("HTTP request from %s failed", client_address)


def start_http(server: Any, host: str, port: int) -> ThreadingHTTPServer:
    httpd = _Server((host, port), _handler(server), server)
    threading.Thread(target=httpd.serve_forever, name="serve-http", daemon=True).start()
    return httpd
