"""Children started by ``persia.procs.spawn`` from a process whose gRPC is busy (the launcher, a
test process) start every time: with grpcio's fork support on, about one in twenty aborted before
its exec (``persia/__init__.py``). A fresh interpreter, as a role's would be."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import persia  # before grpc, as in every PERSIA process
from concurrent import futures
import grpc
from persia.procs import spawn

server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=30)  # gRPC's poller threads are running now
codes = [spawn(["/bin/true"], own_session=False).wait() for _ in range(500)]
print(sum(c != 0 for c in codes), sorted(set(codes)))
"""


def test_children_spawned_beside_a_busy_grpc_all_start():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    failed, codes = proc.stdout.split(maxsplit=1)
    assert failed == "0", f"{failed} of 500 children failed before exec (exit codes {codes}): {proc.stderr[-500:]}"
