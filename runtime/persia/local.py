"""``persia-launcher local``: a whole PERSIA job as processes on this machine.

Starts a nats-server, the PS replicas, embedding workers, NN workers and data loaders; prefixes
every log line with its role; shows training progress; tears everything down on exit or Ctrl-C;
exits non-zero if any role failed. The plan (commands, env, thread budget) is a pure function so
it is tested without starting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from persia.utils import RESULT_PREFIX


@dataclass
class RoleProcess:
    name: str
    kind: str  # ps | ew | nn | dl
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def is_server(self) -> bool:
        return self.kind in ("ps", "ew")


def add_local_parser(sub) -> None:
    p = sub.add_parser("local", help="run every role of a job on this machine (starts its own nats-server)")
    p.add_argument("--nn-worker", required=True, help="NN-worker training script")
    p.add_argument("--data-loader", required=True, help="data-loader script")
    p.add_argument("--embedding-config", required=True)
    p.add_argument("--global-config", default=None)
    p.add_argument("--num-ps", "--embedding-parameter-servers", dest="num_ps", type=int, default=1)
    p.add_argument("--num-embedding-workers", "--embedding-workers", dest="num_embedding_workers", type=int, default=1)
    p.add_argument("--nproc-per-node", "--num-nn-workers", dest="nproc_per_node", type=int, default=1)
    p.add_argument("--num-data-loaders", "--data-loaders", dest="num_data_loaders", type=int, default=1)
    p.add_argument("--job-name", default="local")
    p.add_argument("--nats-max-payload", type=int, default=64 * 1024 * 1024)
    p.add_argument("--cores", type=int, default=None, help="cores to budget threads for (default: all)")
    p.add_argument("--nn-threads", type=int, default=None, help="torch threads per NN worker (default: budgeted)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--result-file", default=None, help="write the trainer's PERSIA_RESULT JSON here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every role")


def thread_budget(cores: int, nn_procs: int) -> int:
    """Torch threads per NN worker: the cores left after reserving some for the other roles.

    The PS, embedding workers and data loaders run concurrently with the NN (the pipeline overlaps
    them), and OpenMP threads that lose their core to another process spin instead of working:
    on 2 cores the adult-income example trained at 13.5k samples/s with 1 NN thread and at 2k with
    2. So a quarter of the cores (at least one) is kept for the other roles.
    """
    reserved = max(1, cores // 4) if cores > 1 else 0
    return max(1, (cores - reserved) // max(1, nn_procs))


def plan(args, python: str = sys.executable, base_env: dict[str, str] | None = None) -> list[RoleProcess]:
    for flag in ("num_ps", "num_embedding_workers", "nproc_per_node", "num_data_loaders"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("nn_worker", "data_loader", "embedding_config", "global_config"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"--{flag.replace('_', '-')} {path!r} does not exist")
    cores = args.cores or os.cpu_count() or 1
    nn_threads = args.nn_threads or thread_budget(cores, args.nproc_per_node)
    common = dict(base_env or {})
    common.update(
        PERSIA_JOB_NAME=args.job_name,
        PERSIA_ADVERTISE_HOST="127.0.0.1",
        # every listener (gRPC, metrics, DDP master) on loopback only: docs/security.md
        PERSIA_BIND_ADDRESS="127.0.0.1",
        PERSIA_EMBEDDING_CONFIG=os.path.abspath(args.embedding_config),
        OMP_NUM_THREADS="1",
        # OpenMP threads that spin while waiting steal the core another role needs right then.
        OMP_WAIT_POLICY="PASSIVE",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if args.global_config:
        common["PERSIA_GLOBAL_CONFIG"] = os.path.abspath(args.global_config)
    for kv in args.env:
        if "=" not in kv:
            raise ValueError(f"--env expects KEY=VALUE, got {kv!r}")
        k, v = kv.split("=", 1)
        common[k] = v
    for inherited in _FOREIGN_NATS_ENV:  # the local NATS has credentials of its own (run_local)
        common.pop(inherited, None)
    launcher = [python, "-m", "persia.launcher"]
    procs: list[RoleProcess] = []
    for i in range(args.num_ps):
        procs.append(RoleProcess(f"ps-{i}", "ps", launcher + [
            "embedding-parameter-server", "--port", "0", "--replica-index", str(i), "--replica-size", str(args.num_ps)],
            dict(common, REPLICA_INDEX=str(i), REPLICA_SIZE=str(args.num_ps))))
    for i in range(args.num_embedding_workers):
        procs.append(RoleProcess(f"ew-{i}", "ew", launcher + [
            "embedding-worker", "--port", "0", "--replica-index", str(i),
            "--replica-size", str(args.num_embedding_workers)],
            dict(common, REPLICA_INDEX=str(i), REPLICA_SIZE=str(args.num_embedding_workers))))
    procs.append(RoleProcess("nn", "nn", launcher + [
        "nn-worker", os.path.abspath(args.nn_worker), "--nproc-per-node", str(args.nproc_per_node),
        "--nnodes", "1", "--node-rank", "0"],
        dict(common, PERSIA_TORCH_THREADS=str(nn_threads), OMP_NUM_THREADS=str(nn_threads))))
    for i in range(args.num_data_loaders):
        procs.append(RoleProcess(f"dl-{i}", "dl", launcher + [
            "data-loader", os.path.abspath(args.data_loader), "--replica-index", str(i),
            "--replica-size", str(args.num_data_loaders)],
            dict(common, PERSIA_TORCH_THREADS="1")))
    # One metrics port per process: PERSIA_METRICS_PORT + offset (+ LOCAL_RANK for NN ranks).
    offset = 0
    for proc in procs:
        proc.env["PERSIA_METRICS_PORT_OFFSET"] = str(offset)
        offset += args.nproc_per_node if proc.kind == "nn" else 1
    return procs


_FOREIGN_NATS_ENV = ("PERSIA_NATS_URL", "PERSIA_NATS_USER", "PERSIA_NATS_PASSWORD", "PERSIA_NATS_TOKEN",
                     "PERSIA_NATS_CREDS", "PERSIA_NATS_TLS_CA", "PERSIA_NATS_TLS_CERT", "PERSIA_NATS_TLS_KEY")


def job_env(nats_env: dict[str, str], url: str, base_env: dict[str, str]) -> dict[str, str]:
    """What every role gets besides its plan: the local NATS's address and credentials, and the
    job secret (the user's ``PERSIA_JOB_SECRET`` if set, else a fresh one). Env, never argv."""
    from persia.security import new_secret

    return dict(nats_env, PERSIA_NATS_URL=url, PERSIA_JOB_SECRET=base_env.get("PERSIA_JOB_SECRET") or new_secret())


class _Output:
    """Serialises prefixed lines from many processes onto our stdout."""

    def __init__(self):
        self.lock = threading.Lock()
        self.results: list[dict] = []

    def line(self, prefix: str, text: str) -> None:
        if text.startswith(RESULT_PREFIX):
            try:
                self.results.append(json.loads(text[len(RESULT_PREFIX):]))
            except json.JSONDecodeError:
                pass
        with self.lock:
            sys.stdout.write(f"[{prefix}] {text}\n")
            sys.stdout.flush()


def _pump(proc: subprocess.Popen, prefix: str, out: _Output) -> None:
    for raw in iter(proc.stdout.readline, b""):
        out.line(prefix, raw.decode(errors="replace").rstrip("\n"))


def _stop(procs: dict[str, subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs.values():
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(args) -> int:
    from persia.nats_server import NatsServer

    try:
        roles = plan(args, base_env=dict(os.environ))
    except (ValueError, FileNotFoundError) as exc:
        print(f"persia-launcher local: {exc}", file=sys.stderr)
        return 2
    out = _Output()
    nats = NatsServer(max_payload=args.nats_max_payload)
    url = nats.start()
    secret_env = job_env(nats.client_env(), url, dict(os.environ))
    out.line("local", f"nats-server on {url} (authenticated; credentials passed to roles in env); "
                      f"starting {len(roles)} role processes")
    procs: dict[str, subprocess.Popen] = {}
    changed = threading.Event()
    interrupted = threading.Event()

    def on_signal(signum, _frame):
        interrupted.set()
        changed.set()

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    progress = _Progress(url, args.job_name, out, enabled=not args.no_progress, env=secret_env)
    t0 = time.monotonic()
    failed: list[str] = []
    try:
        for role in roles:
            env = dict(role.env, **secret_env)
            p = subprocess.Popen(role.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs[role.name] = p
            out.line("local", f"started {role.name} (pid {p.pid})")
            threading.Thread(target=_pump, args=(p, role.name, out), daemon=True).start()
            threading.Thread(target=lambda p=p: (p.wait(), changed.set()), daemon=True).start()
        progress.start()
        kinds = {r.name: r.kind for r in roles}
        while True:
            changed.wait(1.0)
            changed.clear()
            if interrupted.is_set():
                out.line("local", "interrupted: stopping every role")
                failed.append("interrupted")
                break
            for name, p in procs.items():
                code = p.poll()
                if code is not None and code != 0 and name not in failed:
                    failed.append(name)
                    out.line("local", f"{name} failed with exit code {code}")
                elif code is not None and kinds[name] in ("ps", "ew"):
                    if name not in failed:
                        failed.append(name)
                        out.line("local", f"server {name} exited unexpectedly (code {code})")
            if failed:
                break
            if procs["nn"].poll() == 0:
                loaders = [n for n, k in kinds.items() if k == "dl"]
                end = time.monotonic() + 30
                while time.monotonic() < end and any(procs[n].poll() is None for n in loaders):
                    changed.wait(0.5)
                    changed.clear()
                for n in loaders:
                    if procs[n].poll() is None:
                        out.line("local", f"{n} still running after training finished: stopping it")
                    elif procs[n].returncode != 0:
                        failed.append(n)
                break
    finally:
        progress.stop()
        _stop(procs)
        nats.stop()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    elapsed = time.monotonic() - t0
    if out.results and args.result_file:
        Path(args.result_file).write_text(json.dumps(out.results[-1], indent=2))
    if failed:
        out.line("local", f"FAILED ({', '.join(failed)}) after {elapsed:.1f}s")
        return 130 if "interrupted" in failed else 1
    summary = out.results[-1] if out.results else {}
    out.line("local", f"done in {elapsed:.1f}s; result: {json.dumps(summary, sort_keys=True)}")
    return 0


class _Progress:
    """Batches trained so far, from the NN workers' progress messages on NATS."""

    def __init__(self, url: str, job: str, out: _Output, enabled: bool = True, env: dict | None = None):
        self.url, self.job, self.out, self.enabled = url, job, out, enabled
        self.env = env or {}
        self.counts: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bus = None

    def start(self) -> None:
        if not self.enabled:
            return
        from persia.bus import NatsBus, subject
        from persia.messages import Progress
        from persia.security import NatsAuth, job_secret

        self._bus = NatsBus(self.url, name="local-progress", auth=NatsAuth.from_env(self.env),
                            secret=job_secret(self.env))
        self._bus.subscribe_events(subject("nn", "progress", job=self.job),
                                   lambda m: self.counts.__setitem__(m["rank"], m["trained"]), schema=Progress)
        self._thread = threading.Thread(target=self._render, daemon=True)
        self._thread.start()

    def _render(self) -> None:
        t0 = time.monotonic()
        last = -1
        tty = sys.stdout.isatty()
        while not self._stop.wait(2.0 if tty else 10.0):
            total = sum(self.counts.values())
            if total == last:
                continue
            last = total
            rate = total / max(1e-9, time.monotonic() - t0)
            bar = "#" * min(30, total // 10)
            self.out.line("progress", f"trained {total} batches ({rate:.1f} batch/s) {bar}")

    def stop(self) -> None:
        self._stop.set()
        if self._bus is not None:
            self._bus.close()
