"""`derive_status(job, children, now) -> status`: the whole decision of a reconcile pass.

Pure: from the stored job (spec as the user wrote it, previous status) and what was
observed of its children, compute the next status: conditions, phase, counts, and the
bookkeeping that drives the actions (attempt, restartCount, acceptedSpec). plan.py then
turns this status into API calls; nothing here talks to a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from . import constants as C
from . import failures, naming
from .acceptance import Acceptance, accept_spec
from .children import Children
from .conditions import derive_phase, parse_time, set_condition, timestamp
from .job import JobStatus, PersiaJob, ReplicaStatus
from .render import RUN_TO_COMPLETION_ROLES, render, workload_kind
from .natsinfo import NatsObservation, redact
from .spec import JobMeta, PersiaJobSpec, SpecError, check_job_name, check_queue_label, parse_spec


class ObservedJob(BaseModel):
    """The PersiaJob as stored: its spec is unvalidated user input."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    metadata: JobMeta
    spec: Any = None
    status: JobStatus = Field(default_factory=JobStatus)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "ObservedJob":
        from .job import parse_status

        meta = JobMeta.model_validate(body.get("metadata") or {})
        return cls(metadata=meta, spec=body.get("spec"),
                   status=parse_status(body.get("status"), job=f"{meta.namespace}/{meta.name}"))


@dataclass(frozen=True)
class ChildError:
    """An API error while creating or changing a child."""

    kind: str
    name: str
    code: int | None
    message: str
    action: str = "create"  # or "patch": a change to a child that exists (a serving resize)

    @property
    def permanent(self) -> bool:
        """400/422 (the manifest is rejected) will not get better by retrying."""
        return self.code in (400, 422)


def effective_job(meta: JobMeta, status: JobStatus) -> PersiaJob | None:
    """The job as it runs: accepted spec, current attempt."""
    if status.accepted_spec is None:
        return None
    try:
        spec = parse_spec(status.accepted_spec)
    except SpecError:
        return None
    return PersiaJob(metadata=meta, spec=spec, status=status)


def count_replicas(spec: PersiaJobSpec, job_name: str, children: Children, attempt: int) -> dict[str, ReplicaStatus]:
    """Per-role pod counts of the current attempt (plus NATS when managed)."""
    counts: dict[str, ReplicaStatus] = {}
    for role in C.TRAINING_ROLES:
        role_spec = spec.role(role)
        if role_spec is None:
            continue
        pods = [p for p in children.pods_of(role, attempt) if not p.deleting]
        desired = role_spec.replicas
        ready = sum(1 for p in pods if p.ready and p.phase == "Running")
        active = sum(1 for p in pods if p.phase in ("Pending", "Running"))
        succeeded = sum(1 for p in pods if p.phase == "Succeeded")
        failed = sum(1 for p in pods if p.phase == "Failed")
        workload = children.workload(workload_kind(spec, role), naming.workload_name(job_name, role))
        if workload is not None and workload.kind == "Job" and workload.attempt == str(attempt):
            succeeded = max(succeeded, workload.succeeded)
            failed = max(failed, workload.failed)
        counts[C.ROLE_FIELDS[role]] = ReplicaStatus(
            desired=desired, active=active, ready=ready, succeeded=succeeded, failed=failed,
            ready_ratio=f"{ready}/{desired}",
        )  # fmt: skip
    if spec.nats_managed():
        pods = [p for p in children.pods if p.role == C.ROLE_NATS and not p.deleting]
        ready = sum(1 for p in pods if p.ready and p.phase == "Running")
        counts["nats"] = ReplicaStatus(
            desired=spec.nats.replicas,
            active=sum(1 for p in pods if p.phase in ("Pending", "Running")),
            ready=ready,
            failed=sum(1 for p in pods if p.phase == "Failed"),
            ready_ratio=f"{ready}/{spec.nats.replicas}",
        )
    return counts


# Children the job runs without: failing to create one is reported, not waited for.
AUXILIARY_KINDS = ("PodDisruptionBudget",)


def missing_children(job: PersiaJob, children: Children) -> list[str]:
    """Desired children of the current attempt that are not observed (kind/name)."""
    missing = []
    for manifest in render(job):
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind in AUXILIARY_KINDS:
            continue
        if kind in ("StatefulSet", "Job", "Deployment"):
            workload = children.workload(kind, name)
            wanted = manifest["metadata"]["labels"].get(C.LABEL_ATTEMPT)
            if workload is None or workload.deleting or workload.attempt != wanted:
                missing.append(f"{kind}/{name}")
        elif (kind, name) not in children.objects:
            missing.append(f"{kind}/{name}")
    if ("Secret", naming.auth_secret_name(job.name)) not in children.objects:
        missing.append(f"Secret/{naming.auth_secret_name(job.name)}")
    return missing


