"""``persia-launcher serve``: flags (with ``PERSIA_SERVE_*`` env fallbacks) to a ServeConfig, then
run the model server until SIGTERM/SIGINT, and stop it gracefully: ``/ready`` fails at once, requests
are served for ``--drain-seconds`` more, those in flight then finish, and the process exits 0, all
within ``PERSIA_GRACE_PERIOD_SECONDS`` (less a second); a second signal cuts the drain short."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from persia.env import env_flag, grace_period_s, int_arg

log = logging.getLogger("persia.serving")


def _env(name: str, default=None):
    return os.environ.get(name, default)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="run a model server: jitted dense model + inference embedding workers")
    p.add_argument("--model", default=_env("PERSIA_SERVE_MODEL"),
                   help="jit_dense.pt, or a checkpoint directory (newest complete ckpt-*/jit_dense.pt); "
                        "env PERSIA_SERVE_MODEL")
    p.add_argument("--embedding-worker", action="append", default=None, dest="embedding_workers",
                   help="host:port of an inference embedding worker (repeat, or comma-separate); "
                        "env PERSIA_SERVE_EMBEDDING_WORKERS, else PERSIA's EMBEDDING_WORKER_SERVICE")
    p.add_argument("--http-port", **env_flag("PERSIA_SERVE_HTTP_PORT", int, "integer", 8080))
    p.add_argument("--grpc-port", **env_flag("PERSIA_SERVE_GRPC_PORT", int_arg(-1, 65535), "port", 8081),
                   help="-1 disables gRPC")
    p.add_argument("--max-batch-size", **env_flag("PERSIA_SERVE_MAX_BATCH_SIZE", int, "integer", 512))
    p.add_argument("--max-latency-ms", **env_flag("PERSIA_SERVE_MAX_LATENCY_MS", float, "number", 5.0))
    p.add_argument("--workers", **env_flag("PERSIA_SERVE_WORKERS", int, "integer", 2))
    p.add_argument("--model-poll-seconds", **env_flag("PERSIA_SERVE_MODEL_POLL_SECONDS", float, "number", 5.0))
    p.add_argument("--request-timeout-s", **env_flag("PERSIA_SERVE_REQUEST_TIMEOUT_S", float, "number", 30.0),
                   help="a request not answered within this is answered 504 / DEADLINE_EXCEEDED")
    p.add_argument("--http-timeout-s", **env_flag("PERSIA_SERVE_HTTP_TIMEOUT_S", float, "number", 30.0),
                   help="HTTP: the longest wait for a client (each write, a request's line and headers "
                        "altogether or an idle keep-alive connection, the whole body)")
    p.add_argument("--max-connections", **env_flag("PERSIA_SERVE_MAX_CONNECTIONS", int, "integer", 256),
                   help="HTTP connections open at once (each holds a thread); one more is answered 503 "
                        "(GET /live, /ready, /metrics: answered all the same)")
    p.add_argument("--max-bytes-in-flight", **env_flag("PERSIA_SERVE_MAX_BYTES_IN_FLIGHT", int, "integer", 256 << 20),
                   help="HTTP: request bodies read or parsed at once, in bytes; a request whose body finds no "
                        "room within a second is answered 503 before it is read")
    p.add_argument("--drain-seconds", **env_flag("PERSIA_SERVE_DRAIN_SECONDS", _seconds, "number of seconds", 5.0),
                   help="after SIGTERM: how long requests are still served while /ready fails (so the load "
                        "balancer takes the replica out first); at most half of PERSIA_GRACE_PERIOD_SECONDS")
    return p


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 86_400.0:  # NaN too
        raise ValueError(text)
    return value


def stop_budget(drain_s: float, grace_s: float) -> tuple[float, float]:
    """Pure: (drain, whole stop) seconds for a ``drain_s`` request within a ``grace_s`` grace
    period: the stop ends a second before the grace period does (the kubelet's SIGKILL), and the
    drain takes at most half of it, leaving the rest to the requests in flight."""
    whole = max(0.0, grace_s - 1.0)
    return min(drain_s, whole / 2), whole


def config_from_args(args, env=None):
    """Pure: the parsed flags as a ServeConfig (pydantic errors name the field)."""
    from persia.security import bind_address
    from persia.serving.config import ServeConfig

    from persia.service import EMBEDDING_WORKER_SERVICE_ENV, parse_services

    env = os.environ if env is None else env
    workers = args.embedding_workers or [env.get("PERSIA_SERVE_EMBEDDING_WORKERS", "")]
    addresses = [a.strip() for item in workers for a in item.split(",") if a.strip()]
    if not addresses and env.get(EMBEDDING_WORKER_SERVICE_ENV):  # PERSIA's variable (persia.service)
        addresses = parse_services(env[EMBEDDING_WORKER_SERVICE_ENV], EMBEDDING_WORKER_SERVICE_ENV)
    return ServeConfig(
        embedding_workers=addresses, model=args.model or "", http_port=args.http_port,
        grpc_port=None if args.grpc_port < 0 else args.grpc_port, host=bind_address(env),
        max_batch_size=args.max_batch_size, max_latency_ms=args.max_latency_ms, workers=args.workers,
        model_poll_seconds=args.model_poll_seconds, request_timeout_s=args.request_timeout_s,
        http_timeout_s=args.http_timeout_s, max_connections=args.max_connections,
        max_bytes_in_flight=args.max_bytes_in_flight,
    )


def run_serve(args) -> int:
    from pydantic import ValidationError

    from persia.logger import setup_logging
    from persia.serving.server import ModelServer

    setup_logging("model-server")
    if not args.model:
        raise SystemExit("persia-launcher serve: --model is required (or set PERSIA_SERVE_MODEL)")
    try:
        config = config_from_args(args)
    except ValidationError as exc:
        raise SystemExit(f"persia-launcher serve: {exc}") from None
    try:
        drain_s, whole_s = stop_budget(args.drain_seconds, grace_period_s())
    except ValueError as exc:
        raise SystemExit(f"persia-launcher serve: {exc}") from None
    stop = threading.Event()
    server = None

    def on_signal(*_):
        if stop.is_set() and server is not None:
            server.hurry()  # a second signal: no more draining
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = ModelServer(config)
    print(f"model server: HTTP {config.host}:{server.http_port} gRPC "
          f"{server.grpc_port if server.grpc_port else 'off'}", flush=True)
    # short waits: a signal the kernel delivers to another thread (gRPC's, a handler's) only runs
    # its Python handler once the main thread wakes, and a wait without a timeout never does
    while not stop.wait(0.2):
        pass
    log.info("model server stopping: draining for %gs, then in-flight requests finish (%gs in all)",
             drain_s, whole_s)
    server.stop(drain_s=drain_s, grace_s=whole_s)
    log.info("model server stopped")
    return 0
