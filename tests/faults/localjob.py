"""A `persia-launcher local` run driven from a test: real processes, read line by line, so a test
can wait for a point in training (a poll with a deadline, never a sleep) and then do harm."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "adult-income"
SLOW_LOADER = Path(__file__).resolve().parent / "slow_loader.py"
TRAINER = EXAMPLE / "train.py"


class LocalRun:
    def __init__(self, *flags: str, loader: Path = SLOW_LOADER, env: dict[str, str] | None = None,
                 job: str = "faults", trainer: Path = TRAINER):
        cmd = [
            sys.executable, "-m", "persia.launcher", "local",
            "--nn-worker", str(trainer), "--data-loader", str(loader),
            "--embedding-config", str(EXAMPLE / "config" / "embedding_config.yml"),
            "--global-config", str(EXAMPLE / "config" / "global_config.yml"),
            "--no-progress", "--job-name", job, *flags,
        ]
        # its own session: signals sent to "the job's process group" reach the launcher's group only
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, **(env or {})), start_new_session=True)
        self.lines: list[str] = []
        self.eof = False  # the pipe has ended: every line the job wrote is in ``lines``
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        finally:
            with self._changed:
                self.eof = True
                self._changed.notify_all()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, deadline_s: float = 120.0, start: int = 0) -> re.Match:
        """The first line (from index ``start``) matching ``pattern``; fails the test at the deadline."""
        return self.wait_index(pattern, deadline_s, start)[1]

    def wait_index(self, pattern: str, deadline_s: float = 120.0, start: int = 0) -> tuple[int, re.Match]:
        """``wait_for``, with the index of the matching line (to search before or after it)."""
        rx = re.compile(pattern)
        end = time.monotonic() + deadline_s
        i = start
        with self._changed:
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return i, m
                    i += 1
                left = end - time.monotonic()
                # the launcher having exited is not the end: the pipe may still hold lines unread
                if left <= 0 or (self.eof and i >= len(self.lines)):
                    raise AssertionError(f"no line matching {pattern!r} within {deadline_s}s:\n{self.text[-6000:]}")
                self._changed.wait(min(left, 0.5))

    def published_checkpoint(self, at_least: int, start: int = 0, deadline_s: float = 120.0) -> tuple[int, int]:
        """(line index, step) of the first checkpoint the NN worker publishes (from ``start``) at
        step ``at_least`` or later: a fault injected late lets the job publish the next one first."""
        end = time.monotonic() + deadline_s
        i = start
        while True:
            i, m = self.wait_index(r"\[nn\].*checkpoint step (\d+) published", max(0.0, end - time.monotonic()), i)
            if int(m.group(1)) >= at_least:
                return i, int(m.group(1))
            i += 1

    def pid_of(self, role: str, start: int = 0) -> int:
        return int(self.wait_for(rf"started {re.escape(role)} \(pid (\d+)\)", start=start).group(1))

    def finish(self, deadline_s: float = 300.0, drain_s: float = 30.0) -> int:
        """The launcher's exit code, once its output is all in ``lines`` (its last lines, the
        run's outcome, may still be in the pipe when it exits). A role that outlived it and still
        holds the pipe open bounds the wait at ``drain_s``."""
        try:
            return self.proc.wait(deadline_s)
        finally:
            self.kill()
            self._reader.join(drain_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], deadline_s: float = 15.0) -> list[int]:
    """The pids still running after the deadline (polling)."""
    end = time.monotonic() + deadline_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


def children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), so a test can check none outlives it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out