def _waiting_note(children: Children, role: str, attempt: int) -> str:
    reasons = sorted({r for p in children.pods_of(role, attempt) for r in p.waiting})
    return f" ({', '.join(reasons)})" if reasons else ""


def _seconds_since(now: datetime, then: str | None) -> float | None:
    start = parse_time(then)
    return None if start is None else (now - start).total_seconds()


# runPolicy fields that still act once a job finished (its cleanup, its deletion)
FINISHED_JOB_POLICY = ("ttlSecondsAfterFinished", "cleanPodPolicy")


class _Pass:
    """One derivation: the next status, built up step by step from the previous one."""

    def __init__(self, job: ObservedJob, children: Children, now: datetime, nats: NatsObservation | None = None):
        self.job = job
        self.nats = nats
        self.name = job.metadata.name
        self.children = children
        self.now = now
        self.ts = timestamp(now)
        self.st = job.status.model_copy(deep=True)
        self.st.observed_generation = job.metadata.generation

    def cond(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.st.conditions = set_condition(
            self.st.conditions, type_, status, reason, message, self.ts, self.job.metadata.generation
        )

    def finish(self) -> JobStatus:
        self.st.phase, self.st.reason, self.st.message = derive_phase(self.st)
        return self.st

    def close(self, terminal: str) -> None:
        """The job just finished: settle the other conditions and stamp the time."""
        final = self.st.condition(terminal)
        assert final is not None
        self.cond(C.COND_READY, False, final.reason, final.message)
        self.cond(C.COND_RESTARTING, False, final.reason, "")
        other = C.COND_SUCCEEDED if terminal == C.COND_FAILED else C.COND_FAILED
        self.cond(other, False, final.reason, "")
        self.st.completion_time = self.ts

    def new_attempt(self, reason: str, message: str) -> None:
        self.st.attempt += 1
        self.st.attempt_start_time = self.ts
        self.st.attempt_ready_time = None
        self.st.stateful_pods = {}
        self.cond(C.COND_RESTARTING, True, reason, message)

    def accept(self, acceptance: Acceptance) -> None:
        """Record which spec runs and whether the user's edits were applied."""
        assert acceptance.spec is not None
        self.st.accepted_spec = acceptance.spec.to_wire()
        self.st.nats_url = redact(acceptance.spec.nats_url(self.name, self.job.metadata.namespace)) or None
        if acceptance.error:
            self.cond(C.COND_SPEC_ACCEPTED, False, "InvalidSpec",
                      f"the edited spec is invalid and is not applied: {acceptance.error}")  # fmt: skip
        elif acceptance.rejected:
            self.cond(C.COND_SPEC_ACCEPTED, False, "ChangeNotAllowedWhileRunning",
                      f"changes to {', '.join(acceptance.rejected)} are not applied while the job runs "
                      "(only replica counts and runPolicy are); revert them, or suspend the job "
                      "(runPolicy.suspend: true), edit it and resume")  # fmt: skip
        else:
            self.cond(C.COND_SPEC_ACCEPTED, True, "Accepted", "")

    def suspend(self, spec: PersiaJobSpec) -> None:
        self.cond(C.COND_SUSPENDED, True, "Suspended", "runPolicy.suspend is true: workloads are removed")
        for type_ in (C.COND_CREATED, C.COND_READY, C.COND_RESTARTING, C.COND_NATS_READY):
            self.cond(type_, False, "Suspended", "")
        self.st.start_time = self.st.attempt_start_time = self.st.attempt_ready_time = None
        self.st.replica_statuses = count_replicas(spec, self.name, self.children, self.st.attempt)

    def start(self, resumed: bool) -> None:
        """Resuming starts a new attempt; both get fresh start times (and deadlines)."""
        if resumed:
            self.cond(C.COND_SUSPENDED, False, "Resumed", "runPolicy.suspend is false: workloads restored")
            self.st.attempt += 1
            self.st.stateful_pods = {}
        if self.st.start_time is None:
            self.st.start_time = self.st.attempt_start_time = self.ts
            self.st.attempt_ready_time = None

    def resize(self, spec: PersiaJobSpec, changes: dict[str, tuple[int, int]]) -> None:
        """Applied replica changes: a new attempt with the new sizes, except online NN
        workers and data loaders, whose Deployments are scaled in place."""
        restart_for = [
            f"{field} {old} -> {new}"
            for field, (old, new) in changes.items()
            if not (spec.training_mode == "online" and field in ("nnWorker", "dataloader"))
        ]
        if restart_for:
            self.new_attempt("ReplicasChanged", f"restarting with new replica counts: {', '.join(restart_for)}")

    def after_finish(self) -> None:
        """A finished job's cleanup and TTL follow the spec (runPolicy is read on every pass): set
        on a finished job, which is how one cleans it up, they were ignored, its acceptedSpec sticky
        with the rest of its status. An invalid spec changes nothing."""
        if self.st.accepted_spec is None:
            return
        try:
            wanted = parse_spec(self.job.spec).run_policy.model_dump(by_alias=True, mode="json", exclude_none=True)
        except SpecError:
            return
        policy = dict(self.st.accepted_spec.get("runPolicy") or {})
        for key in FINISHED_JOB_POLICY:
            if key in wanted:
                policy[key] = wanted[key]
            else:
                policy.pop(key, None)
        self.st.accepted_spec = {**self.st.accepted_spec, "runPolicy": policy}

    def credentials_lost(self) -> bool:
        """The job's Secret (`<job>-auth`: the managed NATS's credentials, the job secret) is gone
        while pods that read it run: it is created again with new random values, which the running
        NATS and pods do not have. Re-created silently, the next container restart read the new
        password (refused by the NATS) or job secret (its signed controls refused by its peers),
        and a whole-job restart did not help since the NATS stayed. So the job restarts (not
        counted: nothing failed), and plan_actions replaces the NATS with the Secret."""
        secret = naming.auth_secret_name(self.name)
        if ("Secret", secret) in self.children.objects or self.st.attempt != self.job.status.attempt:
            return False  # there, or this pass restarts the job already
        current = str(self.st.attempt)
        holders = [p.name for p in self.children.pods if p.started and not p.deleting and
                   (p.role == C.ROLE_NATS or (p.role in C.TRAINING_ROLES and p.attempt == current))]  # fmt: skip
        if not holders:
            return False  # nothing read it yet: it is just created
        self.st.uncounted_restarts += 1
        self.new_attempt("SecretReplaced",
                         f"restart not counted against backoffLimit: Secret {secret} was deleted; it is created "
                         f"with new credentials and the NATS and every role restart with them "
                         f"({', '.join(holders[:3])}{' ...' if len(holders) > 3 else ''} held the old ones)")  # fmt: skip
        return True

    def outcome(self, spec: PersiaJobSpec) -> None:
        """Success of the current attempt, else its failures: fail or restart."""
        nn_job = self.children.workload("Job", naming.workload_name(self.name, C.ROLE_NN_WORKER))
        current = nn_job is not None and nn_job.attempt == str(self.st.attempt)
        if spec.training_mode == "batch" and current and nn_job.complete:  # type: ignore[union-attr]
            done = f"all {spec.nn_worker.replicas} NN workers completed"
            self.cond(C.COND_SUCCEEDED, True, "NNWorkersCompleted", done)
            return
        found = failures.find_failures(spec, self.name, self.children, self.st.attempt, self.st.stateful_pods)
        decision = failures.decide(found, spec.failure_policy.rules, self.st.restart_count,
                                   spec.run_policy.backoff_limit)  # fmt: skip
        if decision is not None and decision.fail:
            self.cond(C.COND_FAILED, True, decision.reason, decision.message)
        elif decision is not None:
            if decision.counted:
                self.st.restart_count += 1
            else:
                self.st.uncounted_restarts += 1
            self.new_attempt(decision.reason, decision.message)
        else:
            self.track_stateful(spec)

    def track_stateful(self, spec: PersiaJobSpec) -> None:
        """Remember the uid of every started pod of a stateful role in this attempt: a
        different uid under the same name later means the pod was replaced."""
        for role in C.TRAINING_ROLES:
            if spec.role(role) is None or C.ROLE_FIELDS[role] not in spec.failure_policy.stateful_roles:
                continue
            for pod in self.children.pods_of(role, self.st.attempt):
                key = f"{role}:{pod.name}"
                if pod.uid and pod.started and not pod.deleting and key not in self.st.stateful_pods:
                    self.st.stateful_pods[key] = pod.uid

    def checkpoint(self) -> None:
        """The last checkpoint NN rank 0 reported, and what this attempt resumed from."""
        report = self.nats.checkpoint if self.nats is not None else None
        if report is None:
            return
        from .job import CheckpointStatus

        prev = self.st.checkpoint or CheckpointStatus()
        # A reply from before this attempt started tells the last checkpoint, not what
        # this attempt resumed from.
        started = parse_time(self.st.attempt_start_time)
        current = self.nats.at is not None and (started is None or self.nats.at >= started)  # type: ignore[union-attr]
        resumed_from, resumed_attempt = (
            (report.resumed_from, self.st.attempt) if current
            else (prev.resumed_from, prev.resumed_attempt) if prev.resumed_attempt == self.st.attempt
            else (None, None)
        )  # fmt: skip
        self.st.checkpoint = CheckpointStatus(
            step=report.step, time=report.time_rfc3339(), path=report.path,
            resumed_from=resumed_from, resumed_attempt=resumed_attempt,
            observed_time=self.ts if (prev.step, prev.path) != (report.step, report.path) else prev.observed_time,
        )  # fmt: skip

    def created(self, spec: PersiaJobSpec, errors: Sequence[ChildError]) -> list[str]:
        """Created (and ChildCreateFailed); returns the missing children."""
        missing = missing_children(PersiaJob(metadata=self.job.metadata, spec=spec, status=self.st), self.children)
        auxiliary = [e for e in errors if e.kind in AUXILIARY_KINDS and e.action == "create"]
        # a refused change to a running child (a resize) fails nothing: it runs as it was
        patches = [e for e in errors if e.action == "patch"]
        errors = [e for e in errors if e.kind not in AUXILIARY_KINDS and e.action == "create"]
        note = "; ".join([*(f"{e.kind}/{e.name} not created ({e.message}): the job runs without it" for e in auxiliary),
                          *(f"{e.kind}/{e.name} not changed ({e.message}): it runs as it was" for e in patches)])
        permanent = [e for e in errors if e.permanent]
        if permanent:
            self.cond(C.COND_FAILED, True, "ChildCreateFailed",
                      "; ".join(f"{e.kind}/{e.name}: {e.message}" for e in permanent))  # fmt: skip
        if errors:
            self.cond(C.COND_CREATED, False, "ChildCreateFailed",
                      "; ".join(f"{e.kind}/{e.name}: {e.message}" for e in errors))  # fmt: skip
        elif missing:
            self.cond(C.COND_CREATED, False, "Creating", f"waiting for {', '.join(missing)}")
        else:
            self.cond(C.COND_CREATED, True, "ChildrenCreated", note)
        return missing

    def readiness(self, spec: PersiaJobSpec, missing: list[str]) -> None:
        """Counts, NatsReady and Ready of the current attempt."""
        st = self.st
        st.replica_statuses = count_replicas(spec, self.name, self.children, st.attempt)
        nats = st.replica_statuses.get("nats")
        if nats is None:
            nats_ready = self.external_nats(spec)
            not_ready = [] if nats_ready else ["external NATS not reachable"]
        else:
            nats_ready = nats.ready >= nats.desired
            self.cond(C.COND_NATS_READY, nats_ready, "NatsAvailable" if nats_ready else "NatsNotReady",
                      f"{nats.ready_ratio} NATS servers ready")  # fmt: skip
            not_ready = [] if nats_ready else [f"nats {nats.ready_ratio}"]
        for role in C.TRAINING_ROLES:
            counts = st.replica_statuses.get(C.ROLE_FIELDS[role])
            if counts is None:
                continue
            # A batch data loader (or NN worker) that finished its work is not "unready".
            done = counts.succeeded if workload_kind(spec, role) == "Job" else 0
            if counts.ready + done < counts.desired:
                not_ready.append(f"{C.ROLE_FIELDS[role]} {counts.ready_ratio}"
                                 f"{_waiting_note(self.children, role, st.attempt)}")  # fmt: skip
        if missing:
            self.cond(C.COND_READY, False, "ChildrenMissing", f"waiting for {', '.join(missing)}")
        elif not_ready:
            self.cond(C.COND_READY, False, "ReplicasNotReady", f"not ready: {', '.join(not_ready)}")
        else:
            summary = ", ".join(f"{f} {c.ready_ratio}" for f, c in st.replica_statuses.items() if f != "nats")
            self.cond(C.COND_READY, True, "AllReplicasReady", summary)
            if st.attempt_ready_time is None:
                st.attempt_ready_time = self.ts
        restarting = st.condition(C.COND_RESTARTING)
        if restarting is not None and restarting.status == "True" and st.attempt_ready_time is not None:
            self.cond(C.COND_RESTARTING, False, "Recovered", f"attempt {st.attempt} is ready")

    def external_nats(self, spec: PersiaJobSpec) -> bool:
        """An external NATS is ready only once the operator connected to it."""
        url = self.st.nats_url
        url_secret = spec.nats_url_secret()
        if url is None and url_secret is not None:  # the URL itself is not shown: it may hold credentials
            url = f"the PERSIA_NATS_URL in Secret {url_secret[0]}"
        if self.nats is None:
            last = self.st.condition(C.COND_NATS_READY)
            if last is not None and last.reason in ("ExternalNats", "NatsUnreachable"):
                # Not probed by this operator process yet (it restarted, or a new leader took
                # over): the last verdict stands until its first probe, a few seconds later.
                # Reported as not checked, a healthy job went not Ready at every operator restart.
                return last.status == "True"
            self.cond(C.COND_NATS_READY, False, "NatsNotChecked", f"no connection to {url} tried yet")
            return False
        if not self.nats.connected:
            self.cond(C.COND_NATS_READY, False, "NatsUnreachable",
                      f"cannot connect to {url}: {self.nats.error or 'unknown error'}")  # fmt: skip
            return False
        self.cond(C.COND_NATS_READY, True, "ExternalNats", f"connected to {url}")
        return True

    def deadlines(self, spec: PersiaJobSpec) -> None:
        ads = spec.run_policy.active_deadline_seconds
        running_for = _seconds_since(self.now, self.st.start_time)
        if ads is not None and running_for is not None and running_for > ads:
            self.cond(C.COND_FAILED, True, "DeadlineExceeded",
                      f"running for {int(running_for)}s; runPolicy.activeDeadlineSeconds is {ads}")  # fmt: skip
            return
        sds = spec.run_policy.startup_deadline_seconds
        starting_for = _seconds_since(self.now, self.st.attempt_start_time)
        if sds is not None and self.st.attempt_ready_time is None and starting_for is not None and starting_for > sds:
            ready = self.st.condition(C.COND_READY)
            self.cond(C.COND_FAILED, True, "StartupDeadlineExceeded",
                      f"attempt {self.st.attempt} not Ready {int(starting_for)}s after its start "
                      f"(runPolicy.startupDeadlineSeconds is {sds}): {ready.message if ready else ''}")  # fmt: skip


def derive_status(
    job: ObservedJob,
    children: Children,
    now: datetime,
    errors: Sequence[ChildError] = (),
    nats: NatsObservation | None = None,
) -> JobStatus:
    """The next status of `job`; `errors` are API errors of this pass's child writes,
    `nats` the latest probe of the job's NATS (None: none yet)."""
    p = _Pass(job, children, now, nats)
    prev = job.status
    if prev.terminal():  # sticky: only the counts move, and what applies to a finished job
        p.after_finish()
        running = effective_job(job.metadata, p.st)
        if running is not None:
            p.st.replica_statuses = count_replicas(running.spec, p.name, children, p.st.attempt)
        return p.finish()

    for type_ in C.CONDITION_TYPES:  # always present, so `kubectl wait` and columns work
        if p.st.condition(type_) is None:
            p.cond(type_, False, "Pending", "")

    locked = prev.start_time is not None and not prev.is_true(C.COND_SUSPENDED)
    acceptance = accept_spec(job.spec, prev.accepted_spec, locked=locked)
    name_problems = check_job_name(p.name)
    if prev.accepted_spec is None:  # before it starts: a label added to a running job changes nothing
        name_problems += check_queue_label(job.metadata.labels)
    if acceptance.spec is None or name_problems:
        message = f"invalid spec: {'; '.join([*name_problems, *([acceptance.error] if acceptance.error else [])])}"
        p.cond(C.COND_CREATED, False, "InvalidSpec", message)
        p.cond(C.COND_SPEC_ACCEPTED, False, "InvalidSpec", message)
        p.cond(C.COND_FAILED, True, "InvalidSpec", message)
        p.close(C.COND_FAILED)
        return p.finish()
    spec = acceptance.spec
    p.accept(acceptance)
    if spec.run_policy.suspend:
        p.suspend(spec)
        return p.finish()
    p.start(resumed=prev.is_true(C.COND_SUSPENDED))
    if locked:
        p.resize(spec, acceptance.replica_changes)
    if not p.credentials_lost():
        p.outcome(spec)
    p.checkpoint()
    missing = p.created(spec, errors)
    p.readiness(spec, missing)
    if p.st.terminal() is None:
        p.deadlines(spec)
    terminal = p.st.terminal()
    if terminal is not None:
        p.close(terminal)
    return p.finish()


__all__ = ["ChildError", "ObservedJob", "derive_status", "effective_job", "count_replicas",
           "missing_children", "RUN_TO_COMPLETION_ROLES"]  # fmt: skip
