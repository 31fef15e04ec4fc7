"""`make soak` (not in CI): a long local run with a fault injected every few minutes.

Runs the adult-income example for many epochs under `persia-launcher local`, and every
``SOAK_FAULT_EVERY_S`` seconds SIGKILLs one of: a PS, an embedding worker, an NN rank, a data
loader, the nats-server (in turn). Every ``SOAK_SAMPLE_S`` seconds it records each role's resident
memory (from /proc). At the end it prints memory per role over time (it should be flat after
warm-up: a leak shows as a slope), the faults injected and how the job answered, and the result
line's batch accounting. ``SOAK_MINUTES`` (default 30) bounds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from tests.faults.localjob import LocalRun, alive, children_of

ROLES = ("ps-0", "ew-0", "nn", "dl-0")


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def role_pids(run: LocalRun) -> dict[str, int]:
    """The newest pid of each role (a restarted job starts new processes), plus the NN rank and NATS."""
    pids: dict[str, int] = {}
    for line in run.lines:
        m = re.search(r"started (\S+) \(pid (\d+)\)", line)
        if m:
            pids[m.group(1)] = int(m.group(2))
    nn = pids.get("nn")
    if nn:
        ranks = [p for p in children_of(nn) if "train.py" in cmdline(p)]
        if ranks:
            pids["nn-rank-0"] = ranks[0]
    for p in children_of(run.proc.pid):
        if "nats-server" in cmdline(p):
            pids["nats-server"] = p
    return {k: v for k, v in pids.items() if alive(v)}


def main() -> int:
    minutes = float(os.environ.get("SOAK_MINUTES", "30"))
    fault_every = float(os.environ.get("SOAK_FAULT_EVERY_S", "180"))
    sample_every = float(os.environ.get("SOAK_SAMPLE_S", "10"))
    epochs = int(os.environ.get("SOAK_EPOCHS", "200"))
    ckpt = tempfile.mkdtemp(prefix="persia-soak-")  # every restart resumes from the latest cut
    run = LocalRun("--max-restarts", "100", job="soak",
                   env={"EPOCHS": str(epochs), "SLOW_S": "0", "PERSIA_CHECKPOINT_DIR": ckpt,
                        "PERSIA_CHECKPOINT_INTERVAL_STEPS": os.environ.get("SOAK_CHECKPOINT_STEPS", "100")})
    targets = ["ps-0", "ew-0", "nn-rank-0", "dl-0", "nats-server"]
    samples: list[tuple[float, dict[str, float]]] = []
    faults: list[str] = []
    t0 = time.monotonic()
    next_fault, k = t0 + fault_every, 0
    try:
        while time.monotonic() - t0 < minutes * 60 and run.proc.poll() is None:
            pids = role_pids(run)
            samples.append((time.monotonic() - t0, {r: rss_mib(p) for r, p in pids.items()}))
            if time.monotonic() >= next_fault:
                target = targets[k % len(targets)]
                k += 1
                next_fault += fault_every
                if target in pids:
                    os.kill(pids[target], signal.SIGKILL)
                    faults.append(f"{time.monotonic() - t0:7.0f}s SIGKILL {target} (pid {pids[target]})")
            time.sleep(sample_every)  # a sampling period, not a synchronisation
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGINT)
        code = run.finish(60)
    print(f"soak: {minutes:.0f} min, launcher exit {code}")
    print("faults injected:\n  " + "\n  ".join(faults or ["none"]))
    print("answers:\n  " + "\n  ".join(l for l in run.lines if "[local]" in l and ("restart" in l or "nats-server" in l)))
    names = sorted({r for _, s in samples for r in s})
    print("RSS MiB per role over time:")
    print("   t(s) " + " ".join(f"{n:>11}" for n in names))
    for t, s in samples[:: max(1, len(samples) // 30)]:
        print(f"{t:7.0f} " + " ".join(f"{s.get(n, 0):11.0f}" for n in names))
    print("resumed:\n  " + "\n  ".join([l for l in run.lines if "resum" in l.lower()][-8:] or ["never"]))
    results = [l for l in run.lines if "PERSIA_RESULT" in l]
    if results:
        r = json.loads(results[-1].split("PERSIA_RESULT ", 1)[1])
        print("accounting:", {k: r[k] for k in r if k.startswith("batches_")})
    else:  # stopped before the end: the NN worker's own balance when it left TrainCtx
        print("accounting:", ([l for l in run.lines if "batches: sent" in l or "; batches: " in l] or ["none logged"])[-1])
    shutil.rmtree(ckpt, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
