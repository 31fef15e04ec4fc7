"""One run of our system with every connection between roles delayed (``make bench-latency``).

    python -m bench.latency_run --delay-ms 2 -- persia-launcher local --nn-worker ... [launcher args]

Starts a nats-server and the delaying proxies of :mod:`bench.delay_proxy`, then the launcher with
``--nats-url`` pointing at the NATS forwarder (every role's NATS connection: data loader <-> NATS,
NATS <-> NN worker, and the embedding worker's and PS's) and ``grpc_proxy`` in its environment, which
every role inherits: gRPC then opens each channel (NN worker -> embedding worker, embedding worker
-> PS) through the CONNECT proxy. At 0 ms the proxies are still in the path, so a run's ratio to its
own 0 ms run isolates the delay. The launcher's output passes through; the last line is the
trainer's ``PERSIA_RESULT`` with the proxies' statistics added. A run in which some connection did
not go through a proxy fails: an undelayed path would make the figures a lie.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench import _paths  # noqa: F401  (puts synthetic_ctr on sys.path)
from bench.delay_proxy import ProxySet
from synthetic_ctr.results import format_result_line, parse_result_line

PROXY_ENV_DROP = ("no_proxy", "NO_PROXY", "no_grpc_proxy", "http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")
MIN_GRPC_CONNECTIONS = 2  # NN worker -> embedding worker, embedding worker -> PS
MIN_NATS_CONNECTIONS = 4  # PS, embedding worker, NN worker, data loader


def launcher_env(base: dict[str, str], connect_port: int, nats_credentials: dict[str, str]) -> dict[str, str]:
    """The launcher's (and so every role's) environment: gRPC through the CONNECT proxy, no other
    proxy setting that could take precedence or exempt loopback, and our nats-server's credentials
    instead of any the caller's environment has."""
    env = {k: v for k, v in base.items() if k not in PROXY_ENV_DROP and not k.startswith("PERSIA_NATS_")}
    env["grpc_proxy"] = f"http://127.0.0.1:{connect_port}"
    return {**env, **nats_credentials}


def launcher_split(command: list[str], allowed: set[int]):
    """The CPU split the launcher command will make (``persia.local.cpu_split`` on its own parsed
    ``--cpu-placement`` and NN rank count), or None."""
    from persia.launcher import build_parser
    from persia.local import cpu_split

    args, _ = build_parser().parse_known_args(command[1:])
    return cpu_split(allowed, args.nproc_per_node, args.cpu_placement)[0]


def unproxied(stats: dict, nats_upstream: str, min_grpc: int = MIN_GRPC_CONNECTIONS, min_nats: int = MIN_NATS_CONNECTIONS) -> list[str]:
    """What did not go through the proxies, from their statistics (empty: everything did)."""
    problems = []
    grpc = (stats.get("connect") or {}).get("connections", 0)
    if grpc < min_grpc:
        problems.append(f"{grpc} gRPC connection(s) through the CONNECT proxy, expected >= {min_grpc}")
    nats = (stats.get("forward", {}).get(nats_upstream) or {}).get("connections", 0)
    if nats < min_nats:
        problems.append(f"{nats} NATS connection(s) through the forwarder, expected >= {min_nats}")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m bench.latency_run --delay-ms MS -- persia-launcher local ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, required=True)
    a = p.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        p.error("no launcher command after --")

    from persia.nats_server import NatsServer

    # nats-server and the proxies' threads (the network's stand-ins) run where the launcher puts
    # its roles, off the NN workers' training CPUs; the launcher, started once they run, splits
    # the CPUs itself
    allowed = os.sched_getaffinity(0)
    split_cpus = launcher_split(command, allowed)
    if split_cpus is not None:
        os.sched_setaffinity(0, split_cpus.rest)
    nats = NatsServer()
    upstream = nats.start().split("://", 1)[-1].rsplit("@", 1)[-1]
    proxies = None
    try:
        proxies = ProxySet.start(a.delay_ms / 1e3, forward=[upstream], connect=True)
        nats_url = f"nats://127.0.0.1:{proxies.forward[upstream].port}"
        if split_cpus is not None:
            os.sched_setaffinity(0, allowed)
        proc = subprocess.Popen(command + ["--nats-url", nats_url], env=launcher_env(dict(os.environ), proxies.connect.port, nats.client_env()),
                                stdout=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
        code = proc.wait()
    finally:
        if proxies is not None:
            proxies.close()
        nats.stop()
    stats = proxies.stats()
    problems = unproxied(stats, upstream)
    try:
        result = parse_result_line("".join(lines))
    except ValueError as exc:
        print(f"latency_run: {exc}; proxies: {stats}", file=sys.stderr)
        return code or 1
    if problems:
        print(f"latency_run: not every connection was delayed: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print(format_result_line({**result, "delay_ms": a.delay_ms, "proxy": stats}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
