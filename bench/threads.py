"""Where a running job's threads spend a window of its training: per role and per thread, CPU,
time waiting for a CPU, and sleeps (voluntary switches) per batch (``make bench-threads``).

One run of our system on the benchmark's synthetic data. After ``--after`` seconds (start-up and
the thread tuner's first blocks behind it) every thread of every role is read from
``/proc/<pid>/task/<tid>/{schedstat,status,comm}`` twice, ``--window`` seconds apart; the run's
own result gives its samples per second. Threads carry their Python names in ``comm``
(``persia.thread_names``), so no profiler is attached and nothing is slowed. A thread that sleeps
and wakes often costs a wake-up each time (about half the machine probe's round trip across CPUs,
docs/benchmarks.md), which the switches per batch show.

    python -m bench.threads                                   # MLP 400, batch 256, hybrid st=10
    python -m bench.threads --batch-size 1024 --rows 400000
    python -m bench.threads --mlp ffnn --rows 60000 --after 15 --env OMP_WAIT_POLICY=ACTIVE
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._paths import RESULTS_DIR, write_results
from bench.persia_local import find_launcher, launcher_unavailable_reason, with_role_env
from bench.procmem import PROC, classify_role, cmdline, descendants
from bench.spec import DEFAULT_HYBRID_STALENESS, RunSpec

MIN_SHARE = 0.004  # threads below this share of a core in the window are left out of the table


@dataclass(frozen=True)
class ThreadSample:
    """One thread's counters at one moment (``/proc/<pid>/task/<tid>``)."""

    role: str
    pid: int
    tid: int
    name: str
    cpu_ns: int  # on a CPU (schedstat 1)
    wait_ns: int  # runnable, waiting for a CPU (schedstat 2)
    voluntary: int  # sleeps: waits for a lock, a condition, I/O, the GIL
    involuntary: int  # preempted


@dataclass(frozen=True)
class ThreadRate:
    role: str
    tid: int
    name: str
    cores: float  # CPU seconds per second of the window
    waiting: float  # seconds runnable without a CPU per second
    sleeps_per_batch: float
    preempted_per_batch: float


def parse_schedstat(text: str) -> tuple[int, int]:
    """``(ns on a CPU, ns waiting for one)`` from a ``schedstat`` file (pure)."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"schedstat: expected 3 numbers, got {text!r}")
    return int(fields[0]), int(fields[1])


def parse_switches(status: str) -> tuple[int, int]:
    """``(voluntary, involuntary)`` context switches from a ``status`` file (pure)."""
    found = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            found[key] = int(value)
    if len(found) != 2:
        raise ValueError("status: no voluntary_ctxt_switches / nonvoluntary_ctxt_switches lines")
    return found["voluntary_ctxt_switches"], found["nonvoluntary_ctxt_switches"]


def rates(before: list[ThreadSample], after: list[ThreadSample], seconds: float,
          batches_per_s: float) -> list[ThreadRate]:
    """Per thread seen at both moments (pure): its share of a core, its wait for one, and its
    sleeps and preemptions per training batch; the busiest first."""
    if seconds <= 0 or batches_per_s <= 0:
        raise ValueError(f"need a window and a batch rate above 0, got {seconds} s and {batches_per_s} batches/s")
    then = {(s.pid, s.tid): s for s in before}
    out = []
    for s in after:
        b = then.get((s.pid, s.tid))
        if b is None:
            continue
        batches = batches_per_s * seconds
        out.append(ThreadRate(s.role, s.tid, s.name, (s.cpu_ns - b.cpu_ns) / 1e9 / seconds,
                              (s.wait_ns - b.wait_ns) / 1e9 / seconds,
                              (s.voluntary - b.voluntary) / batches, (s.involuntary - b.involuntary) / batches))
    return sorted(out, key=lambda r: -r.cores)


def role_totals(per_thread: list[ThreadRate], samples_per_s: float) -> dict[str, dict[str, float]]:
    """Per role (pure): cores used in the window and CPU µs per training sample."""
    totals: dict[str, float] = {}
    for r in per_thread:
        totals[r.role] = totals.get(r.role, 0.0) + r.cores
    return {role: {"cores": c, "us_per_sample": c / samples_per_s * 1e6}
            for role, c in sorted(totals.items(), key=lambda kv: -kv[1])}


def outside_training(training: list[float] | None, began: float, ended: float) -> str | None:
    """Why the sampled window (unix times) is not all training, or None when it is (pure)."""
    if not training:
        return "the run did not report its training window"
    start, end = training
    if began < start:
        return (f"the window began {start - began:.1f} s before the first batch: part of it is start-up "
                "(a larger --after)")
    if ended > end:
        return (f"the window ended {ended - end:.1f} s after the last step: part of it is evaluation or "
                "shutdown (more --rows, or a smaller --after / --window)")
    return None


def table(per_thread: list[ThreadRate], totals: dict[str, dict[str, float]], samples_per_s: float,
          batch_size: int) -> str:
    """The report printed (pure)."""
    lines = [f"{samples_per_s:,.0f} samples/s ({samples_per_s / batch_size:.1f} batches/s)", "",
             "| role | cores | µs CPU per sample |", "|---|---|---|"]
    lines += [f"| {role} | {t['cores']:.3f} | {t['us_per_sample']:.1f} |" for role, t in totals.items()]
    lines += ["", "| role | thread | cores | waiting for a CPU | sleeps per batch | preempted per batch |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r.role} | {r.name} ({r.tid}) | {r.cores:.3f} | {r.waiting:.3f} | {r.sleeps_per_batch:.2f} | "
              f"{r.preempted_per_batch:.2f} |" for r in per_thread if r.cores >= MIN_SHARE or r.waiting >= MIN_SHARE]
    return "\n".join(lines)


def sample(root: int) -> list[ThreadSample]:
    """Every thread of every process of the run's tree now (threads gone meanwhile are skipped)."""
    out = []
    for pid in descendants(root):
        role = classify_role(cmdline(pid))
        if role in ("launcher", "other"):
            continue
        for task in (PROC / str(pid) / "task").glob("*"):
            try:
                cpu, wait = parse_schedstat((task / "schedstat").read_text())
                vol, invol = parse_switches((task / "status").read_text())
                name = (task / "comm").read_text().strip()
            except (OSError, ValueError):
                continue
            out.append(ThreadSample(role, pid, int(task.name), name, cpu, wait, vol, invol))
    return out


