"""``persia-launcher``: PERSIA's role launcher (same flags and env fallbacks) plus ``local``,
which runs a whole job (NATS + every role) as processes on this machine."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from persia.allocator import tune_allocator
from persia.env import PORT, env_flag, grace_period_s, int_arg
from persia.procs import spawn, stop_in_order
from persia.thread_names import name_os_threads

log = logging.getLogger("persia.launcher")


def _env_default(name: str, default=None):
    return os.environ.get(name, default)


def _add_server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--port", **env_flag("PERSIA_PORT", PORT, "port", default_port),
                   help=f"gRPC port (default {default_port}; 0 picks a free one)")
    p.add_argument("--embedding-config", default=_env_default("PERSIA_EMBEDDING_CONFIG"),
                   help="embedding_config.yml (env PERSIA_EMBEDDING_CONFIG)")
    p.add_argument("--global-config", default=_env_default("PERSIA_GLOBAL_CONFIG"),
                   help="global_config.yml (env PERSIA_GLOBAL_CONFIG)")
    p.add_argument("--replica-index", **env_flag("REPLICA_INDEX", int_arg(0), "integer", 0))
    p.add_argument("--replica-size", **env_flag("REPLICA_SIZE", int_arg(1), "integer", 1))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="persia-launcher", description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)

    nn = sub.add_parser("nn-worker", help="run an NN-worker training script on --nproc-per-node processes")
    nn.add_argument("filepath", nargs="?", default=_env_default("PERSIA_NN_WORKER_ENTRY"))
    nn.add_argument("--nproc-per-node", **env_flag("NPROC_PER_NODE", int_arg(1), "integer", 1))
    nn.add_argument("--node-rank", **env_flag("REPLICA_INDEX", int_arg(0), "integer", 0))
    nn.add_argument("--nnodes", **env_flag("REPLICA_SIZE", int_arg(1), "integer", 1))

    dl = sub.add_parser("data-loader", help="run a data-loader script")
    dl.add_argument("filepath", nargs="?", default=_env_default("PERSIA_DATALOADER_ENTRY"))
    dl.add_argument("--replica-index", **env_flag("REPLICA_INDEX", int_arg(0), "integer", 0))
    dl.add_argument("--replica-size", **env_flag("REPLICA_SIZE", int_arg(1), "integer", 1))

    ew = sub.add_parser("embedding-worker", help="run an embedding worker")
    _add_server_flags(ew, 8887)
    ew.add_argument("--with-ps", action="store_true", default=_env_default("PERSIA_WITH_PS") == "1",
                    help="also run PS replica --replica-index in this process and call it without gRPC "
                         "(env PERSIA_WITH_PS=1; persia.embedding_worker.colocated)")
    ew.add_argument("--ps-port", **env_flag("PERSIA_PS_PORT", PORT, "port", 8888),
                    help="with --with-ps: the PS's gRPC port, for the other embedding workers (0: a free one)")
    ew.add_argument("--ps-replica-size", type=int_arg(1), default=None,
                    help="with --with-ps: how many PS replicas the job has (default: --replica-size)")
    ps = sub.add_parser("embedding-parameter-server", help="run an embedding parameter server")
    _add_server_flags(ps, 8888)

    from persia.local import add_local_parser
    from persia.serving.cli import add_serve_parser

    add_local_parser(sub)
    add_serve_parser(sub)
    return parser


def _require(value, flag: str, env: str) -> str:
    if not value:
        raise SystemExit(f"persia-launcher: {flag} is required (or set {env})")
    if not os.path.exists(value):
        raise SystemExit(f"persia-launcher: {flag} {value!r} does not exist")
    return value


def _check_replica(index: int, size: int, role: str) -> None:
    from persia.env import check_replica

    try:
        check_replica(index, size, role)
    except ValueError as exc:
        raise SystemExit(f"persia-launcher: {exc}") from None


def _python() -> str:
    return sys.executable


def _script_argv(path: str, role: str) -> list[str]:
    """``python script``, or under cProfile when ``PERSIA_PROFILE_DIR`` is set (one file per role)."""
    prof_dir = os.environ.get("PERSIA_PROFILE_DIR")
    if not prof_dir:
        return [_python(), path]
    os.makedirs(prof_dir, exist_ok=True)
    return [_python(), "-m", "cProfile", "-o", os.path.join(prof_dir, f"{role}.prof"), path]


_rendezvous_keepalive: list = []


def _rendezvous_index(role: str, given: int, size: int) -> int:
    """With ``PERSIA_RENDEZVOUS=nats`` (Deployments: no pod ordinal) the index comes from NATS."""
    from persia.rendezvous import claim_index, rendezvous_enabled

    if not rendezvous_enabled():
        return given
    from persia.bus import NatsBus

    bus = NatsBus(name=f"rdzv-{role}")
    index, stop = claim_index(bus, role, size)
    _rendezvous_keepalive.append((bus, role, index, stop))  # renewed for as long as this launcher lives
    print(f"persia-launcher: {role} index {index} of {size} from the NATS rendezvous", file=sys.stderr, flush=True)
    return index


def run_nn_worker(args) -> int:
    """Spawn ``nproc_per_node`` ranks (like torch.distributed.launch) and supervise them:
    if one fails, the others are stopped and its exit code is returned."""
    path = _require(args.filepath, "FILEPATH", "PERSIA_NN_WORKER_ENTRY")
    _metrics_config_from_env()  # before the rendezvous: a bad config fails before taking an index
    args.node_rank = _rendezvous_index("nn", args.node_rank, args.nnodes)
    _check_replica(args.node_rank, args.nnodes, "nn-worker node")
    if args.nproc_per_node < 1:
        raise SystemExit(f"persia-launcher: --nproc-per-node must be >= 1, got {args.nproc_per_node}")
    world = args.nproc_per_node * args.nnodes
    procs = []
    for local_rank in range(args.nproc_per_node):
        env = dict(os.environ)
        env.update(
            RANK=str(args.node_rank * args.nproc_per_node + local_rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(args.nproc_per_node),
            NPROC_PER_NODE=str(args.nproc_per_node),
        )
        procs.append(spawn(_script_argv(path, f"nn-worker-{env['RANK']}"), env=env, own_session=False))
    return _supervise(procs, [f"nn-worker rank {args.node_rank * args.nproc_per_node + i}"
                              for i in range(args.nproc_per_node)])


def first_failure(exits: list[tuple[int, int]]) -> tuple[int, int] | None:
    """Pure: the first failed child, in the order they exited (``exits``: (index, returncode)
    pairs as they happened). A rank SIGKILLed first and a peer that then exited 1 on the broken
    connection must report the SIGKILL (a restart), not the peer's error (a failed job)."""
    return next(((i, c) for i, c in exits if c != 0), None)


