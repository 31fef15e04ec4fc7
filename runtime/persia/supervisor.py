"""What a role's exit means for a local job, decided by pure functions.

Local mode's supervisor (:mod:`persia.local`) feeds every process exit through :func:`decide`:
the job finishes, keeps going, is restarted as a whole from its latest checkpoint, or fails with a
reason that names the role and how it died. The rules are the operator's defaults too: an exit
code of 1-127 is the program's own verdict (a bug or a bad config does not heal by restarting), a
death by signal (or code >= 128, a shell's way of saying the same) is the environment's and is
restarted; a server (PS, embedding worker) is never supposed to exit while the job runs.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

SERVER_KINDS = ("ps", "ew")


def signal_of(returncode: int) -> int | None:
    """The signal that ended a process: Popen reports ``-N``; shells and launchers ``128 + N``."""
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + 65:
        return returncode - 128
    return None


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL`` / ``exit code 3``: what a person needs to read in the log."""
    signum = signal_of(returncode)
    if signum is None:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by {name}" if returncode < 0 else f"exit code {returncode} ({name})"


class Action(Enum):
    CONTINUE = "continue"  # nothing to do (a data loader finished its stream)
    SUCCEED = "succeed"  # the trainer finished
    RESTART_JOB = "restart-job"  # stop every role, start them again; they resume from a checkpoint
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""


def decide(role: str, kind: str, returncode: int, *, restarts: int, max_restarts: int) -> Decision:
    """The job's answer to ``role`` (of ``kind`` ps|ew|nn|dl) exiting with ``returncode``."""
    how = describe_exit(returncode)
    if returncode == 0 and kind == "nn":
        return Decision(Action.SUCCEED)
    if returncode == 0 and kind == "dl":
        return Decision(Action.CONTINUE)
    retryable = kind in SERVER_KINDS or signal_of(returncode) is not None
    what = f"{role} {how}" if kind not in SERVER_KINDS else f"server {role} exited ({how})"
    if not retryable:
        return Decision(Action.FAIL, f"{what}: not restarted (an exit code below 128 is the program's own error)")
    if restarts >= max_restarts:
        return Decision(Action.FAIL, f"{what}; no restarts left ({restarts} of --max-restarts {max_restarts} used)")
    return Decision(Action.RESTART_JOB, f"{what}; restarting the job ({restarts + 1}/{max_restarts})")
