"""Serving on one machine: inference PS replicas, inference embedding workers and a model server
as processes (``make serve-demo``, the serving tests). On Kubernetes the same three roles run
as Deployments (docs/serving.md)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from persia.procs import spawn, stop_in_order
from persia.utils import dump_yaml, unclaimed_ports

HOST = "127.0.0.1"


def infer_global_config(train: dict[str, Any], ps_addresses: list[str], checkpoint: str | None) -> dict:
    """Pure: a training ``global_config`` made an inference one (job_type Infer, the PS addresses in
    replica order, the checkpoint to load). Incremental settings are kept: an inference PS with
    ``enable_incremental_update`` applies the training PS's packets from ``incremental_dir``."""
    gc = copy.deepcopy(train or {})
    common = gc.setdefault("common_config", {})
    common["job_type"] = "Infer"
    infer = {"servers": list(ps_addresses)}
    if checkpoint:
        infer["embedding_checkpoint"] = str(checkpoint)
    common["infer_config"] = infer
    return gc


class InferenceStack:
    """``num_ps`` inference PS + ``num_workers`` embedding workers + one model server."""

    def __init__(self, workdir: str | Path, embedding_config: str, train_global_config: dict,
                 model: str, checkpoint: str | None, num_ps: int = 1, num_workers: int = 1,
                 serve_flags: list[str] = (), env: dict[str, str] | None = None, log_dir: str | Path | None = None,
                 metrics_port: int | None = None):
        """``metrics_port``: PS replica i serves /metrics on ``metrics_port + i``, embedding worker j on
        ``metrics_port + num_ps + j`` (the model server's are on its HTTP port)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env, PERSIA_BIND_ADDRESS=HOST)
        for var in ("PERSIA_NATS_URL", "PERSIA_METRICS_PORT", "PERSIA_METRICS_PORT_OFFSET"):  # no NATS here
            self.env.pop(var, None)
        self._metrics_port = metrics_port
        self._next_offset = 0
        # bound seconds from now, by processes importing torch first; meanwhile the embedding
        # workers and the model server already connect to the ports of the others
        ports = unclaimed_ports(num_ps + num_workers + 2, HOST)
        ps_ports, ew_ports = ports[:num_ps], ports[num_ps:num_ps + num_workers]
        self.http_port, self.grpc_port = ports[-2:]
        gc_path = self.workdir / "global_config_infer.yml"
        dump_yaml(infer_global_config(train_global_config, [f"{HOST}:{p}" for p in ps_ports], checkpoint), str(gc_path))
        self.ew_addresses = [f"{HOST}:{p}" for p in ew_ports]
        self._logs = []
        log_dir = Path(log_dir or self.workdir)
        py = [sys.executable, "-m", "persia.launcher"]
        self.ps = [self._spawn(py + ["embedding-parameter-server", "--port", str(p), "--global-config", str(gc_path),
                                     "--replica-index", str(i), "--replica-size", str(num_ps)], log_dir / f"ps-{i}.log")
                   for i, p in enumerate(ps_ports)]
        self.workers = [self._spawn(py + ["embedding-worker", "--port", str(p), "--global-config", str(gc_path),
                                          "--embedding-config", embedding_config, "--replica-index", str(i),
                                          "--replica-size", str(num_workers)], log_dir / f"ew-{i}.log")
                        for i, p in enumerate(ew_ports)]
        argv = py + ["serve", "--model", str(model), "--http-port", str(self.http_port),
                     "--grpc-port", str(self.grpc_port),
                     "--drain-seconds", "0",  # no load balancer to take it out first: stop at once
                     *serve_flags]
        for a in self.ew_addresses:
            argv += ["--embedding-worker", a]
        self.server = self._spawn(argv, log_dir / "model-server.log")

    def _spawn(self, argv: list[str], log_path: Path) -> subprocess.Popen:
        f = open(log_path, "w")
        self._logs.append((log_path, f))
        env = dict(self.env)
        if self._metrics_port is not None and argv[3] != "serve":
            env.update(PERSIA_METRICS_PORT=str(self._metrics_port), PERSIA_METRICS_PORT_OFFSET=str(self._next_offset))
            self._next_offset += 1
        return spawn(argv, env=env, stdout=f, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p, _ in self._logs)

    def wait_ready(self, deadline_s: float = 120.0, upstream: subprocess.Popen | None = None) -> None:
        """Until the model server answers /ready. ``upstream``: the process the model comes from (an
        online training job); its exit fails the wait at once instead of after the deadline."""
        end = time.monotonic() + deadline_s
        why = "no answer"
        while time.monotonic() < end:
            for p in self.ps + self.workers + [self.server]:
                if p.poll() is not None:
                    raise RuntimeError(f"serving process {p.args[3]} exited {p.returncode}\n{self.logs()}")
            if upstream is not None and upstream.poll() is not None:
                raise RuntimeError(f"the model's source {upstream.args} exited {upstream.returncode} before the "
                                   f"model server was ready\n{self.logs()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                why = exc.read().decode(errors="replace")
            except OSError as exc:
                why = str(exc)
            time.sleep(0.2)
        raise TimeoutError(f"model server not ready after {deadline_s}s: {why}\n{self.logs()}")

    def stop(self) -> None:
        stop_in_order([[self.server], self.workers, self.ps], grace_s=10.0)
        for _, f in self._logs:
            f.close()


def post_json(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict]:
    """(status, parsed body) of a JSON POST; HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
