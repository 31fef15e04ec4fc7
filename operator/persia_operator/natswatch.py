"""The I/O side of natsinfo.py: one background probe per running job.

A reconcile pass never waits on NATS: it hands the job's target (URL and credentials,
read from the job's Secret) to `NatsWatcher.observe` and gets the latest observation
back at once; a task per job connects every `interval` seconds, asks NN rank 0 for the
last checkpoint and closes. Credentials live only in this process's memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import ssl
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .natsinfo import NatsObservation, latest_subject, parse_report, redact

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NatsTarget:
    """How to reach one job's NATS. Secret fields are kept out of repr()."""

    job: str  # the job's token in its subjects (naming.subject_job)
    url: str
    user: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = field(default=None, repr=False)
    tls_ca: str | None = field(default=None, repr=False)
    tls_cert: str | None = field(default=None, repr=False)
    tls_key: str | None = field(default=None, repr=False)

    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.password, self.token, self.creds, self.tls_key) if s)


def secret_data(secret: dict[str, Any] | None) -> dict[str, str]:
    """A Secret's data, decoded (undecodable values are skipped)."""
    out: dict[str, str] = {}
    for key, value in ((secret or {}).get("data") or {}).items():
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            out[key] = base64.b64decode(value).decode()
    return out


def _tls_context(target: NatsTarget, workdir: str) -> ssl.SSLContext | None:
    if not (target.tls_ca or target.tls_cert):
        return None
    ctx = ssl.create_default_context(cadata=target.tls_ca) if target.tls_ca else ssl.create_default_context()
    if target.tls_cert and target.tls_key:
        cert, key = Path(workdir, "tls.crt"), Path(workdir, "tls.key")
        cert.write_text(target.tls_cert)
        key.touch(mode=0o600)
        key.write_text(target.tls_key)
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


async def probe(target: NatsTarget, timeout: float = 2.0) -> NatsObservation:
    """Connect once, ask for the latest checkpoint, close."""
    import nats
    import nats.errors
    from nats.aio.client import RawCredentials

    secrets = target.secrets()
    url = redact(target.url, secrets)
    now = datetime.now(UTC)

    async def quiet(_: Exception) -> None:  # nats-py would log errors, possibly with URLs
        return None

    with tempfile.TemporaryDirectory(prefix="persia-nats-") as workdir:
        options: dict[str, Any] = {
            "servers": [u if "://" in u else f"nats://{u}" for u in target.url.split(",")],
            "name": "persia-operator",
            "connect_timeout": timeout,
            "allow_reconnect": False,
            "max_reconnect_attempts": 0,
            "error_cb": quiet,
        }
        if target.user is not None:
            options.update(user=target.user, password=target.password or "")
        if target.token:
            options["token"] = target.token
        if target.creds and "BEGIN NATS USER JWT" in target.creds:
            options["user_credentials"] = RawCredentials(target.creds)
        elif target.creds:
            options["nkeys_seed_str"] = target.creds.strip()
        try:
            tls = _tls_context(target, workdir)
            if tls is not None:
                options["tls"] = tls
            nc = await asyncio.wait_for(nats.connect(**options), timeout + 1)
        except Exception as err:  # any failure to connect is reported, redacted
            return NatsObservation(False, redact(f"{type(err).__name__}: {err}".strip(), secrets), url=url, at=now)
        try:
            msg = await nc.request(latest_subject(target.job), b"{}", timeout=timeout)
            return NatsObservation(True, checkpoint=parse_report(msg.data), url=url, at=now)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
            return NatsObservation(True, url=url, at=now)  # no NN rank 0 answering (yet)
        except ValueError as err:
            return NatsObservation(True, checkpoint_error=redact(str(err), secrets), url=url, at=now)
        except Exception as err:
            return NatsObservation(False, redact(f"{type(err).__name__}: {err}", secrets), url=url, at=now)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()


class NatsWatcher:
    """Background probes keyed by (namespace, name); `observe` never blocks."""

    def __init__(self, interval: float = 10.0, timeout: float = 2.0):
        self.interval = interval
        self.timeout = timeout
        self._targets: dict[tuple[str, str], NatsTarget] = {}
        self._latest: dict[tuple[str, str], NatsObservation] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._changed: dict[tuple[str, str], asyncio.Event] = {}

    def observe(self, key: tuple[str, str], target: NatsTarget | None) -> NatsObservation | None:
        """Probe `target` from now on (None: stop); the latest observation of it."""
        if target is None:
            self.forget(key)
            return None
        if self._targets.get(key) != target:
            self._targets[key] = target
            self._latest.pop(key, None)
            self._changed.setdefault(key, asyncio.Event()).set()
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.get_running_loop().create_task(self._loop(key), name=f"nats-probe-{key}")
        return self._latest.get(key)

    def keys(self) -> set[tuple[str, str]]:
        """The jobs probed now."""
        return set(self._targets) | set(self._tasks)

    def forget(self, key: tuple[str, str]) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
        self._targets.pop(key, None)
        self._latest.pop(key, None)
        self._changed.pop(key, None)

    async def _loop(self, key: tuple[str, str]) -> None:
        changed = self._changed.setdefault(key, asyncio.Event())
        while key in self._targets:
            changed.clear()
            target = self._targets[key]
            observation = await probe(target, self.timeout)
            if self._targets.get(key) == target:
                if not observation.connected and self._latest.get(key, observation).connected:
                    log.info(f"NATS of {key[0]}/{key[1]} unreachable: {observation.error}")
                self._latest[key] = observation
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), self.interval)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for key in list(self._tasks):
            self.forget(key)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
