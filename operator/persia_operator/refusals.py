"""Auxiliary children the API server refuses for good: tried again with backoff, not every pass.

A job runs without its PodDisruptionBudgets (status.AUXILIARY_KINDS), so a create refused with
403 (RBAC), 404 (policy/v1 not served), 400/422 (rejected) or 405 does not fail it; but it was
tried, logged and reported again every pass, for ever. Pure: the reconciler keeps the refusals
per job in memory (an operator restart tries each once more) and asks these functions what to do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from .children import data_hash
from .events import JobEvent
from .plan import Action, Create
from .status import AUXILIARY_KINDS, ChildError

PERMANENT_CODES = (400, 403, 404, 405, 422)  # a retry gets the same answer until someone acts
FIRST_RETRY = timedelta(minutes=1)
MAX_RETRY = timedelta(hours=1)

Key = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Refusal:
    """A create refused for good, and when it is tried again."""

    error: ChildError
    manifest: str  # data_hash of what was refused: a changed manifest is tried at once
    tries: int
    retry_at: datetime


def refused_for_good(error: ChildError) -> bool:
    """A create of an auxiliary child the API server will refuse again; anything else (network,
    429, 5xx, 409) is transient and tried again next pass, as before."""
    return error.action == "create" and error.kind in AUXILIARY_KINDS and error.code in PERMANENT_CODES


def backoff(tries: int) -> timedelta:
    """1 min after the first refusal, doubling, at most 1 h."""
    return min(FIRST_RETRY * 2 ** max(tries - 1, 0), MAX_RETRY)


def _held(action: Action, refusals: Mapping[Key, Refusal], now: datetime) -> Refusal | None:
    if not isinstance(action, Create):
        return None
    refusal = refusals.get(action.key)
    if refusal is None or now >= refusal.retry_at or refusal.manifest != data_hash(action.manifest):
        return None
    return refusal


def held_errors(refusals: Mapping[Key, Refusal], now: datetime) -> list[ChildError]:
    """The refusals not due yet: what the job's Created condition goes on naming (a pass that
    left them out would rewrite the condition without them, and back, every pass)."""
    return [r.error for r in refusals.values() if now < r.retry_at]


def hold(actions: Sequence[Action], refusals: Mapping[Key, Refusal], now: datetime
         ) -> tuple[list[Action], list[ChildError]]:  # fmt: skip
    """The actions less the creates refused for good that are not due again (same manifest,
    before retry_at), and the errors of those held back."""
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
    of the creates it made. A held create keeps its refusal; one refused for good again backs
    off further (from the start when its manifest changed); one created, refused transiently or
    no longer planned (created by someone, the job finished or suspended) is forgotten."""
    by_key = {(e.kind, e.name): e for e in errors if e.action == "create"}
    out: dict[Key, Refusal] = {}
    for action in planned:
        if not isinstance(action, Create):
            continue
        held = _held(action, refusals, now)
        if held is not None:
            out[action.key] = held
            continue
        error = by_key.get(action.key)
        if error is None or not refused_for_good(error):
            continue
        manifest = data_hash(action.manifest)
        prev = refusals.get(action.key)
        tries = (prev.tries if prev is not None and prev.manifest == manifest else 0) + 1
        out[action.key] = Refusal(error, manifest, tries, now + backoff(tries))
    return out


def refusal_events(before: Mapping[Key, Refusal], after: Mapping[Key, Refusal]) -> list[JobEvent]:
    """One Warning per refusal that is news (a first one, or another error): not one per retry."""
    events = []
    for key, refusal in sorted(after.items()):
        prev = before.get(key)
        if prev is not None and prev.error.message == refusal.error.message:
            continue
        kind, name = key
        message = (f"{kind}/{name} not created ({refusal.error.message}): the job runs without it; tried again "
                   f"in {int(backoff(refusal.tries).total_seconds())}s, backing off to "
                   f"{int(MAX_RETRY.total_seconds())}s, or at once when it changes")  # fmt: skip
        events.append(JobEvent("Warning", "ChildRefused", message[:1024]))
    return events
