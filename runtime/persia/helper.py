"""PERSIA's ``persia.helper``: a whole PERSIA service for a test or a notebook, in one ``with``.

``PersiaServiceCtx`` starts an authenticated nats-server, the PS replicas and the embedding workers
as processes (local mode's roles), optionally a data-loader function and an NN-worker function in
child processes, and points this process at them, so the block can enter a ``TrainCtx`` directly::

    with PersiaServiceCtx(data_loader_func=send_batches, embedding_config={"slots_config": ...}):
        with TrainCtx(...) as ctx:
            for batch in DataLoader(StreamingDataset(10)):
                ...

Differences from PERSIA (docs/architecture.md): the functions run in forked children (no
cloudpickle; Linux, as PERSIA); the port arguments are accepted and ignored (every server takes a
free port and is found over NATS); ``__enter__`` returns once every server answers; a child or a
server that dies while the block runs interrupts the block with ``ServiceFailed`` naming it (PERSIA
raised in a watchdog thread, which nobody saw); leaving the block waits for the function children
and raises if one failed.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable, Optional

import yaml

from persia.bus import NatsBus, close_shared_bus
from persia.config import load_embedding_config, load_global_config
from persia.embedding_worker.service import discover
from persia.errors import BusyError, DiscoveryTimeout, PersiaError, PersiaValidationError
from persia.local import _FOREIGN_NATS_ENV, job_env, server_roles
from persia.nats_server import NatsServer

_DEFAULT_GLOBAL_CONFIG = {
    "embedding_worker_config": {"forward_buffer_size": 1000},
    "common_config": {"metrics_config": {"enable_metrics": False}},
}


class ServiceFailed(PersiaError):
    """A server or a function child of ``PersiaServiceCtx`` died or failed."""


def _run_child(func: Callable[[], None], env: dict[str, str]) -> None:
    from persia.data_loader import stream as loader_stream

    os.environ.update(env)
    loader_stream.reset()  # a forked child is a data-loader process of its own
    func()
    loader_stream.end_of_stream()  # multiprocessing children leave by os._exit: atexit never runs


class PersiaServiceCtx:
    """Starts PERSIA's servers (and optional data-loader / NN-worker functions) for the block."""

    def __init__(
        self,
        data_loader_func: Optional[Callable[[], None]] = None,
        nn_worker_func: Optional[Callable[[], None]] = None,
        embedding_config: Optional[dict] = None,
        embedding_config_path: Optional[str] = None,
        global_config: Optional[dict] = None,
        global_config_path: Optional[str] = None,
        data_loader_replica_num: int = 1,
        nproc_per_node: int = 1,
        embedding_worker_replica_num: int = 1,
        embedding_parameter_replica_num: int = 1,
        embedding_worker_port: int = 7777,
        embedding_parameter_server_port: int = 8888,
        nats_server_port: int = 4222,
        *,
        ready_timeout_s: float = 60.0,
        join_timeout_s: float = 60.0,
    ):
        counts = {"data_loader_replica_num": data_loader_replica_num, "nproc_per_node": nproc_per_node,
                  "embedding_worker_replica_num": embedding_worker_replica_num,
                  "embedding_parameter_replica_num": embedding_parameter_replica_num}
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PersiaValidationError(f"PersiaServiceCtx: {name} must be an integer >= 1, got {value!r}")
        if embedding_config is None and embedding_config_path is None:
            raise PersiaValidationError("PersiaServiceCtx needs embedding_config (a dict) or embedding_config_path")
        self.data_loader_func = data_loader_func
        self.nn_worker_func = nn_worker_func
        self.embedding_config, self.embedding_config_path = embedding_config, embedding_config_path
        self.global_config, self.global_config_path = global_config, global_config_path
        self.counts = counts
        self.ready_timeout_s, self.join_timeout_s = ready_timeout_s, join_timeout_s
        self.job_name = f"helper-{uuid.uuid4().hex[:8]}"
        self._tmp: str | None = None
        self._nats: NatsServer | None = None
        self._servers: dict[str, subprocess.Popen] = {}
        self._children: dict[str, multiprocessing.process.BaseProcess] = {}
        self._saved_env: dict[str, str | None] = {}
        self._failure: str | None = None
        self._in_body = False
        self._body_lock = threading.Lock()  # no interrupt is sent once __exit__ has begun
        self._main_ident: int | None = None
        self._saved_sigint = None  # the SIGINT handler the block replaced (main thread only)
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- enter --------------------------------------------------------------------------------------
    def __enter__(self) -> "PersiaServiceCtx":
        try:
            self._start()
        except BaseException:
            self._shutdown()
            raise
        self._main_ident = threading.get_ident() if threading.current_thread() is threading.main_thread() else None
        if self._main_ident is not None:  # our interrupt must not depend on the process's SIGINT handler
            self._saved_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        self._in_body = True
        self._monitor = threading.Thread(target=self._watch, name="persia-helper-watch", daemon=True)
        self._monitor.start()
        return self

    def _config_file(self, content: Optional[dict], path: Optional[str], name: str) -> str:
        if path is not None:
            return os.path.abspath(path)
        out = os.path.join(self._tmp, name)
        with open(out, "w") as f:
            yaml.safe_dump(content, f)
        return out

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="persia-helper-")
        ec = self._config_file(self.embedding_config, self.embedding_config_path, "embedding_config.yml")
        gc = self._config_file(self.global_config if self.global_config is not None else _DEFAULT_GLOBAL_CONFIG,
                               self.global_config_path, "global_config.yml")
        load_embedding_config(ec)  # a bad config fails here, naming the field, not in a server's log
        load_global_config(gc)
        self._nats = NatsServer()
        url = self._nats.start()
        env = dict(job_env(self._nats.client_env(), url, dict(os.environ)),
                   PERSIA_JOB_NAME=self.job_name, PERSIA_ADVERTISE_HOST="127.0.0.1",
                   PERSIA_BIND_ADDRESS="127.0.0.1", PERSIA_EMBEDDING_CONFIG=ec, PERSIA_GLOBAL_CONFIG=gc)
        for name in set(env) | set(_FOREIGN_NATS_ENV):
            self._saved_env[name] = os.environ.pop(name, None)
        os.environ.update(env)
        close_shared_bus()  # this process's contexts connect to the new NATS from now on
        launcher = [sys.executable, "-m", "persia.launcher"]
        for role in server_roles(launcher, dict(os.environ), self.counts["embedding_parameter_replica_num"],
                                 self.counts["embedding_worker_replica_num"]):
            self._servers[role.name] = subprocess.Popen(role.argv, env=role.env)
        self._wait_ready()
        self._start_children()

    def _wait_ready(self) -> None:
        bus = NatsBus(name=f"{self.job_name}-helper")
        try:
            deadline = time.monotonic() + self.ready_timeout_s
            for service in ("ps", "ew"):
                while True:
                    failure = self._dead_server()
                    if failure:
                        raise ServiceFailed(f"PersiaServiceCtx: {failure} while starting")
                    try:
                        discover(bus, service, deadline_s=min(2.0, max(0.1, deadline - time.monotonic())))
                        break
                    except (BusyError, DiscoveryTimeout) as exc:
                        if time.monotonic() > deadline:
                            raise ServiceFailed(f"PersiaServiceCtx: {service} servers not ready within "
                                                f"{self.ready_timeout_s:.0f}s: {exc}") from exc
        finally:
            bus.close()

    def _start_children(self) -> None:
        # fork: the functions run as they are (closures too), nothing is pickled
        mp = multiprocessing.get_context("fork")
        n = self.counts["data_loader_replica_num"]
        if self.data_loader_func is not None:
            for i in range(n):
                env = {"REPLICA_INDEX": str(i), "REPLICA_SIZE": str(n)}
                self._children[f"data-loader-{i}"] = mp.Process(target=_run_child, args=(self.data_loader_func, env),
                                                                name=f"data-loader-{i}")
        n = self.counts["nproc_per_node"]
        if self.nn_worker_func is not None:
            for rank in range(n):
                env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n)}
                self._children[f"nn-worker-{rank}"] = mp.Process(target=_run_child, args=(self.nn_worker_func, env),
                                                                 name=f"nn-worker-{rank}")
        for p in self._children.values():
            p.start()

    # -- while the block runs -------------------------------------------------------------------------
    def _dead_server(self) -> str | None:
        for name, p in self._servers.items():
            if p.poll() is not None:
                return f"server {name} exited with code {p.returncode}"
        return None

    def _failed_child(self) -> str | None:
        for name, p in self._children.items():
            if p.exitcode not in (None, 0):
                return f"{name} exited with code {p.exitcode}"
        return None

    def _on_sigint(self, signum, frame) -> None:
        """The block's SIGINT handler: our own interrupt (a failure was recorded) always raises;
        any other SIGINT goes to the handler that was there before (a user's Ctrl-C handling)."""
        prev = self._saved_sigint
        if self._failure is not None or prev in (signal.SIG_DFL, None):
            raise KeyboardInterrupt
        if callable(prev):
            prev(signum, frame)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            failure = self._dead_server() or self._failed_child()
            if failure:
                with self._body_lock:
                    self._failure = failure
                    if self._in_body and self._main_ident is not None:
                        # wakes a main thread blocked in a wait (a DataLoader, an Event) with
                        # KeyboardInterrupt, which __exit__ turns into ServiceFailed
                        signal.pthread_kill(self._main_ident, signal.SIGINT)
                return

    # -- exit ------------------------------------------------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> bool:
        late = None
        try:
            with self._body_lock:
                self._in_body = False
        except KeyboardInterrupt as interrupt:  # arrived just as the block ended: handled here
            late = interrupt
            exc_type, exc = KeyboardInterrupt, interrupt
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()
        if self._main_ident is not None:
            signal.signal(signal.SIGINT, self._saved_sigint)
        failures = [self._failure] if self._failure else []
        if exc_type is None:
            deadline = time.monotonic() + self.join_timeout_s
            for name, p in self._children.items():
                p.join(max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    failures.append(f"{name} still running {self.join_timeout_s:.0f}s after the block ended")
            failure = self._failed_child()
            if failure and failure not in failures:
                failures.append(failure)
        self._shutdown()
        if failures and (exc_type is None or exc_type is KeyboardInterrupt):
            raise ServiceFailed("PersiaServiceCtx: " + "; ".join(failures)) from exc
        if late is not None:
            raise late
        return False

    def _shutdown(self) -> None:
        for p in self._children.values():
            if p.is_alive():
                p.terminate()
        for p in self._children.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for p in self._servers.values():
            if p.poll() is None:
                p.terminate()
        for p in self._servers.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        close_shared_bus()
        if self._nats is not None:
            self._nats.stop()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def ensure_persia_service(*args, **kwargs) -> PersiaServiceCtx:
    """PERSIA's name for :class:`PersiaServiceCtx`."""
    return PersiaServiceCtx(*args, **kwargs)
