"""What kind of machine a benchmark ran on, measured, so that figures from different days compare.

Two properties moved our figures between sessions more than any change did (docs/benchmarks.md,
session 8):

* **Compute speed**: one torch thread's matmul of the MLP 400's hidden layer at batch 256. The
  dense step alone took 8.4-9.0 ms on one machine and 13.7-16.2 ms on another of the same nominal
  size.
* **Wake-up latency across CPUs**: a round trip through two pipes between two processes pinned to
  two CPUs. Every hand-off between our roles, and every passive OpenMP barrier, is such a wake-up.
  On a VM whose idle vCPUs halt (``cpuidle haltpoll`` with ``guest_halt_poll_ns=0``) it cost
  110-150 µs, against 8.5 µs with both processes on one CPU; the single-process torch baseline
  spins and never pays it.

    python -m bench.machine            # a line per figure
    python -m bench.machine --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROUND_TRIPS = 2000
REPEATS = 3


def _echo(cpu: int, inbox: int, outbox: int) -> None:
    """The far end: pinned to ``cpu``, answers every byte until the pipe closes."""
    os.sched_setaffinity(0, {cpu})
    while True:
        got = os.read(inbox, 1)
        if not got:
            os._exit(0)
        os.write(outbox, got)


def wake_round_trip_us(cpu_a: int, cpu_b: int, round_trips: int = ROUND_TRIPS, repeats: int = REPEATS) -> float:
    """Median over ``repeats`` of the mean µs per round trip between a process pinned to ``cpu_a``
    and one pinned to ``cpu_b`` (each blocks in ``read`` until the other writes)."""
    if round_trips < 1 or repeats < 1:
        raise ValueError(f"round_trips and repeats must be >= 1, got {round_trips} and {repeats}")
    cpus = os.sched_getaffinity(0)
    for cpu in (cpu_a, cpu_b):
        if cpu not in cpus:
            raise ValueError(f"cpu {cpu} is not one this process may run on ({sorted(cpus)})")
    far_in, to_far = os.pipe()  # (read end, write end)
    from_far, far_out = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child exits through os._exit
        try:
            os.close(to_far)
            os.close(from_far)
            _echo(cpu_b, far_in, far_out)
        finally:
            os._exit(1)
    os.close(far_in)
    os.close(far_out)
    try:
        os.sched_setaffinity(0, {cpu_a})
        for _ in range(50):  # both ends scheduled once before timing
            os.write(to_far, b"x")
            os.read(from_far, 1)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(round_trips):
                os.write(to_far, b"x")
                os.read(from_far, 1)
            samples.append((time.perf_counter() - start) / round_trips * 1e6)
        return statistics.median(samples)
    finally:
        os.sched_setaffinity(0, cpus)
        os.close(to_far)
        os.close(from_far)
        os.waitpid(pid, 0)


MATMUL_CODE = """
import json, time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 400), torch.randn(400, 400)
for _ in range(50):
    a @ b
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    for _ in range(200):
        a @ b
    best = min(best, time.perf_counter() - start)
print(json.dumps(200 * 2 * 256 * 400 * 400 / best / 1e9))
"""


def matmul_gflops_one_thread(timeout_s: float = 120.0) -> float | None:
    """One torch thread's GFLOPS on a (256, 400) x (400, 400) matmul, the MLP 400's hidden layer
    at batch 256 (in a child process: the thread setting is the process's). None without torch."""
    try:
        out = subprocess.run([sys.executable, "-c", MATMUL_CODE], capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def probe(round_trips: int = ROUND_TRIPS) -> dict[str, Any]:
    """The figures above; the cross-CPU round trip only where this process may use two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, Any] = {
        "wake_round_trip_us_same_cpu": wake_round_trip_us(cpus[0], cpus[0], round_trips),
        "wake_round_trip_us_cross_cpu": wake_round_trip_us(cpus[0], cpus[1], round_trips) if len(cpus) > 1 else None,
        "matmul_gflops_one_thread": matmul_gflops_one_thread(),
    }
    poll = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"
    try:
        with open(poll) as f:
            out["guest_halt_poll_ns"] = int(f.read().strip())
    except (OSError, ValueError):
        out["guest_halt_poll_ns"] = None  # not a KVM guest with the haltpoll driver
    return out


def describe(machine: dict[str, Any]) -> str:
    """One sentence for a report; empty when none of the probe's figures is there (older runs)."""
    parts = []
    cross, same = machine.get("wake_round_trip_us_cross_cpu"), machine.get("wake_round_trip_us_same_cpu")
    if cross is not None and same is not None:
        parts.append(f"a wake-up round trip across CPUs {cross:.0f} µs ({same:.0f} µs on one CPU)")
    elif same is not None:
        parts.append(f"a wake-up round trip {same:.0f} µs")
    if machine.get("guest_halt_poll_ns") is not None:
        parts.append(f"guest halt polling {machine['guest_halt_poll_ns']} ns")
    if machine.get("matmul_gflops_one_thread") is not None:
        parts.append(f"one torch thread {machine['matmul_gflops_one_thread']:.0f} GFLOPS on the MLP 400's hidden layer")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--round-trips", type=int, default=ROUND_TRIPS)
    a = p.parse_args(argv)
    if a.round_trips < 1:
        p.error(f"--round-trips must be >= 1, got {a.round_trips}")
    got = probe(a.round_trips)
    if a.json:
        print(json.dumps(got))
    else:
        for k, v in got.items():
            print(f"{k}: {v if v is None or isinstance(v, int) else round(v, 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
