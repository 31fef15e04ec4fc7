"""The ``/metrics`` HTTP server: prometheus_client's WSGI app behind a server that bounds what a
client can hold. prometheus_client's own ``start_http_server`` starts a thread per connection and
waits on a silent client for ever: every role serves metrics, so an idle or trickling client on
the port would pile up threads in the trainer itself. Here a connection waits at most
``timeout_s`` for each read or write, and at most ``max_connections`` are served at once; one more
is answered 503 and closed."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

MAX_CONNECTIONS = 16  # a scraper or two, a curl; not a web service
TIMEOUT_S = 10.0  # per read or write on a connection
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape (prometheus_client's handler does the same)."""

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them, each with a socket timeout."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.connection_timeout_s = timeout_s
        self.refused = 0  # connections answered 503 because every slot was taken
        super().__init__(address, handler)

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return self.max_connections - self._slots._value

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        request.settimeout(self.connection_timeout_s)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        """A client that timed out or went away is not an error worth a traceback."""


def serve_metrics(addr: str, port: int, registry=None, max_connections: int = MAX_CONNECTIONS,
                  timeout_s: float = TIMEOUT_S) -> BoundedMetricsServer:
    """Bind ``addr:port`` (0: the OS picks) and serve ``registry`` (the default one) from a daemon
    thread; ``OSError`` when the port is taken."""
    from prometheus_client import REGISTRY, make_wsgi_app

    app = make_wsgi_app(REGISTRY if registry is None else registry)
    server = make_server(addr, port, app, lambda a, h: BoundedMetricsServer(a, h, max_connections, timeout_s),
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="persia-metrics-http", daemon=True).start()
    return server
