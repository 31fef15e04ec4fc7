"""Which observed failures end the job and which restart it.

PERSIA's roles are coupled (the NN workers train in lock-step, the servers hold the
embeddings the workers read), so a failed pod of any role restarts the whole job.
Exit codes >= 128 (killed by a signal: OOM kill, node drain, preemption) and evictions
are retried; exit codes 1-127 are the program's own error and fail the job at once
(the training-operator's ExitCode rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import constants as C
from . import naming
from .children import Children, PodState
from .render import workload_kind
from .spec import PersiaJobSpec


@dataclass(frozen=True)
class Failure:
    role: str
    source: str  # "pod <name>" or "Job <name>"
    retryable: bool
    reason: str  # condition reason: PodFailed, PodEvicted, PermanentExitCode, BackoffLimitExceeded
    message: str


def retryable_exit_code(code: int) -> bool:
    return code >= 128


def _pod_failure(role: str, pod: PodState, always_restarts: bool) -> Failure | None:
    """A failure of `pod`, or None. `always_restarts`: the kubelet restarts its containers
    in place (StatefulSet/Deployment), so a terminated container is the signal."""
    field = C.ROLE_FIELDS[role]
    if pod.phase == "Failed" and (pod.reason == "Evicted" or pod.disrupted):
        why = pod.reason or "DisruptionTarget"
        return Failure(role, f"pod {pod.name}", True, "PodEvicted",
                       f"{field} pod {pod.name} was evicted or disrupted ({why})")  # fmt: skip
    if pod.phase != "Failed" and not (always_restarts and pod.terminations):
        return None
    codes = [t for t in pod.terminations if t.exit_code not in (None, 0)]
    if not codes:
        if pod.phase != "Failed":
            # A server container that exited 0 is still a lost server; retry it.
            term = pod.terminations[0]
            return Failure(role, f"pod {pod.name}", True, "PodFailed",
                           f"{field} pod {pod.name}: container {term.container} exited")  # fmt: skip
        return Failure(role, f"pod {pod.name}", True, "PodFailed",
                       f"{field} pod {pod.name} failed without an exit code ({pod.reason or 'unknown'})")  # fmt: skip
    term = codes[0]
    code = term.exit_code or 0
    detail = f" ({term.reason})" if term.reason else ""
    exited = f"{field} pod {pod.name}: container {term.container} exited with code {code}{detail}"
    if retryable_exit_code(code):
        return Failure(role, f"pod {pod.name}", True, "PodFailed", exited)
    return Failure(role, f"pod {pod.name}", False, "PermanentExitCode", f"{exited}; exit codes 1-127 are not retried")


def find_failures(spec: PersiaJobSpec, job_name: str, children: Children, attempt: int) -> list[Failure]:
    """Failures of the current attempt, in role order."""
    failures: list[Failure] = []
    for role in C.TRAINING_ROLES:
        if spec.role(role) is None:
            continue
        kind = workload_kind(spec, role)
        in_place = kind != "Job"
        role_failures = []
        for pod in children.pods_of(role, attempt):
            if pod.deleting and pod.phase != "Failed":
                continue
            if kind == "Job" and spec.restart_policy == "OnFailure" and pod.phase != "Failed":
                continue  # in-place retries are the Job's business
            failure = _pod_failure(role, pod, in_place)
            if failure is not None:
                role_failures.append(failure)
        workload = children.workload(kind, naming.workload_name(job_name, role))
        if kind == "Job" and workload is not None and workload.attempt == str(attempt) and workload.job_failed:
            field = C.ROLE_FIELDS[role]
            if spec.restart_policy == "OnFailure":
                role_failures.append(Failure(role, f"Job {workload.name}", False, "BackoffLimitExceeded",
                                             f"{field} Job {workload.name} failed "
                                             f"({workload.job_failed_reason or 'Failed'}) after in-place "
                                             "retries (restartPolicy OnFailure)"))  # fmt: skip
            elif not role_failures:
                role_failures.append(Failure(role, f"Job {workload.name}", True, "PodFailed",
                                             f"{field} Job {workload.name} failed "
                                             f"({workload.job_failed_reason or 'Failed'})"))  # fmt: skip
        failures += role_failures
    return failures


@dataclass(frozen=True)
class FailureDecision:
    fail: bool
    reason: str
    message: str


def decide(failures: list[Failure], restart_count: int, backoff_limit: int) -> FailureDecision | None:
    """Fail on any permanent failure or when restarts are used up; else restart."""
    if not failures:
        return None
    permanent = [f for f in failures if not f.retryable]
    if permanent:
        return FailureDecision(True, permanent[0].reason, permanent[0].message)
    first = failures[0]
    if restart_count >= backoff_limit:
        return FailureDecision(
            True,
            "BackoffLimitExceeded",
            f"{first.message}; {restart_count} of {backoff_limit} restarts used (runPolicy.backoffLimit)",
        )
    reason = "PodEvicted" if all(f.reason == "PodEvicted" for f in failures) else "PodFailed"
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return FailureDecision(
        False, reason, f"restart {restart_count + 1} of {backoff_limit}: {first.message}{more}"
    )