def measure(spec: RunSpec, after_s: float, window_s: float, env_extra: dict[str, str], log_path: Path) -> dict:
    from bench.e2e_bench import command_for, execute  # late: e2e_bench imports the benchmark's whole plan

    argv, env = command_for(spec, find_launcher())
    seen: dict = {}

    def window(pid: int) -> None:
        time.sleep(after_s)  # the run's own pace: nothing to wait on but the clock
        seen["before"], t0, seen["began"] = sample(pid), time.monotonic(), time.time()
        time.sleep(window_s)
        seen["after"], seen["seconds"], seen["ended"] = sample(pid), time.monotonic() - t0, time.time()

    rec = execute(with_role_env(argv, env_extra), env, spec.timeout_s, log_path, during=window)
    if rec["status"] != "ok":
        raise SystemExit(f"the run did not finish well ({rec['status']}: {rec.get('reason')}); its log: {log_path}")
    result = rec["result"]
    if not seen["after"]:
        raise SystemExit(f"the run ended before the window did ({after_s + window_s:.0f} s): more --rows")
    before, after, seconds = seen["before"], seen["after"], seen["seconds"]
    outside = outside_training(result.get("train_window_unix"), seen["began"], seen["ended"])
    if outside:
        print(f"warning: {outside}", file=sys.stderr)
    sps = float(result["samples_per_sec"])
    per_thread = rates(before, after, seconds, sps / spec.batch_size)
    return {"samples_per_sec": sps, "batch_size": spec.batch_size, "window_s": seconds,
            "roles": role_totals(per_thread, sps), "threads": [asdict(r) for r in per_thread],
            "spec": spec.model_dump(), "env": env_extra}


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env takes KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    from bench.e2e_bench import profile_data

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=["persia-hybrid", "persia-sync"], default="persia-hybrid")
    p.add_argument("--staleness", type=int, default=DEFAULT_HYBRID_STALENESS)
    p.add_argument("--mlp", default="mlp400", help="the synthetic-CTR model (mlp400, ffnn or 'a,b,c')")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rows", type=int, default=400_000, help="training rows (enough to outlast --after + --window)")
    p.add_argument("--nn-threads", default="auto", help="a count or 'auto' (persia-launcher local --nn-threads)")
    p.add_argument("--after", type=float, default=10.0, help="seconds from the start to the window")
    p.add_argument("--window", type=float, default=5.0, help="seconds between the two readings")
    p.add_argument("--env", type=_env_pair, action="append", default=[], help="KEY=VALUE for every role")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--output", type=Path, help="JSON file (default: <results>/threads.json)")
    a = p.parse_args(argv)
    if a.after < 0 or a.window <= 0:
        p.error(f"need --after >= 0 and --window > 0, got {a.after} and {a.window}")
    reason = launcher_unavailable_reason()
    if reason:
        raise SystemExit(f"cannot run our system: {reason}")
    nn_threads = a.nn_threads if a.nn_threads == "auto" else int(a.nn_threads)
    spec = RunSpec(system=a.system, data_dir=str(profile_data(a.results_dir)), mlp=a.mlp, batch_size=a.batch_size, train_rows=a.rows,
                   test_rows=2_000, eval_points=1, curve_eval_rows=1_000, nn_threads=nn_threads,
                   staleness=a.staleness if a.system == "persia-hybrid" else None)
    doc = measure(spec, a.after, a.window, dict(a.env), a.results_dir / "logs" / "threads.log")
    print(table([ThreadRate(**t) for t in doc["threads"]], doc["roles"], doc["samples_per_sec"], a.batch_size))
    print(f"\nwritten {write_results(doc, a.output or a.results_dir / 'threads.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
