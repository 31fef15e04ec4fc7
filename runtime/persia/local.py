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
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from persia.context import torch_threads_setting
from persia.env import MAX_GRACE_S, env_flag, grace_period_s, int_arg, number_in_range
from persia.errors import PersiaValidationError
from persia.metrics import metrics_port
from persia.nats_server import MAX_PAYLOAD_LIMIT
from persia.nn_worker.cpu_placement import ENV as TRAINING_CPUS_ENV, format_cpus
from persia.procs import spawn, stop_in_order
from persia.supervisor import Action, decide, describe_exit
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
    p.add_argument("--job-name", default="local", type=_job_name_arg)
    p.add_argument("--colocate-ps", action="store_true",
                   help="run PS replica i inside embedding worker i's process and call it without gRPC "
                        "(needs --num-ps == --num-embedding-workers; docs/benchmarks.md, item 3)")
    p.add_argument("--nats-max-payload", type=int_arg(1, MAX_PAYLOAD_LIMIT), default=MAX_PAYLOAD_LIMIT,
                   help=f"the nats-server's max_payload in bytes (default and most {MAX_PAYLOAD_LIMIT})")
    p.add_argument("--nats-url", default=None,
                   help="use this NATS server instead of starting one (a shared server, or a proxy in front of "
                        "one); its credentials come from this process's PERSIA_NATS_* environment")
    p.add_argument("--cores", type=int_arg(1), default=None, help="cores to budget threads for (default: all)")
    p.add_argument("--nn-threads", type=_nn_threads_arg, default=None,
                   help="torch threads per NN worker (default 'auto': start with its share of the cores, measure "
                        "the counts in training and keep the fastest)")
    p.add_argument("--cpu-placement", choices=("auto", "off"), default="auto",
                   help="auto (default): with more CPUs than NN ranks, each rank's training thread gets a CPU of "
                        "its own while it trains on one torch thread, and every other thread of every role runs on "
                        "the other CPUs (PERSIA_TRAINING_CPUS); off: the kernel places every thread")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--result-file", default=None, help="write the trainer's PERSIA_RESULT JSON here")
    p.add_argument("--max-restarts", **env_flag("PERSIA_MAX_RESTARTS", int_arg(0), "integer", 3),
                   help="whole-job restarts after a role is killed or a server exits (default 3; "
                        "each restart resumes from the latest checkpoint)")
    p.add_argument("--grace-period", type=_grace_period_arg, default=None,
                   help="seconds roles get to shut down on SIGTERM (default PERSIA_GRACE_PERIOD_SECONDS or 30)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every role")


def _grace_period_arg(text: str) -> float:
    """Seconds from 0 to a day, as ``PERSIA_GRACE_PERIOD_SECONDS`` takes them."""
    value = number_in_range(text, 0, MAX_GRACE_S)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be a number of seconds from 0 to {MAX_GRACE_S:g}, got {text!r}")
    return value


def _job_name_arg(text: str) -> str:
    from persia.bus import checked_job_name

    try:
        return checked_job_name(text, "--job-name")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nn_threads_arg(text: str) -> int | str:
    """A count, or ``auto`` / ``auto:N`` as given (``PERSIA_TORCH_THREADS``'s own parser checks it)."""
    try:
        threads, measure = torch_threads_setting(text, cores=1, local_procs=1, name="--nn-threads")
    except PersiaValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().lower() if measure else threads


