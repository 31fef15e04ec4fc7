"""HTTP/JSON front of the model server (stdlib ``ThreadingHTTPServer``: no new dependency).

``POST /v1/predict`` (JSON, or ``application/x-persia-batch`` = ``PersiaBatch.to_bytes()``) ->
``{"predictions": [[...], ...]}``; ``GET /ready``, ``GET /live`` (200 or 503 with a reason),
``GET /metrics`` (Prometheus text).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from persia.serving.request import RequestError, batch_from_bytes, batch_from_json
from persia.serving.answers import ServeError

BINARY_TYPES = ("application/x-persia-batch", "application/octet-stream")


def _handler(server: Any):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "persia-serving"

        def log_message(self, fmt, *args):  # access logs would drown the role's log
            pass

        def _send(self, status: int, body: dict | bytes, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
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
            self._send(200, {"predictions": out.tolist()})

        def _read_batch(self):
            raw_len = self.headers.get("Content-Length")
            if raw_len is None or not raw_len.isdigit():
                raise ServeError(411, "bad_request", "Content-Length is required", "Content-Length")
            length = int(raw_len)
            if length > server.config.max_request_bytes:
                self.close_connection = True
                raise ServeError(413, "bad_request", f"body of {length} bytes exceeds "
                                 f"{server.config.max_request_bytes}", "Content-Length")
            body = self.rfile.read(length)
            ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            try:
                if ctype == "application/json":
                    try:
                        parsed = json.loads(body)
                    except (ValueError, UnicodeDecodeError) as exc:
                        raise RequestError("body", f"not valid JSON: {exc}") from None
                    return batch_from_json(parsed)
                if ctype in BINARY_TYPES:
                    return batch_from_bytes(body)
            except RequestError as exc:
                raise ServeError(400, "bad_request", str(exc), exc.field) from None
            raise ServeError(415, "bad_request", f"Content-Type {ctype!r} is not application/json or "
                             f"{BINARY_TYPES[0]}", "Content-Type")

    return Handler


def start_http(server: Any, host: str, port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer((host, port), _handler(server))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="serve-http", daemon=True).start()
    return httpd