def _supervise(procs: list[subprocess.Popen], names: list[str] | None = None) -> int:
    """Wait for every child; when one fails, stop the rest and exit as the first to fail did: a
    child killed by signal N gives 128 + N (a shell's convention), so whoever supervises us can
    tell a killed process from a program error. SIGTERM/SIGINT are forwarded to the children;
    any still running at the grace period after that is SIGKILLed (a rank stuck in C code, in a
    gloo wait, never acts on a signal), and we exit 128 + the signal."""
    from persia.supervisor import describe_exit

    names = names or [f"process {p.pid}" for p in procs]
    done = threading.Event()
    exits: list[tuple[int, int]] = []  # in the order the children exited (list.append is atomic)

    def waiter(i, p):
        code = p.wait()
        exits.append((i, code))
        done.set()

    for i, p in enumerate(procs):
        threading.Thread(target=waiter, args=(i, p), daemon=True).start()

    forwarded: list[int] = []  # the handler takes no lock: it appends, the loop below polls

    def forward(signum, _frame):
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    kill_at = None
    while len(exits) < len(procs):
        done.wait(0.1)  # bounded: the signal handler takes no lock, so it cannot wake this wait
        done.clear()
        if forwarded:
            if kill_at is None:
                kill_at = time.monotonic() + grace_period_s()
            if time.monotonic() >= kill_at:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        print(f"persia-launcher: {names[i]} still running {grace_period_s():g}s after "
                              f"{signal.Signals(forwarded[0]).name}: killing it", file=sys.stderr, flush=True)
                        p.kill()
                for p in procs:
                    p.wait()
                break
            continue
        failed = first_failure(list(exits))
        if failed:
            i, code = failed
            print(f"persia-launcher: {names[i]} {describe_exit(code)}; stopping the others", file=sys.stderr,
                  flush=True)
            # SIGTERM, then SIGKILL at the grace period: a process stuck on its way out (an NN rank
            # whose peer died mid-teardown) must not keep the failure from reaching our supervisor
            stop_in_order([procs], grace_period_s())
            return 128 - code if code < 0 else code
    if forwarded:  # told to stop: exit as a stopped process, whatever the children made of it
        return 128 + forwarded[0]
    return 0


