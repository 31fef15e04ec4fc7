"""Writes the API server refuses for good: tried again with backoff, not every pass.

Two kinds of write were tried, logged and reported again every pass, for ever, when the API
server refused them for good:

* creates of the auxiliary children (status.AUXILIARY_KINDS: the PodDisruptionBudgets), which a
  job runs without: 403 (RBAC), 404 (policy/v1 not served), 400/422 (rejected) or 405;
* resizes of running children (RESIZED_KINDS): the PodGroup's minMember patch and the
  Deployments' replicas patch (serving, online training), which leave the child running as it
  was: 403, 400/422 (admission, a quota) or 405. A 404 is not for good there: the child is gone,
  and the next pass sees it missing.

Pure: the reconciler keeps the refusals per job in memory and on the job
(``status.refusedWrites``, :func:`to_status` / :func:`from_status`, so that a restarted operator
honours them too) and asks these functions what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from .children import data_hash
from .conditions import parse_time, timestamp
from .events import JobEvent
from .job import RefusedWrite
from .plan import Action, Create, Patch
from .status import AUXILIARY_KINDS, ChildError

PERMANENT_CODES = (400, 403, 404, 405, 422)  # a retry gets the same answer until someone acts
PATCH_PERMANENT_CODES = (400, 403, 405, 422)  # 404: the child is gone (recreated, not patched)
RESIZED_KINDS = ("PodGroup", "Deployment")  # the patches of a resize (plan.py)
FIRST_RETRY = timedelta(minutes=1)
MAX_RETRY = timedelta(hours=1)

Key = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Refusal:
    """A write refused for good, and when it is tried again."""

    error: ChildError  # its action ("create" or "patch") is the write's
    manifest: str  # fingerprint of what was refused (:func:`fingerprint`): a changed write is tried at once
    tries: int
    retry_at: datetime


def refused_for_good(error: ChildError) -> bool:
    """A create of an auxiliary child, or a resize patch, the API server will refuse again;
    anything else (network, 429, 5xx, 409) is transient and tried again next pass, as before."""
    if error.action == "create":
        return error.kind in AUXILIARY_KINDS and error.code in PERMANENT_CODES
    return error.action == "patch" and error.kind in RESIZED_KINDS and error.code in PATCH_PERMANENT_CODES


def backoff(tries: int) -> timedelta:
    """1 min after the first refusal, doubling, at most 1 h."""
    return min(FIRST_RETRY * 2 ** max(tries - 1, 0), MAX_RETRY)


def fingerprint(action: Create | Patch) -> str:
    """What a write sends: the manifest of a create, the patch (and the apiVersion it goes to)
    of a patch. A resize to another size is another patch, tried at once."""
    if isinstance(action, Create):
        return data_hash(action.manifest)
    return data_hash({"apiVersion": action.api_version, "patch": action.patch})


def _write(action: Action) -> tuple[Key, str, str] | None:
    """The key, the kind of write ("create"/"patch") and the fingerprint of a write that can be
    held back; None for the others (deletes)."""
    if isinstance(action, Create):
        return action.key, "create", fingerprint(action)
    if isinstance(action, Patch):
        return (action.kind, action.name), "patch", fingerprint(action)
    return None


def _held(action: Action, refusals: Mapping[Key, Refusal], now: datetime) -> Refusal | None:
    write = _write(action)
    if write is None:
        return None
    key, kind, manifest = write
    refusal = refusals.get(key)
    if refusal is None or refusal.error.action != kind or now >= refusal.retry_at or refusal.manifest != manifest:
        return None
    return refusal


def held_errors(refusals: Mapping[Key, Refusal], now: datetime) -> list[ChildError]:
    """The refusals not due yet: what the job's Created condition goes on naming (a pass that
    left them out would rewrite the condition without them, and back, every pass)."""
    return [r.error for r in refusals.values() if now < r.retry_at]


def hold(actions: Sequence[Action], refusals: Mapping[Key, Refusal], now: datetime
         ) -> tuple[list[Action], list[ChildError]]:  # fmt: skip
    """The actions less the writes refused for good that are not due again (same manifest or
    patch, before retry_at), and the errors of those held back."""
    kept: list[Action] = []
    held: list[ChildError] = []
    for action in actions:
        refusal = _held(action, refusals, now)
        if refusal is None:
            kept.append(action)
        else:
            held.append(refusal.error)
    return kept, held


def next_refusals(refusals: Mapping[Key, Refusal], planned: Sequence[Action], errors: Sequence[ChildError],
                  now: datetime) -> dict[Key, Refusal]:  # fmt: skip
    """The refusals after a pass. ``planned``: its actions before :func:`hold`; ``errors``: those
    of the writes it made. A held write keeps its refusal; one refused for good again backs off
    further (from the start when what it sends changed); one done, refused transiently or no
    longer planned (created by someone, resized back, the job finished or suspended) is
    forgotten."""
    by_key = {(e.action, e.kind, e.name): e for e in errors}
    out: dict[Key, Refusal] = {}
    for action in planned:
        write = _write(action)
        if write is None:
            continue
        key, kind, manifest = write
        held = _held(action, refusals, now)
        if held is not None:
            out[key] = held
            continue
        error = by_key.get((kind, *key))
        if error is None or not refused_for_good(error):
            continue
        prev = refusals.get(key)
        same = prev is not None and prev.error.action == kind and prev.manifest == manifest
        tries = (prev.tries if prev is not None and same else 0) + 1
        out[key] = Refusal(error, manifest, tries, now + backoff(tries))
    return out


def refusal_events(before: Mapping[Key, Refusal], after: Mapping[Key, Refusal]) -> list[JobEvent]:
    """One Warning per refusal that is news (a first one, or another error): not one per retry."""
    events = []
    for key, refusal in sorted(after.items()):
        prev = before.get(key)
        if prev is not None and prev.error.message == refusal.error.message:
            continue
        kind, name = key
        retry = (f"tried again in {int(backoff(refusal.tries).total_seconds())}s, backing off to "
                 f"{int(MAX_RETRY.total_seconds())}s, or at once when it changes")  # fmt: skip
        if refusal.error.action == "patch":
            message = f"{kind}/{name} not changed ({refusal.error.message}): it runs as it was; {retry}"
        else:
            message = f"{kind}/{name} not created ({refusal.error.message}): the job runs without it; {retry}"
        events.append(JobEvent("Warning", "ChildRefused", message[:1024]))
    return events


def to_status(refusals: Mapping[Key, Refusal]) -> list[RefusedWrite] | None:
    """The refusals as the job's ``status.refusedWrites`` (None: none, the field is removed)."""
    if not refusals:
        return None
    return [RefusedWrite(kind=kind, name=name, action=r.error.action, code=r.error.code, message=r.error.message,
                         fingerprint=r.manifest, tries=r.tries, retry_at=timestamp(r.retry_at))
            for (kind, name), r in sorted(refusals.items())]  # fmt: skip


def from_status(written: Iterable[RefusedWrite] | None) -> dict[Key, Refusal]:
    """The refusals an operator wrote on the job (:func:`to_status`), for one that has none in
    memory (restarted, or the new leader): it honours them rather than trying each write once
    more. An entry it cannot read (a hand edit) is dropped: that write is tried again."""
    out: dict[Key, Refusal] = {}
    for w in written or ():
        try:
            retry_at = parse_time(w.retry_at)
        except ValueError:
            continue
        if retry_at is None or w.tries < 1:
            continue
        error = ChildError(w.kind, w.name, w.code, w.message, action=w.action)
        out[(w.kind, w.name)] = Refusal(error, w.fingerprint, w.tries, retry_at)
    return out