def nn_thread_env(nn_threads: int | str | None, cores: int, nn_procs: int) -> dict[str, str]:
    """The NN worker's torch threads: a fixed count, or (the default, ``auto``) its share of the
    cores to start with, and the count that trains fastest kept (``persia.nn_worker.thread_tuning``).

    Every role gets ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads that spin while they wait take the
    core another role needs (on 2 cores a spinning 2-thread NN worker trained the adult-income
    example at 2k samples/s against 13.5k with one thread). Passive waiting has its own price where
    waking a thread on another core is slow, which is why the count is measured, not guessed.
    """
    if nn_threads is None or nn_threads == "auto":
        share = max(1, cores // max(1, nn_procs))
        return {"PERSIA_TORCH_THREADS": f"auto:{share}", "OMP_NUM_THREADS": str(share)}
    if isinstance(nn_threads, str):  # auto:N
        start, _ = torch_threads_setting(nn_threads, cores, nn_procs)
        return {"PERSIA_TORCH_THREADS": nn_threads, "OMP_NUM_THREADS": str(start)}
    return {"PERSIA_TORCH_THREADS": str(nn_threads), "OMP_NUM_THREADS": str(nn_threads)}


@dataclass(frozen=True)
class CpuSplit:
    """The launcher's CPU placement: one CPU per NN rank's training thread, the rest for every
    other thread (``persia.nn_worker.cpu_placement``)."""

    training: tuple[int, ...]
    rest: frozenset[int]


def cpu_split(allowed: list[int] | set[int], nn_ranks: int, setting: str = "auto") -> tuple[CpuSplit | None, str]:
    """Which CPUs the NN ranks' training threads get, and why (pure): the lowest ``nn_ranks`` of
    the CPUs this launcher may use, when at least one is left for everything else."""
    cpus = sorted(set(allowed))
    if setting == "off":
        return None, "off (--cpu-placement off): the kernel places every thread"
    if setting != "auto":
        raise ValueError(f"--cpu-placement must be auto or off, got {setting!r}")
    if len(cpus) <= nn_ranks:
        return None, (f"not placed: {len(cpus)} CPU(s) for {nn_ranks} NN rank(s) leave none for the other "
                      f"roles; the kernel places every thread")
    split = CpuSplit(tuple(cpus[:nn_ranks]), frozenset(cpus[nn_ranks:]))
    owners = ", ".join(f"rank {r} on CPU {c}" for r, c in enumerate(split.training))
    return split, (f"training threads ({owners}) on CPUs of their own while they train on one torch thread; "
                   f"every other thread on CPUs {format_cpus(split.rest)}")


def _loopback_gloo() -> dict[str, str]:
    """DDP's gloo pairs listen on the interface named here (else the hostname's address)."""
    import socket

    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return {"GLOO_SOCKET_IFNAME": "lo"} if "lo" in names else {}


def plan(args, python: str = sys.executable, base_env: dict[str, str] | None = None,
         split: CpuSplit | None = None) -> list[RoleProcess]:
    for flag in ("num_ps", "num_embedding_workers", "nproc_per_node", "num_data_loaders"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("nn_worker", "data_loader", "embedding_config", "global_config"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"--{flag.replace('_', '-')} {path!r} does not exist")
    cores = args.cores or os.cpu_count() or 1
    nn_env = nn_thread_env(args.nn_threads, cores, args.nproc_per_node)
    if split is not None:
        nn_env[TRAINING_CPUS_ENV] = ",".join(str(c) for c in split.training)
    common = dict(base_env or {})
    for inherited in _RANK_ENV:  # the launcher's own shell's ranks: each role gets its own below
        common.pop(inherited, None)
    # one run across the job's restarts: each resumes from this run's newest checkpoint, whatever
    # PERSIA_RESUME says (checkpoint_plan.resume_choice); kept when the caller sets one
    common.setdefault("PERSIA_RUN_ID", uuid.uuid4().hex)
    common.update(
        PERSIA_JOB_NAME=args.job_name,
        PERSIA_ADVERTISE_HOST="127.0.0.1",
        # every listener (gRPC, metrics, DDP master) on loopback only: docs/security.md
        PERSIA_BIND_ADDRESS="127.0.0.1",
        **_loopback_gloo(),
        PERSIA_EMBEDDING_CONFIG=os.path.abspath(args.embedding_config),
        OMP_NUM_THREADS="1",
        # OpenMP threads that spin while waiting steal the core another role needs right then.
        OMP_WAIT_POLICY="PASSIVE",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PERSIA_EXIT_WITH_PARENT="1",  # servers also poll for the launcher (persia.launcher)
    )
    grace = getattr(args, "grace_period", None)
    if grace is not None:  # --grace-period: the NN rank's SIGTERM watchdog, the nn launcher's own stop
        common["PERSIA_GRACE_PERIOD_SECONDS"] = f"{grace:g}"
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
    procs = server_roles(launcher, common, args.num_ps, args.num_embedding_workers,
                         colocate_ps=getattr(args, "colocate_ps", False))
    procs.append(RoleProcess("nn", "nn", launcher + [
        "nn-worker", os.path.abspath(args.nn_worker), "--nproc-per-node", str(args.nproc_per_node),
        "--nnodes", "1", "--node-rank", "0"],
        dict(common, **nn_env)))
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


def server_roles(launcher: list[str], common: dict[str, str], num_ps: int, num_ew: int,
                 colocate_ps: bool = False) -> list[RoleProcess]:
    """The PS replicas and embedding workers, on free ports (also used by ``persia.helper``).
    ``colocate_ps``: embedding worker i runs PS replica i in its own process (one process per pair,
    :mod:`persia.embedding_worker.colocated`), which needs as many workers as replicas."""
    if colocate_ps:
        if num_ps != num_ew:
            raise ValueError(f"--colocate-ps pairs each embedding worker with one PS replica: --num-ps ({num_ps}) "
                             f"must equal --num-embedding-workers ({num_ew})")
        return [RoleProcess(f"ew-ps-{i}", "ew", launcher + [
            "embedding-worker", "--port", "0", "--replica-index", str(i), "--replica-size", str(num_ew),
            "--with-ps", "--ps-port", "0", "--ps-replica-size", str(num_ps)],
            _replica_env(common, i, num_ew)) for i in range(num_ew)]
    procs: list[RoleProcess] = []
    for i in range(num_ps):
        procs.append(RoleProcess(f"ps-{i}", "ps", launcher + [
            "embedding-parameter-server", "--port", "0", "--replica-index", str(i), "--replica-size", str(num_ps)],
            _replica_env(common, i, num_ps)))
    for i in range(num_ew):
        procs.append(RoleProcess(f"ew-{i}", "ew", launcher + [
            "embedding-worker", "--port", "0", "--replica-index", str(i), "--replica-size", str(num_ew)],
            _replica_env(common, i, num_ew)))
    return procs


def _replica_env(common: dict[str, str], index: int, size: int) -> dict[str, str]:
    """A server replica's environment: ``common`` with this replica's index and no inherited rank."""
    env = {k: v for k, v in common.items() if k not in _RANK_ENV}
    env.update(REPLICA_INDEX=str(index), REPLICA_SIZE=str(size))
    return env


# A rank inherited from the launcher's shell (a pod, a torchrun script, the process that opened a
# PersiaServiceCtx) would reach every role: a PS with LOCAL_RANK=1 adds it to its metrics port,
# onto the next role's (persia.metrics).
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "REPLICA_INDEX", "REPLICA_SIZE")
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
        self.write_errors = 0  # lines our stdout refused (a closed pipe): the roles' output still drains

    def line(self, prefix: str, text: str) -> None:
        if text.startswith(RESULT_PREFIX):
            try:
                self.results.append(json.loads(text[len(RESULT_PREFIX):]))
            except json.JSONDecodeError as exc:
                self._write("local", f"WARNING: {prefix} printed a {RESULT_PREFIX.strip()} line that does not "
                                     f"parse ({exc}); its result is lost: {text[:200]!r}")
        self._write(prefix, text)

    def _write(self, prefix: str, text: str) -> None:
        with self.lock:
            try:
                sys.stdout.write(f"[{prefix}] {text}\n")
                sys.stdout.flush()
            except (OSError, ValueError):  # BrokenPipeError, a closed stdout: keep going without it
                self.write_errors += 1


def _pump(proc: subprocess.Popen, prefix: str, out: _Output) -> None:
    """Every line of ``proc``'s output to ``out``, to its end: whatever becomes of our own stdout,
    the pipe keeps draining, or the role would block on a full pipe."""
    for raw in iter(proc.stdout.readline, b""):
        try:
            out.line(prefix, raw.decode(errors="replace").rstrip("\n"))
        except Exception:  # noqa: BLE001 - never stop draining
            pass


LOADER_WAIT_S = 30.0  # how long data loaders get to finish once the trainer has


class LocalJob:
    """Runs the planned roles and supervises them until the trainer finishes or the job fails.

    Every exit goes through :func:`persia.supervisor.decide`: a role killed by a signal, or a
    server that exited, restarts the whole job (every role resumes from the latest checkpoint)
    within ``max_restarts``; a program error fails the job at once, naming the role. A dead
    nats-server is restarted on the same port and the roles reconnect. Events from processes of an
    earlier incarnation of the job are ignored.
    """

    def __init__(self, roles: list[RoleProcess], nats, out: "_Output", job_env: dict[str, str], *,
                 max_restarts: int, grace_s: float):
        self.roles, self.nats, self.out, self.job_env = roles, nats, out, job_env
        self.max_restarts, self.grace_s = max_restarts, grace_s
        self.kinds = {r.name: r.kind for r in roles}
        self.procs: dict[str, subprocess.Popen] = {}
        self.events: queue.Queue = queue.Queue()
        self.generation = 0
        self.restarts = 0
        self.nats_restarts = 0  # counted apart from the job's, against the same --max-restarts
        self.signals: list[int] = []
        self.pumps: dict[str, threading.Thread] = {}

    # -- processes --------------------------------------------------------------------------------
    def start_roles(self) -> None:
        self.generation += 1
        gen = self.generation
        for role in self.roles:
            env = dict(role.env, **self.job_env)  # the NATS URL, its credentials, the job secret
            p = spawn(role.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.procs[role.name] = p
            self.out.line("local", f"started {role.name} (pid {p.pid})")
            pump = threading.Thread(target=_pump, args=(p, role.name, self.out), daemon=True)
            pump.start()
            self.pumps[role.name] = pump
            threading.Thread(target=lambda p=p, n=role.name: self.events.put(("exit", gen, n, p.wait())),
                             daemon=True).start()

    def watch_nats(self) -> None:
        if self.nats is None:  # an external server (--nats-url): not ours to restart
            return
        proc = self.nats.process
        threading.Thread(target=lambda: self.events.put(("nats", proc.wait())), daemon=True).start()

    def stop_roles(self, grace_s: float) -> None:
        """Trainers and loaders first (they flush updates and checkpoint through the servers)."""
        by_kind = lambda *kinds: [p for n, p in self.procs.items() if self.kinds[n] in kinds]  # noqa: E731
        # roles lead process groups of their own (persia.procs.spawn): a SIGKILL takes the nn
        # launcher's ranks with it
        stop_in_order([by_kind("dl", "nn"), by_kind("ew"), by_kind("ps")], grace_s, kill_groups=True)

    def join_pumps(self, names=None, timeout_s: float = 5.0) -> None:
        """Wait (bounded: a grandchild may hold the pipe open) until the roles' output is delivered."""
        end = time.monotonic() + timeout_s
        for name in (self.pumps if names is None else names):
            pump = self.pumps.get(name)
            if pump is not None:
                pump.join(max(0.0, end - time.monotonic()))

    def _stop_for_signal(self) -> list[str]:
        signum = self.signals[0]
        self.out.line("local", f"{signal.Signals(signum).name}: stopping every role")
        # Ctrl-C means now; SIGTERM (a supervisor's stop) gives roles their grace period.
        self.stop_roles(min(2.0, self.grace_s) if signum == signal.SIGINT else self.grace_s)
        return ["interrupted" if signum == signal.SIGINT else "terminated"]

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[str]:
        """Supervise until done; returns the failures (empty: success)."""
        self.start_roles()
        self.watch_nats()
        while True:
            if self.signals:  # appended by the signal handler, which takes no lock
                return self._stop_for_signal()
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if event[0] == "nats":
                failure = self._on_nats_exit(event[1])
                if failure:
                    self.stop_roles(self.grace_s)
                    return [failure]
                continue
            _, gen, name, code = event
            if gen != self.generation:
                continue
            self.join_pumps([name])  # its last lines (a PERSIA_RESULT) before acting on its exit
            decision = decide(name, self.kinds[name], code, restarts=self.restarts, max_restarts=self.max_restarts)
            if decision.action is Action.CONTINUE:
                continue
            if decision.action is Action.SUCCEED:
                return self._finish_loaders()
            self.out.line("local", decision.reason)
            self.stop_roles(self.grace_s)
            if decision.action is Action.FAIL:
                return [decision.reason]
            if self.signals:  # stopped while the roles were stopping: no new incarnation
                return self._stop_for_signal()
            self.restarts += 1
            self.start_roles()

    def _on_nats_exit(self, code: int) -> str | None:
        last = getattr(self.nats, "last_output", lambda: "")()
        said = f"; its last output:\n{last}" if last else ""
        if self.nats_restarts >= self.max_restarts:
            return (f"nats-server {describe_exit(code)}; no restarts left ({self.nats_restarts} of --max-restarts "
                    f"{self.max_restarts} used on nats-server){said}")
        self.nats_restarts += 1
        self.out.line("local", f"nats-server {describe_exit(code)}; restarting it on {self.nats.url} "
                               f"({self.nats_restarts}/{self.max_restarts}){said}")
        try:
            self.nats.restart()
        except Exception as exc:  # noqa: BLE001 - any failure to restart ends the job, clearly
            return f"nats-server {describe_exit(code)} and could not be restarted on {self.nats.url}: {exc}"
        self.out.line("local", "nats-server is back; roles reconnect")
        self.watch_nats()
        return None

    def _finish_loaders(self) -> list[str]:
        loaders = [n for n, k in self.kinds.items() if k == "dl"]
        self.out.line("local", f"training finished; waiting up to {LOADER_WAIT_S:g}s for the data loaders")
        end = time.monotonic() + LOADER_WAIT_S
        while any(self.procs[n].poll() is None for n in loaders) and time.monotonic() < end:
            if self.signals:  # Ctrl-C / SIGTERM while waiting: stopped, not done
                return self._stop_for_signal()
            time.sleep(0.05)  # polling: the signal handler takes no lock we could wait on
        for line in loaders_after_training({n: self.procs[n].poll() for n in loaders}):
            self.out.line("local", line)
        return []


def loaders_after_training(codes: dict[str, int | None]) -> list[str]:
    """What to say of the data loaders once training finished (pure; ``codes``: each one's exit
    code, None while it runs). Their end does not decide the job: the NN workers finished it (an
    operator batch job succeeds once its NN workers completed, too). A loader with batches left
    whose trainer said it was done fails with ``TrainerGone`` some 30 s later
    (``persia.data_loader.trainers``), as local mode stops the ones still running; either way the
    job is done, and which came first made it pass or fail at random before. A non-zero exit is
    named, so it is not missed."""
    lines = []
    for name, code in codes.items():
        if code is None:
            lines.append(f"{name} still running after training finished: stopping it")
        elif code != 0:
            lines.append(f"WARNING: {name} {describe_exit(code)} after training finished (the NN workers "
                         f"decide the job: not a failure of it; its output above says why)")
    return lines


def check_configs(args) -> None:
    """Load the job's configs once before any role starts: a mistake in one (a ConfigError
    naming the file and the key) would otherwise fail every server at its start, and each server
    exit restarts the whole job, --max-restarts times over, before the job fails."""
    from persia.config import load_embedding_config, load_global_config

    load_embedding_config(args.embedding_config)
    if args.global_config is not None:
        load_global_config(args.global_config)


def run_local(args) -> int:
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    try:
        if args.grace_period is None:  # read here, not when the parser is built (every subcommand's)
            args.grace_period = grace_period_s()
        split, placement = cpu_split(allowed, args.nproc_per_node, args.cpu_placement)
        roles = plan(args, base_env=dict(os.environ), split=split)
        check_configs(args)
        metrics_port(os.environ)  # a bad PERSIA_METRICS_PORT fails here, not in every role, restart after restart
    except (ValueError, FileNotFoundError) as exc:
        print(f"persia-launcher local: {exc}", file=sys.stderr)
        return 2
    out = _Output()
    out.line("local", f"CPU placement: {placement}")
    if split is None:
        return _run_job(args, roles, out)
    # this thread starts nats-server and every role (restarts too): they inherit these CPUs, and
    # each NN rank's training thread moves to its own (PERSIA_TRAINING_CPUS)
    os.sched_setaffinity(0, split.rest)
    try:
        return _run_job(args, roles, out)
    finally:
        os.sched_setaffinity(0, allowed)  # a caller that goes on (a test, a notebook) gets its CPUs back


def _run_job(args, roles: list[RoleProcess], out: "_Output") -> int:
    from persia.nats_server import NatsServer

    if args.nats_url:
        nats, url = None, args.nats_url
        credentials = {k: os.environ[k] for k in _FOREIGN_NATS_ENV if k in os.environ and k != "PERSIA_NATS_URL"}
        secret_env = job_env(credentials, url, dict(os.environ))
        from persia.security import redact_url

        out.line("local", f"external NATS on {redact_url(url)}; starting {len(roles)} role processes")
    else:
        nats = NatsServer(max_payload=args.nats_max_payload)
        url = nats.start()
        secret_env = job_env(nats.client_env(), url, dict(os.environ))
        out.line("local", f"nats-server on {url} (authenticated; credentials passed to roles in env); "
                          f"starting {len(roles)} role processes")
    job = LocalJob(roles, nats, out, secret_env, max_restarts=args.max_restarts, grace_s=args.grace_period)
    interrupts = job.signals

    def on_signal(signum, _frame):
        # no lock here (a queue's put could deadlock with the main thread inside its get)
        interrupts.append(signum)
        if len(interrupts) > 1:  # a second Ctrl-C: no more waiting
            for p in job.procs.values():
                if p.poll() is None:
                    p.kill()

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    progress = _Progress(url, args.job_name, out, enabled=not args.no_progress, env=secret_env)
    t0 = time.monotonic()
    try:
        progress.start()
        failed = job.run()
    finally:
        progress.stop()
        job.stop_roles(0.0 if interrupts else args.grace_period)
        job.join_pumps()  # every role's last lines (its PERSIA_RESULT) before the final line
        if nats is not None:
            nats.stop()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    elapsed = time.monotonic() - t0
    if out.results and args.result_file:
        Path(args.result_file).write_text(json.dumps(out.results[-1], indent=2))
    if failed:
        out.line("local", f"FAILED ({'; '.join(failed)}) after {elapsed:.1f}s")
        if failed == ["interrupted"]:
            return 130
        return 143 if failed == ["terminated"] else 1
    summary = out.results[-1] if out.results else {}
    restarted = f" after {job.restarts} restart(s)" if job.restarts else ""
    out.line("local", f"done in {elapsed:.1f}s{restarted}; result: {json.dumps(summary, sort_keys=True)}")
    idle = untrained_note(summary)
    if idle:
        out.line("local", idle)
    return 0


def untrained_note(result: dict) -> str | None:
    """A warning for a job whose trainer reports that it trained and evaluated nothing (pure): it
    is still done (its programs said so), but not in silence."""
    if result.get("batches_trained") == 0 and not result.get("batches_evaluated"):
        return ("WARNING: the NN workers trained no batch (batches_trained 0): the data loaders sent none, "
                "or none was trained; the roles' warnings above say which")
    return None


class _Progress:
    """The live summary line, from the NN workers' progress messages on NATS: batches trained,
    batches/s, training loss, AUC so far, embedding staleness (``summary`` is pure)."""

    def __init__(self, url: str, job: str, out: _Output, enabled: bool = True, env: dict | None = None):
        self.url, self.job, self.out, self.enabled = url, job, out, enabled
        self.env = env or {}
        self.ranks: dict[int, dict] = {}
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
                                   lambda m: self.ranks.__setitem__(m["rank"], dict(m)), schema=Progress)
        self._thread = threading.Thread(target=self._render, daemon=True)
        self._thread.start()

    @staticmethod
    def summary(ranks: dict[int, dict], rate: float) -> str:
        """Pure: one line for every rank together (trained summed, loss and AUC averaged over the
        ranks that report them, staleness the worst rank's)."""
        total = sum(m["trained"] for m in ranks.values())
        parts = [f"trained {total} batches ({rate:.1f} batch/s)"]
        for key, label, fmt in (("loss", "loss", "{:.4f}"), ("auc", "AUC so far", "{:.4f}")):
            vals = [m[key] for m in ranks.values() if m.get(key) is not None]
            if vals:
                parts.append(f"{label} " + fmt.format(sum(vals) / len(vals)))
        stale = [m["staleness"] for m in ranks.values() if m.get("staleness") is not None]
        if stale:
            parts.append(f"staleness {max(stale)}")
        return ", ".join(parts)

    def _render(self) -> None:
        t0 = time.monotonic()
        last = None
        tty = sys.stdout.isatty()
        while not self._stop.wait(2.0 if tty else 10.0):
            snapshot = {r: dict(m) for r, m in list(self.ranks.items())}
            if not snapshot or snapshot == last:
                continue
            last = snapshot
            total = sum(m["trained"] for m in snapshot.values())
            self.out.line("progress", self.summary(snapshot, total / max(1e-9, time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        if self._bus is not None:
            self._bus.close()
