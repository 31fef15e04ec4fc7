"""Which observed failures end the job, restart it, or are ignored: failure rules.

PERSIA's roles are coupled (the NN workers train in lock-step, the servers hold the
embeddings the workers read), so a failure of any role is a failure of the whole job.
What to do about it is decided by rules in the manner of JobSet's failure policy:
`spec.failurePolicy.rules` first, then the defaults below; the first rule that matches
a failure gives its action. When several pods failed, the earliest failure decides
(a preempted PS makes the NN workers exit with errors moments later: the preemption is
the cause), and failures without a time come after those with one.

Everything here is pure: `find_failures` reads observed pods, `decide` applies rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import constants as C
from . import naming
from .children import Children, PodState
from .render import workload_kind
from .spec import ExitCodes, FailureRule, PersiaJobSpec

FAIL, RESTART, RESTART_UNCOUNTED, IGNORE = "FailJob", "RestartJob", "RestartJobAndIgnoreMaxRestarts", "Ignore"

# Safe defaults, after the user's rules. Preemptions, evictions and replaced stateful
# pods are not the program's fault: they restart the job without using backoffLimit.
DEFAULT_RULES = (
    FailureRule(name="disruptions-do-not-count", action=RESTART_UNCOUNTED,
                on_pod_conditions=["DisruptionTarget", "Evicted"]),
    FailureRule(name="stateful-pod-replaced", action=RESTART_UNCOUNTED, on_pod_conditions=["Replaced"]),
    FailureRule(name="oom-killed", action=RESTART, on_pod_conditions=["OOMKilled"]),
    FailureRule(name="killed-by-signal", action=RESTART,
                on_exit_codes=ExitCodes(operator="NotIn", values=list(range(128)))),
    FailureRule(name="program-error", action=FAIL,
                on_exit_codes=ExitCodes(operator="In", values=list(range(1, 128)))),
    FailureRule(name="other-failures", action=RESTART),
)  # fmt: skip


@dataclass(frozen=True)
class Failure:
    role: str
    source: str  # "pod <name>" or "Job <name>"
    reason: str  # status reason when this failure restarts the job
    message: str
    exit_code: int | None = None
    conditions: frozenset[str] = frozenset()  # of spec.POD_FAILURE_CONDITIONS
    at: str | None = None  # RFC 3339, when it happened (None: unknown)


@dataclass(frozen=True)
class FailureDecision:
    fail: bool
    reason: str
    message: str
    counted: bool = True  # the restart uses one of runPolicy.backoffLimit


def rule_matches(rule: FailureRule, failure: Failure) -> bool:
    if rule.roles and C.ROLE_FIELDS[failure.role] not in rule.roles:
        return False
    if rule.on_exit_codes is not None and not rule.on_exit_codes.matches(failure.exit_code):
        return False
    if rule.on_pod_conditions and not failure.conditions & set(rule.on_pod_conditions):
        return False
    return True


def rule_for(rules: list[FailureRule], failure: Failure) -> FailureRule:
    """The first matching rule (the defaults end with a catch-all)."""
    return next(r for r in (*rules, *DEFAULT_RULES) if rule_matches(r, failure))


def _replaced(role: str, pod_name: str, why: str, at: str | None) -> Failure:
    reason = "PSReplaced" if role == C.ROLE_PS else "EmbeddingWorkerReplaced"
    return Failure(role, f"pod {pod_name}", reason,
                   f"{C.ROLE_FIELDS[role]} pod {pod_name} {why}: its state is lost", None,
                   frozenset({"Replaced"}), at)  # fmt: skip


def stateful_failures(role: str, pods: list[PodState], known: dict[str, str]) -> list[Failure]:
    """Pods of a stateful role that were replaced or deleted after they started.

    `known`: pod name -> uid of the pods seen started in this attempt (status.statefulPods).
    A StatefulSet re-creates a lost pod under the same name, so only the uid tells."""
    failures = []
    by_name = {p.name: p for p in pods}
    for name, uid in sorted(known.items()):
        if not name.startswith(f"{role}:"):
            continue
        pod_name = name.split(":", 1)[1]
        pod = by_name.get(pod_name)
        if pod is None:
            failures.append(_replaced(role, pod_name, "was deleted", None))
        elif pod.uid is not None and pod.uid != uid:
            failures.append(_replaced(role, pod_name, f"was replaced (uid {uid} -> {pod.uid})", pod.created))
        elif pod.deleting:
            failures.append(_replaced(role, pod_name, "is being deleted", pod.deleted_at))
    return failures


def _pod_failure(role: str, pod: PodState, always_restarts: bool) -> Failure | None:
    """A failure of `pod`, or None. `always_restarts`: the kubelet restarts its containers
    in place (StatefulSet/Deployment), so a terminated or restarted container is the signal."""
    field = C.ROLE_FIELDS[role]
    source = f"pod {pod.name}"
    conditions = set()
    if pod.disrupted:
        conditions.add("DisruptionTarget")
    if pod.reason == "Evicted":
        conditions.add("Evicted")
    if pod.phase == "Failed" and conditions:
        preempted = (pod.disruption_reason or "").startswith("Preemption")
        why = pod.disruption_reason or pod.reason or "DisruptionTarget"
        return Failure(role, source, "PodPreempted" if preempted else "PodEvicted",
                       f"{field} pod {pod.name} was {'preempted' if preempted else 'evicted or disrupted'} ({why})",
                       None, frozenset(conditions), pod.disrupted_at)  # fmt: skip
    restarted = always_restarts and (pod.terminations or pod.restarts)
    if pod.phase != "Failed" and not restarted:
        return None
    codes = [t for t in pod.terminations if t.exit_code not in (None, 0)]
    if any(t.reason == "OOMKilled" for t in pod.terminations):
        conditions.add("OOMKilled")
    if not codes:
        conditions.add("NoExitCode")
        if pod.phase != "Failed":
            # A server container that exited 0 (or restarted unseen) is still a lost server.
            what = f"container {pod.terminations[0].container} exited" if pod.terminations else "container restarted"
            at = pod.terminations[0].finished_at if pod.terminations else None
            return Failure(role, source, "PodFailed", f"{field} pod {pod.name}: {what}", None,
                           frozenset(conditions), at)  # fmt: skip
        return Failure(role, source, "PodFailed",
                       f"{field} pod {pod.name} failed without an exit code ({pod.reason or 'unknown'})",
                       None, frozenset(conditions), None)  # fmt: skip
    term = codes[0]
    detail = f" ({term.reason})" if term.reason else ""
    return Failure(role, source, "PodFailed",
                   f"{field} pod {pod.name}: container {term.container} exited with code {term.exit_code}{detail}",
                   term.exit_code, frozenset(conditions), term.finished_at)  # fmt: skip


def find_failures(spec: PersiaJobSpec, job_name: str, children: Children, attempt: int,
                  known: dict[str, str] | None = None) -> list[Failure]:  # fmt: skip
    """Failures of the current attempt, in role order."""
    failures: list[Failure] = []
    stateful = {r for r in C.TRAINING_ROLES if C.ROLE_FIELDS[r] in spec.failure_policy.stateful_roles}
    for role in C.TRAINING_ROLES:
        if spec.role(role) is None:
            continue
        kind = workload_kind(spec, role)
        in_place = kind != "Job"
        role_failures = []
        pods = children.pods_of(role, attempt)
        for pod in pods:
            if pod.deleting and pod.phase != "Failed":
                continue
            if kind == "Job" and spec.restart_policy == "OnFailure" and pod.phase != "Failed":
                continue  # in-place retries are the Job's business
            failure = _pod_failure(role, pod, in_place)
            if failure is not None:
                role_failures.append(failure)
        if role in stateful:
            seen = {f.source for f in role_failures}
            role_failures += [f for f in stateful_failures(role, pods, known or {}) if f.source not in seen]
        workload = children.workload(kind, naming.workload_name(job_name, role))
        if kind == "Job" and workload is not None and workload.attempt == str(attempt) and workload.job_failed:
            field = C.ROLE_FIELDS[role]
            if spec.restart_policy == "OnFailure":
                role_failures.append(Failure(role, f"Job {workload.name}", "BackoffLimitExceeded",
                                             f"{field} Job {workload.name} failed "
                                             f"({workload.job_failed_reason or 'Failed'}) after in-place "
                                             "retries (restartPolicy OnFailure)", 1))  # fmt: skip
            elif not role_failures:
                role_failures.append(Failure(role, f"Job {workload.name}", "PodFailed",
                                             f"{field} Job {workload.name} failed "
                                             f"({workload.job_failed_reason or 'Failed'})",
                                             None, frozenset({"NoExitCode"})))  # fmt: skip
        failures += role_failures
    return failures


def _fail_reason(rule: FailureRule, failure: Failure) -> str:
    if rule.name == "program-error" and rule in DEFAULT_RULES:
        return "PermanentExitCode" if failure.reason == "PodFailed" else failure.reason
    return "PodFailurePolicy"


def decide(failures: list[Failure], rules: list[FailureRule], restart_count: int,
           backoff_limit: int) -> FailureDecision | None:  # fmt: skip
    """Apply the rules to the earliest failure that is not ignored; None: nothing to do."""
    ranked = sorted(enumerate(failures), key=lambda nf: (nf[1].at is None, nf[1].at or "", nf[0]))
    decided = [(f, rule_for(rules, f)) for _, f in ranked]
    acting = [(f, r) for f, r in decided if r.action != IGNORE]
    if not acting:
        return None
    first, rule = acting[0]
    named = f" (failurePolicy rule {rule.name})" if rule.name and rule not in DEFAULT_RULES else ""
    more = f" (and {len(acting) - 1} more)" if len(acting) > 1 else ""
    if rule.action == FAIL:
        reason = _fail_reason(rule, first)
        tail = "; exit codes 1-127 are not retried" if reason == "PermanentExitCode" else ""
        return FailureDecision(True, reason, f"{first.message}{named}{tail}")
    if rule.action == RESTART_UNCOUNTED:
        return FailureDecision(False, first.reason, f"restart not counted against backoffLimit: "
                                                    f"{first.message}{named}{more}", counted=False)  # fmt: skip
    if restart_count >= backoff_limit:
        return FailureDecision(
            True,
            "BackoffLimitExceeded",
            f"{first.message}{named}; {restart_count} of {backoff_limit} restarts used (runPolicy.backoffLimit)",
        )
    return FailureDecision(
        False, first.reason, f"restart {restart_count + 1} of {backoff_limit}: {first.message}{named}{more}"
    )
