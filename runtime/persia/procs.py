"""Child processes that never outlive the process that started them.

A launcher killed with SIGKILL cannot clean up, so every child asks the kernel to signal it when
its parent dies (``PR_SET_PDEATHSIG``) and runs in its own session, so that a Ctrl-C in the
terminal reaches only the launcher, which then stops the roles in order (trainers first, servers
next, nats-server last) instead of every process dying at once and the survivors logging
tracebacks about the dead.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int, parent: int):
    def prepare() -> None:  # runs in the child between fork and exec
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(128 + sig)

    return prepare


def spawn(argv: list[str], *, env: dict[str, str] | None = None, parent_death_signal: int = signal.SIGTERM,
          own_session: bool = True, **kwargs) -> subprocess.Popen:
    """``Popen`` whose child gets ``parent_death_signal`` when this process dies, however it dies."""
    return subprocess.Popen(
        argv, env=env, start_new_session=own_session,
        preexec_fn=_die_with_parent(parent_death_signal, os.getpid()), **kwargs,
    )


def stop_in_order(groups: list[list[subprocess.Popen]], grace_s: float, *, kill_groups: bool = False) -> None:
    """SIGTERM each group in turn and wait for it (within one shared grace period), then SIGKILL
    whatever is left. Earlier groups are the ones that still need the later ones to shut down
    cleanly (a trainer flushing updates needs its servers). ``kill_groups``: the processes were
    started in sessions of their own (:func:`spawn`'s default), and the SIGKILL goes to each one's
    whole process group, so that what it started (the nn launcher's ranks) dies with it."""
    end = time.monotonic() + grace_s
    for group in groups:
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in group:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for group in groups:
        for p in group:
            if p.poll() is None:
                if kill_groups:
                    _kill_group(p)
                p.kill()
                p.wait()


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group when ``p`` leads one (it was started with a session of its own)."""
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
