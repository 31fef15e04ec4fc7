"""`persia-launcher local` as an attacker on the same host sees it: every listening socket of the
job (nats-server, PS and embedding-worker gRPC, their metrics exporters, the DDP store of two NN
ranks) is on loopback, each server role has a metrics port of its own, and the generated NATS
password is in no process's argv and in no output line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.ports import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NN = """
import os, time, torch
from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import SGD

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)
    def forward(self, non_id, emb):
        return torch.sigmoid(self.lin(torch.cat([non_id[0], emb[0]], dim=1)))

model = M()
with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
              dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
    if os.environ["RANK"] == "0":  # every listener is up now: let the test look, then go on
        open(os.environ["SEC_READY"], "w").close()
        end = time.monotonic() + 300
        while not os.path.exists(os.environ["SEC_GO"]) and time.monotonic() < end:
            time.sleep(0.05)
    for batch in DataLoader(StreamingDataset(4)):
        out, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
"""

DL = """
import numpy as np
from persia.ctx import DataCtx
from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch

rng = np.random.default_rng(0)
with DataCtx() as ctx:
    for _ in range(8):
        ids = rng.integers(0, 100, size=16, dtype=np.uint64)
        ctx.send_data(PersiaBatch([IDTypeFeatureWithSingleID("user", ids)],
                                  non_id_type_features=[NonIDTypeFeature(rng.random((16, 2), dtype=np.float32))],
                                  labels=[Label((ids % 2).astype(np.float32).reshape(-1, 1))]))
"""


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def _listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, local address as hex, port) of every listening TCP socket the processes hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed since the listing: the process's other sockets still count
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in owner:  # LISTEN
                addr, port = cols[1].split(":")
                found.append((owner[cols[9]], addr, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1, ::ffff:127.0.0.1


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_local_mode_listens_on_loopback_only_with_a_metrics_port_per_role(tmp_path):
    (tmp_path / "nn.py").write_text(textwrap.dedent(NN))
    (tmp_path / "dl.py").write_text(textwrap.dedent(DL))
    (tmp_path / "emb.yml").write_text("slots_config:\n  user: {dim: 4}\n")
    ready, go = tmp_path / "ready", tmp_path / "go"
    base = free_ports(16)  # below the ephemeral range: no port-0 bind can take a role's port first
    env = dict(os.environ, SEC_READY=str(ready), SEC_GO=str(go))
    cmd = [sys.executable, "-m", "persia.launcher", "local", "--nn-worker", str(tmp_path / "nn.py"),
           "--data-loader", str(tmp_path / "dl.py"), "--embedding-config", str(tmp_path / "emb.yml"),
           "--nproc-per-node", "2", "--no-progress", "--max-restarts", "0", "--env", f"PERSIA_METRICS_PORT={base}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < end, proc.stdout.read()[-4000:] if proc.poll() is not None else "timeout"
            time.sleep(0.1)
        # the servers' metrics exporters start after their NATS subscriptions, which are all the
        # trainer needs to be ready: look until both are listening
        end = time.monotonic() + 60
        while True:
            pids = _descendants(proc.pid)
            listeners = _listeners(pids)
            if {base, base + 1} <= {port for _, _, port in listeners} or time.monotonic() > end:
                break  # (the asserts below name what is missing)
            time.sleep(0.1)  # polled with a deadline
        password = None
        for pid in pids:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            password = next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PERSIA_NATS_PASSWORD=")),
                            password)
        argvs = []
        for pid in pids:
            try:
                argvs.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
        go.touch()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    not_loopback = [entry for entry in listeners if entry[1] not in LOOPBACK]
    assert not not_loopback, f"listening beyond loopback: {not_loopback}"
    ports = {port for _, _, port in listeners}
    # nats-server, PS gRPC, EW gRPC, PS metrics, EW metrics, the DDP store (+ gloo pairs)
    assert len(listeners) >= 6, listeners
    assert {base, base + 1} <= ports, (base, listeners)  # ps-0 and ew-0 each serve metrics
    assert "Address already in use" not in out
    assert password and all(password not in a for a in argvs) and password not in out
