"""A CPU of its own for the NN worker's training thread (``PERSIA_TRAINING_CPUS``).

Why: on a machine the roles share, the training thread is the job's critical path, and every
other thread (the NN worker's lookup threads and NATS loop, gRPC's, the other roles') wakes up on
whichever CPU the kernel picks. A wake-up on the training thread's CPU preempts it, and the
kernel's wake-affine placement pulls the training thread itself onto its waker's CPU, where it
queues while another CPU idles. On 2 cores (MLP 400, batch 256) the training thread waited for a
core 1.8 ms of a 13 ms step; given CPU 0 alone, with every other thread of every role on CPU 1,
it waited 0.04 ms, and the job trained 13 % faster at the median of four interleaved pairs
(docs/benchmarks.md, issue 15, session 20).
This is what the kubelet's static CPU manager does for a Guaranteed pod, one level down.

``PERSIA_TRAINING_CPUS`` lists one CPU per local NN rank (``LOCAL_RANK`` picks its own), or is
``auto``: the lowest ``LOCAL_WORLD_SIZE`` of the CPUs the process runs on, one per local rank, when
they are the container's own (its CPU quota, if any, covers all of them: what the kubelet's static
CPU manager gives a Guaranteed pod) and at least one is left for the other threads. While the
rank trains on one torch thread, its training thread runs on that CPU alone and every other
thread of the process on the CPUs the process was started with, less every rank's training CPU.
On several torch threads (a count the thread tuner tries, or a fixed one) the training thread and
its OpenMP team may use all of those CPUs plus its own: placing a team on one CPU would serialize
it. ``persia-launcher local`` sets CPU numbers (``--cpu-placement``) and starts every other role on
the remaining CPUs; the operator sets ``auto`` in NN worker pods, whose other processes' CPUs are
the pod's business.

Threads started after placement inherit their creator's CPUs, so threads the training thread
starts later (a data loader's dispatcher, a pool's workers) would land on its CPU: the process's
threads are swept back onto the shared CPUs when the thread count changes and after steps 1, 2,
4, 8, ... and every 1,000th, a few system calls each time.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from persia.errors import PersiaValidationError
from persia.nn_worker.openmp_team import on_each_team_thread

log = logging.getLogger(__name__)

ENV = "PERSIA_TRAINING_CPUS"
AUTO = "auto"
SWEEP_EVERY = 1000  # steps, after the first powers of two
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CpuPlan:
    """Where a rank's threads run. ``own``: the training thread on one torch thread; ``shared``:
    the training thread and its OpenMP team on several; ``rest``: every other thread."""

    own: int
    rest: frozenset[int]
    shared: frozenset[int]


def auto_cpus(allowed: frozenset[int], local_world_size: int,
              cpu_quota: float | None) -> tuple[list[int] | None, str]:
    """``auto``'s training CPUs, one per local rank, and why none (pure): the lowest of ``allowed``
    when they are the container's own (no CPU quota, or one that covers them all) and at least
    one is left for the other threads."""
    n = len(allowed)
    if local_world_size < 1:
        raise PersiaValidationError(f"LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
    if cpu_quota is not None and cpu_quota < n:
        return None, (f"{ENV}={AUTO}: not placed, this process may run on {n} CPUs ({format_cpus(allowed)}) but its "
                      f"CPU quota is {cpu_quota:g}: they are shared with other containers (a Guaranteed pod gets "
                      "CPUs of its own from the kubelet's static CPU manager)")
    if n <= local_world_size:
        return None, (f"{ENV}={AUTO}: not placed, {n} CPU(s) ({format_cpus(allowed)}) for {local_world_size} local "
                      "NN rank(s) leave none for the other threads")
    return sorted(allowed)[:local_world_size], ""


def cpu_plan(value: str | None, local_rank: int, allowed: Iterable[int], local_world_size: int = 1,
             cpu_quota: float | None = None) -> tuple[CpuPlan | None, str]:
    """The plan for ``local_rank`` from the setting's text and the CPUs the process runs on now,
    and why (pure). No plan when unset or when no CPU would be left for the other threads.
    ``auto`` (see :func:`auto_cpus`) needs the number of local ranks and the container's CPU
    quota in CPUs (None: no quota)."""
    if value is None or not value.strip():
        return None, f"{ENV} unset: the kernel places every thread"
    allowed = frozenset(allowed)
    if value.strip().lower() == AUTO:
        picked, why = auto_cpus(allowed, local_world_size, cpu_quota)
        if picked is None:
            return None, why
        value = ",".join(map(str, picked))
    cpus: list[int] = []
    for item in value.split(","):
        try:
            cpu = int(item.strip())
        except ValueError:
            cpu = -1
        if cpu < 0:
            raise PersiaValidationError(
                f"{ENV} must be {AUTO!r} or list CPU numbers (>= 0), one per local NN rank, separated by commas; "
                f"got {value!r}")
        cpus.append(cpu)
    if len(set(cpus)) != len(cpus):
        raise PersiaValidationError(f"{ENV} names a CPU twice; each local NN rank needs its own: got {value!r}")
    if not 0 <= local_rank < len(cpus):
        raise PersiaValidationError(
            f"{ENV}={value!r} names {len(cpus)} CPU(s), one per local NN rank, but this is local rank {local_rank}")
    own = cpus[local_rank]
    rest = allowed - set(cpus)
    if not rest:
        return None, (f"{ENV}={value!r}: not placed, no CPU would be left for the other threads "
                      f"(this process runs on CPUs {format_cpus(allowed)})")
    return CpuPlan(own, rest, rest | {own}), f"training thread on CPU {own}, other threads on CPUs {format_cpus(rest)}"


def thread_masks(plan: CpuPlan, threads: int, tids: Iterable[int], training: int,
                 team: frozenset[int]) -> dict[int, frozenset[int]]:
    """The CPUs of each thread of the process (pure): the training thread alone on its CPU on one
    torch thread; it and its OpenMP team on the shared CPUs on several; everything else on the rest."""
    masks = {}
    for tid in tids:
        if tid == training:
            masks[tid] = frozenset({plan.own}) if threads <= 1 else plan.shared
        elif threads > 1 and tid in team:
            masks[tid] = plan.shared
        else:
            masks[tid] = plan.rest
    return masks


def sweep_due(step: int) -> bool:
    """After steps 1, 2, 4, 8, ... (threads are started early) and every ``SWEEP_EVERY``th."""
    return step > 0 and (step & (step - 1) == 0 or step % SWEEP_EVERY == 0)


def format_cpus(cpus: Iterable[int]) -> str:
    """``0-3,6``: the kernel's list format."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _process_threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"<quota> <period>"``) as CPUs, None for no
    quota (pure)."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota, period = int(parts[0]), int(parts[1])
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` as CPUs, None for no quota (-1):
    the same pair as v2's ``cpu.max``, in two files."""
    return parse_cpu_max(f"{quota_text.strip()} {period_text.strip()}")


def cgroup_cpu_quota(root: str = CGROUP_ROOT) -> float | None:
    """This container's CPU quota in CPUs (cgroup v2, else v1), None when it has none or it
    cannot be read (then ``auto`` places as if the CPUs were its own)."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            return parse_cpu_max(f.read())
    except (OSError, ValueError):
        pass
    for sub in ("cpu", "cpu,cpuacct"):
        try:
            with open(os.path.join(root, sub, "cpu.cfs_quota_us")) as q, \
                    open(os.path.join(root, sub, "cpu.cfs_period_us")) as p:
                return parse_cfs(q.read(), p.read())
        except (OSError, ValueError):
            continue
    return None


class TrainingPlacement:
    """Applies a :class:`CpuPlan` to this process's threads; made on the training thread, which
    must call every method. :meth:`stop` puts every thread back on the CPUs the process started
    with."""

    def __init__(self, plan: CpuPlan, why: str = ""):
        self.plan, self.why = plan, why
        self.training = threading.get_native_id()
        self.started_on = frozenset(os.sched_getaffinity(0))
        self.threads = 1
        self.team: frozenset[int] = frozenset()
        self.steps = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, local_rank: int = 0) -> "TrainingPlacement | None":
        environ = os.environ if environ is None else environ
        if not hasattr(os, "sched_setaffinity"):
            if environ.get(ENV):
                log.warning("CPU placement: %s is set, but this platform cannot set a thread's CPUs", ENV)
            return None
        value = environ.get(ENV)
        auto = (value or "").strip().lower() == AUTO
        try:
            local_world_size = int(environ.get("LOCAL_WORLD_SIZE") or 1)
        except ValueError:
            raise PersiaValidationError(
                f"LOCAL_WORLD_SIZE must be a count, got {environ.get('LOCAL_WORLD_SIZE')!r}") from None
        plan, why = cpu_plan(value, local_rank, os.sched_getaffinity(0), local_world_size,
                             cgroup_cpu_quota() if auto else None)
        if plan is None:
            if value:  # auto on a pod without CPUs of its own is expected; a list that fits nothing is not
                (log.info if auto else log.warning)("CPU placement: %s", why)
            return None
        return cls(plan, why)

    def start(self, threads: int) -> "TrainingPlacement":
        self.threads_changed(threads)
        log.info("CPU placement: %s (the process started on CPUs %s)", self.why, format_cpus(self.started_on))
        return self

    def threads_changed(self, threads: int) -> None:
        """The torch thread count is now ``threads`` (called after ``torch.set_num_threads``)."""
        self.threads = threads
        if threads > 1:
            # the training thread first: team threads the runtime makes now inherit its CPUs
            self._set(self.training, self.plan.shared)
            tids = on_each_team_thread(self._join_team, threads)
            self.team = frozenset(tids or ())
        self.sweep()

    def _join_team(self) -> int:
        os.sched_setaffinity(0, self.plan.shared)
        return threading.get_native_id()

    def step_done(self) -> None:
        self.steps += 1
        if sweep_due(self.steps):
            self.sweep()

    def sweep(self) -> None:
        masks = thread_masks(self.plan, self.threads, _process_threads(), self.training, self.team)
        for tid, cpus in masks.items():
            self._set(tid, cpus)

    def stop(self) -> None:
        for tid in _process_threads():
            self._set(tid, self.started_on)

    def _set(self, tid: int, cpus: frozenset[int]) -> None:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError as exc:
            if tid == self.training:
                raise PersiaValidationError(
                    f"{ENV}: cannot run the training thread on CPUs {format_cpus(cpus)}: {exc}") from None
            log.debug("CPU placement: thread %d stays where it is: %s", tid, exc)
