"""The stand-in cluster: the API server (apiserver.py) on a loopback port in a thread of
its own, a kubeconfig for it, a `kubectl` wrapper, and the process kubelet.

`python -m e2e serve` runs it in the foreground for trying kubectl by hand.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml

from .apiserver import ApiServer

T = TypeVar("T")
KUBECTL = os.environ.get("KUBECTL", shutil.which("kubectl") or "/usr/bin/kubectl")
TOKEN = "e2e-harness-token"


class Cluster:
    """API server + kubelet, started and stopped as one (a context manager)."""

    def __init__(self, workdir: Path, kubelet: bool = True):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.loop = asyncio.new_event_loop()
        self.api: ApiServer | None = None
        self.url = ""
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="e2e-apiserver", daemon=True)
        self.kubelet: Any = None
        self._with_kubelet = kubelet

    # --- lifecycle ----------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as err:  # reported by start()
            self._error = err
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with ApiServer() as api, kmock.Server(api) as server:
            self.api = api
            self.url = f"http://127.0.0.1:{server.port}"
            for ns in ("default", "kube-system", "kube-public"):
                api.create(api.types[("", "v1", "namespaces")], None, {"metadata": {"name": ns}})
            self._ready.set()
            await self._stop.wait()
            # End the open watch streams before the server and the loop go away.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    def start(self) -> "Cluster":
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the e2e API server did not start: {self._error!r}")
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig(self.url)))
        if self._with_kubelet:
            from .kubelet import Kubelet

            self.kubelet = Kubelet(self, self.workdir / "kubelet")
            self.kubelet.start()
        return self

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- in-process access to the store (thread-safe: runs in the server's loop) ---------

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def get(self, plural: str, namespace: str | None, name: str, group: str = "", version: str = "v1") -> dict[str, Any] | None:
        assert self.api is not None
        return self.call(lambda: self.api.get(self.api.type_of(group, version, plural), namespace, name))

    def list(self, plural: str, namespace: str | None = None, group: str = "", version: str = "v1") -> list[dict[str, Any]]:
        assert self.api is not None
        return self.call(lambda: self.api.list(self.api.type_of(group, version, plural), namespace))

    # --- kubectl --------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None, timeout: float = 120) -> str:
        """Run real kubectl against this cluster; return stdout (raise with stderr on failure)."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        proc = subprocess.run([KUBECTL, *args], capture_output=True, text=True, env=env, input=stdin, timeout=timeout)
        if check and proc.returncode != 0:
            raise KubectlError(args, proc.returncode, proc.stdout, proc.stderr)
        return proc.stdout if check else proc.stdout + proc.stderr


class KubectlError(RuntimeError):
    def __init__(self, args: tuple[str, ...], code: int, stdout: str, stderr: str):
        super().__init__(f"kubectl {' '.join(args)} exited {code}:\n{stderr}{stdout}")
        self.code, self.stdout, self.stderr = code, stdout, stderr


def kubeconfig(server: str, namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server}}],
        "users": [{"name": "e2e", "user": {"token": TOKEN}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": namespace}}],
    }  # fmt: skip


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 0.2) -> T:
    """Poll `predicate` until it returns something truthy; fail naming `what` (a string,
    or a function giving one at the time of failure) after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what if isinstance(what, str) else what()}")
        time.sleep(interval)
