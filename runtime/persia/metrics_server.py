"""The ``/metrics`` HTTP server: prometheus_client's WSGI app behind a server that bounds what a
client can hold. prometheus_client's own ``start_http_server`` starts a thread per connection and
waits on a silent client for ever: every role serves metrics, so an idle or trickling client on
the port would pile up threads in the trainer itself. Here a connection waits at most
``timeout_s`` for each read or write and lasts ``deadline_s`` at most altogether (a client that
sends a byte just inside each timeout held its slot for ever), and at most ``max_connections`` are
served at once; one more is answered 503 and closed."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

MAX_CONNECTIONS = 16  # a scraper or two, a curl; not a web service
TIMEOUT_S = 10.0  # per read or write on a connection
DEADLINE_S = 30.0  # a whole connection: one scrape (request and answer)
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape (prometheus_client's handler does the same)."""

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them, each with a socket timeout."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S,
                 deadline_s: float = DEADLINE_S):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self.connections = 0  # being served now
        self.connection_timeout_s = timeout_s
        self.connection_deadline_s = deadline_s
        self.refused = 0  # connections answered 503 because every slot was taken
        self.cut = 0  # connections closed at their deadline
        super().__init__(address, handler)

    def _take_slot(self) -> bool:
        with self._lock:
            if self.connections >= self.max_connections:
                return False
            self.connections += 1
            return True

    def _give_slot(self) -> None:
        with self._lock:
            self.connections -= 1

    def process_request(self, request, client_address):
        if not self._take_slot():
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
            self._give_slot()
            raise

    def process_request_thread(self, request, client_address):
        def cut():  # its handler's next read or write fails at once, and the thread ends
            self.cut += 1
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        deadline = threading.Timer(self.connection_deadline_s, cut)
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._give_slot()

    def handle_error(self, request, client_address):
        """A client that timed out or went away is not an error worth a traceback."""


def serve_metrics(addr: str, port: int, registry=None, max_connections: int = MAX_CONNECTIONS,
                  timeout_s: float = TIMEOUT_S, deadline_s: float = DEADLINE_S) -> BoundedMetricsServer:
    """Bind ``addr:port`` (0: the OS picks) and serve ``registry`` (the default one) from a daemon
    thread; ``OSError`` when the port is taken."""
    from prometheus_client import REGISTRY, make_wsgi_app

    app = make_wsgi_app(REGISTRY if registry is None else registry)
    server = make_server(addr, port, app, lambda a, h: BoundedMetricsServer(a, h, max_connections, timeout_s, deadline_s),
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="persia-metrics-http", daemon=True).start()
    return server
