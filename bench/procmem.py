"""Peak memory and CPU time per role of a process tree, sampled from /proc (Linux, stdlib only).

Each process's ``VmHWM`` is its own resident high-water mark, so a sample taken late still sees an
earlier peak; only growth in the last sampling interval before a process exits can be missed.
CPU time (user + system, all threads) only grows, so the last sample of a process is its total up
to within one sampling interval: on a 2-core machine it says which role used the cores.
The sampler also keeps each role's CPU seconds over time, so a caller can take the CPU spent
inside a window it knows (the training phase) and leave start-up and shutdown out.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")


def classify_role(argv: list[str]) -> str:
    """Role of a process from its command line (pure; see tests/bench/test_procmem.py)."""
    words = [os.path.basename(a) for a in argv]
    joined = " ".join(words)
    if "bench.latency_run" in words:
        return "delay-proxy"  # the latency benchmark's proxies (not part of our system)
    if "persia-launcher" in joined and "local" in words:
        return "launcher"
    if any(w.startswith("nats-server") for w in words):
        return "nats"
    for key, role in (
        ("embedding-parameter-server", "ps"),
        ("parameter-server", "ps"),
        ("embedding-worker", "embedding-worker"),
        ("nn-worker", "nn-worker"),
        ("data-loader", "data-loader"),
        ("data_loader.py", "data-loader"),
        ("train.py", "nn-worker"),
        ("bench.torch_baseline", "trainer"),
        ("bench.torchrec_baseline", "trainer"),
    ):
        if key in joined:
            return role
    return "other"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _ppid_pgid(pid: int) -> tuple[int, int] | None:
    stat = _read(PROC / str(pid) / "stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[2])


def descendants(root: int) -> list[int]:
    """``root`` and every process whose parent chain or process group leads to it."""
    parents: dict[int, int] = {}
    tree = {root}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            info = _ppid_pgid(int(entry.name))
            if info is not None:
                parents[int(entry.name)] = info[0]
                if info[1] == root:
                    tree.add(int(entry.name))
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return sorted(tree)


def peak_rss_mb(pid: int) -> float | None:
    status = _read(PROC / str(pid) / "status")
    if status is None:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (all its threads), from /proc/<pid>/stat."""
    stat = _read(PROC / str(pid) / "stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields[11], [12] = utime, stime (stat(5) 14, 15)
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def cmdline(pid: int) -> list[str]:
    raw = _read(PROC / str(pid) / "cmdline")
    return [a for a in (raw or "").split("\0") if a]


def summarize(peaks: Iterable[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """(role, peak MB per process) pairs -> per role: the largest process, the sum and the count."""
    out: dict[str, dict[str, float]] = {}
    for role, mb in peaks:
        r = out.setdefault(role, {"max_mb": 0.0, "sum_mb": 0.0, "processes": 0})
        r["max_mb"] = max(r["max_mb"], mb)
        r["sum_mb"] += mb
        r["processes"] += 1
    return out


def add_cpu(summary: dict[str, dict[str, float]], cpu: Iterable[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """Add ``cpu_s`` (CPU seconds summed over the role's processes) to a per-role summary."""
    for role, seconds in cpu:
        r = summary.setdefault(role, {"max_mb": 0.0, "sum_mb": 0.0, "processes": 0})
        r["cpu_s"] = r.get("cpu_s", 0.0) + seconds
    return summary


CpuSeries = list[tuple[float, dict[str, float]]]  # (unix time, CPU seconds by role so far)


def role_cpu_at(series: CpuSeries, t: float) -> dict[str, float]:
    """CPU seconds by role at unix time ``t``, interpolated linearly between the two samples around
    it (a role absent from a sample had used none yet). Pure; ``t`` must lie within the series."""
    if not series or not series[0][0] <= t <= series[-1][0]:
        span = f"{series[0][0]:.3f}..{series[-1][0]:.3f}" if series else "an empty series"
        raise ValueError(f"time {t:.3f} is outside the sampled span {span}")
    i = bisect.bisect_left([s[0] for s in series], t)
    t1, after = series[i]
    if t1 == t or i == 0:
        return dict(after)
    t0, before = series[i - 1]
    w = (t - t0) / (t1 - t0)
    return {r: before.get(r, 0.0) + w * (after.get(r, 0.0) - before.get(r, 0.0)) for r in set(before) | set(after)}


def cpu_between(series: CpuSeries, start: float, end: float) -> dict[str, float]:
    """CPU seconds by role spent between unix times ``start`` and ``end`` (pure)."""
    if end < start:
        raise ValueError(f"window ends ({end:.3f}) before it starts ({start:.3f})")
    a, b = role_cpu_at(series, start), role_cpu_at(series, end)
    return {r: b.get(r, 0.0) - a.get(r, 0.0) for r in set(a) | set(b)}


class PeakMemorySampler:
    """Polls a process tree in a thread until ``stop()``; ``result()`` gives per-role peaks of
    memory and CPU seconds."""

    def __init__(self, root_pid: int, interval_s: float = 0.2):
        self.root, self.interval = root_pid, interval_s
        self._peaks: dict[int, tuple[str, float]] = {}
        self._cpu: dict[int, tuple[str, float]] = {}
        self.series: CpuSeries = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def start(self) -> PeakMemorySampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        started = time.time()
        for pid in descendants(self.root):
            mb = peak_rss_mb(pid)
            if mb is None:
                continue
            # classified on every sample: a child caught between fork and exec still shows its
            # parent's command line (the launcher's), and keeping that made roles go missing
            argv = cmdline(pid)
            role = classify_role(argv) if argv else self._peaks.get(pid, ("other", 0.0))[0]
            self._peaks[pid] = (role, max(mb, self._peaks.get(pid, ("", 0.0))[1]))
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self._cpu[pid] = (role, max(cpu, self._cpu.get(pid, ("", 0.0))[1]))
        by_role: dict[str, float] = {}
        for role, cpu in self._cpu.values():
            by_role[role] = by_role.get(role, 0.0) + cpu
        self.series.append(((started + time.time()) / 2, by_role))  # the reads' midpoint

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.result()

    def result(self) -> dict[str, dict[str, float]]:
        return add_cpu(summarize(self._peaks.values()), self._cpu.values())