def run_data_loader(args) -> int:
    path = _require(args.filepath, "FILEPATH", "PERSIA_DATALOADER_ENTRY")
    _metrics_config_from_env()
    args.replica_index = _rendezvous_index("dl", args.replica_index, args.replica_size)
    _check_replica(args.replica_index, args.replica_size, "data loader")
    env = dict(os.environ, REPLICA_INDEX=str(args.replica_index), REPLICA_SIZE=str(args.replica_size))
    argv = _script_argv(path, f"data-loader-{args.replica_index}")
    if _rendezvous_keepalive:  # keep renewing the lease (given back at exit): supervise instead of exec
        return _supervise([spawn(argv, env=env, own_session=False)], [f"data loader {args.replica_index}"])
    os.execve(argv[0], argv, env)
    return 0  # not reached


def _wait_for_stop(signalled: list, role: str) -> None:
    """Until SIGTERM/SIGINT; under local mode (``PERSIA_EXIT_WITH_PARENT=1``) also until the
    launcher is gone: the kernel's parent-death signal (persia.procs) is the first line, this poll
    the second, so no server outlives its job whatever happened to the launcher."""
    watch_parent = os.environ.get("PERSIA_EXIT_WITH_PARENT") == "1"
    parent = os.getppid()
    while not signalled:
        time.sleep(0.2)  # polling a list the signal handler appends to: no lock shared with it
        if watch_parent and os.getppid() != parent:
            log.warning("%s: the launcher that started it (pid %d) is gone; shutting down", role, parent)
            return


def _serve_forever(role: str, start) -> int:
    from persia.bus import NatsBus
    from persia.logger import setup_logging
    from persia.metrics import start_exporter

    setup_logging(role)
    # The handler takes no lock (an Event.set() there deadlocked when the signal landed while
    # this thread was inside the same Event's wait): it appends, and the main thread polls.
    signalled: list[int] = []
    serving = [False]

    def on_signal(signum, _frame):
        signalled.append(signum)
        if not serving[0]:  # still connecting (NATS unreachable?): nothing to shut down
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    bus_holder: list = []

    def make_bus():
        bus = NatsBus(name=role)
        bus_holder.append(bus)
        return bus

    profiler = None
    if os.environ.get("PERSIA_PROFILE_DIR"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    server = start(make_bus)
    serving[0] = True
    start_exporter()
    _wait_for_stop(signalled, role)
    log.info("%s shutting down", role)
    server.stop()
    if profiler is not None:
        profiler.disable()
        os.makedirs(os.environ["PERSIA_PROFILE_DIR"], exist_ok=True)
        profiler.dump_stats(os.path.join(os.environ["PERSIA_PROFILE_DIR"], f"{role}.prof"))
    for bus in bus_holder:
        bus.close()
    return 0


def _load_configs(args, need_embedding: bool):
    from persia.config import GlobalConfig, load_embedding_config, load_global_config
    from persia.metrics import configure_from

    gc = load_global_config(args.global_config) if args.global_config else GlobalConfig()
    configure_from(gc.common_config.metrics_config)
    ec = None
    if need_embedding:
        ec = load_embedding_config(_require(args.embedding_config, "--embedding-config", "PERSIA_EMBEDDING_CONFIG"))
    return gc, ec


def _metrics_config_from_env() -> None:
    """``metrics_config`` for the roles without ``--global-config`` (the NN worker, the data
    loader): read from ``PERSIA_GLOBAL_CONFIG`` before their processes start, so that
    ``enable_metrics`` and ``job_name`` reach them as they reach the servers (``_load_configs``)."""
    from persia.config import ConfigError, load_global_config
    from persia.metrics import configure_from

    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if not path:
        return
    try:
        gc = load_global_config(path)
    except (ConfigError, OSError) as exc:
        raise SystemExit(f"persia-launcher: PERSIA_GLOBAL_CONFIG: {exc}") from None
    configure_from(gc.common_config.metrics_config)


def _bind_host() -> str:
    from persia.security import DEFAULT_BIND_ADDRESS, bind_address

    host = bind_address()
    if host == DEFAULT_BIND_ADDRESS:
        log.warning("listening on all interfaces: set PERSIA_BIND_ADDRESS to this host's address (docs/security.md)")
    return host


def run_embedding_worker(args) -> int:
    from persia.embedding_worker.service import EmbeddingWorker
    from persia.utils import advertise_host

    _check_replica(args.replica_index, args.replica_size, "embedding worker")
    gc, ec = _load_configs(args, need_embedding=True)
    infer = gc.common_config.job_type == "Infer"

    if args.with_ps:
        if infer:
            raise SystemExit("persia-launcher: --with-ps is for training jobs (an inference job's embedding "
                             "workers use the PS addresses of infer_config.servers)")
        ps_size = args.replica_size if args.ps_replica_size is None else args.ps_replica_size
        _check_replica(args.replica_index, ps_size, "embedding parameter server (--with-ps)")

    def start(make_bus):
        colocated = None
        if args.with_ps:
            from persia.embedding_ps.service import SERVICE as PS_SERVICE
            from persia.embedding_ps.service import EmbeddingParameterServer
            from persia.embedding_worker.colocated import InProcessPs

            ps = EmbeddingParameterServer(gc, args.replica_index, ps_size, port=args.ps_port, host=_bind_host(),
                                          advertise_host=advertise_host(), bus=make_bus())
            colocated = InProcessPs(ps.address, PS_SERVICE, ps.methods)
        try:
            ew = EmbeddingWorker(
                ec, gc, args.replica_index, args.replica_size, port=args.port, host=_bind_host(),
                advertise_host=advertise_host(),
                bus=None if infer else make_bus(),
                ps_addresses=list(gc.common_config.infer_config.servers) if infer else None,
                colocated_ps=colocated,
            )
        except BaseException:
            if colocated is not None:
                ps.stop()
            raise
        return ew if colocated is None else _Both(ew, ps)

    role = f"embedding-worker-{args.replica_index}" + ("+ps" if args.with_ps else "")
    return _serve_forever(role, start)


class _Both:
    """An embedding worker and the PS replica in its process, stopped together (worker first: it
    calls the PS)."""

    def __init__(self, worker, ps):
        self.worker, self.ps = worker, ps

    def stop(self) -> None:
        try:
            self.worker.stop()
        finally:
            self.ps.stop()


def run_embedding_parameter_server(args) -> int:
    from persia.embedding_ps.service import EmbeddingParameterServer
    from persia.utils import advertise_host

    _check_replica(args.replica_index, args.replica_size, "embedding parameter server")
    gc, _ = _load_configs(args, need_embedding=False)
    infer = gc.common_config.job_type == "Infer"

    def start(make_bus):
        return EmbeddingParameterServer(
            gc, args.replica_index, args.replica_size, port=args.port, host=_bind_host(),
            advertise_host=advertise_host(), bus=None if infer else make_bus(),
        )

    return _serve_forever(f"embedding-ps-{args.replica_index}", start)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tune_allocator()  # before the role allocates its first batch (persia.allocator)
    except ValueError as exc:
        raise SystemExit(f"persia-launcher: {exc}") from None
    name_os_threads()  # every thread the role starts, named for top -H and /proc (persia.thread_names)
    if os.environ.get("PERSIA_LAUNCHER_VERBOSE") == "1":
        print(f"persia-launcher {args}", file=sys.stderr)
    handlers = {
        "nn-worker": run_nn_worker,
        "data-loader": run_data_loader,
        "embedding-worker": run_embedding_worker,
        "embedding-parameter-server": run_embedding_parameter_server,
    }
    if args.role == "local":
        from persia.local import run_local

        return run_local(args)
    if args.role == "serve":
        from persia.serving.cli import run_serve

        return run_serve(args)
    try:
        return handlers[args.role](args)
    finally:
        _give_back_rendezvous()


def _give_back_rendezvous() -> None:
    """The launcher exits (its role ended, failed or was stopped): its rendezvous index is free at
    once for the next pod, instead of after the lease's TTL (30 s, each step of a rolling update)."""
    from persia.rendezvous import release_index

    while _rendezvous_keepalive:
        bus, role, index, stop = _rendezvous_keepalive.pop()
        if release_index(bus, role, index, stop):
            print(f"persia-launcher: {role} index {index} given back to the NATS rendezvous", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
