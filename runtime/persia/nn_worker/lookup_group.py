"""How many batches one embedding lookup asks for (``Step`` with ``lookups``).

At batch 256 most of what a batch costs the embedding worker and the PS is per call, not per ID:
gRPC on both ends, decoding, thread hand-offs (docs/benchmarks.md, issue 15, session 7). Two
batches looked up in one call per hop pay that once. The price is one batch more looked up ahead
of training: the dispatcher sends a group when it would have sent one lookup, so the pipeline
holds one batch more. Reading one step earlier costs nothing when the NN worker re-applies every
update its reads miss, which it does when it replays its own updates and is the only NN rank
(``persia.nn_worker.own_updates``); with more ranks the other ranks' updates would be read one
step later, so the default there stays one batch per lookup. ``PERSIA_LOOKUP_GROUP`` sets it.
"""

from __future__ import annotations

import os

from persia.env import int_in_range
from persia.messages import MAX_GROUPED_LOOKUPS

ENV_LOOKUP_GROUP = "PERSIA_LOOKUP_GROUP"
DEFAULT_GROUP = 2


def lookup_group_setting(environ: dict[str, str] | None = None) -> int | None:
    """``PERSIA_LOOKUP_GROUP`` (1 to ``MAX_GROUPED_LOOKUPS``), None when unset or ``auto``; an
    error names the bad value."""
    raw = (os.environ if environ is None else environ).get(ENV_LOOKUP_GROUP, "").strip()
    if raw in ("", "auto"):
        return None
    return int_in_range(ENV_LOOKUP_GROUP, raw, 1, MAX_GROUPED_LOOKUPS, also=" or 'auto'")


def lookup_group_size(setting: int | None, replays_own_updates: bool, world_size: int) -> int:
    """Batches per lookup call: the setting if given, else ``DEFAULT_GROUP`` where reading one
    step earlier misses nothing uncorrected (own-update replay and a single NN rank), else 1."""
    if setting is not None:
        return setting
    return DEFAULT_GROUP if replays_own_updates and world_size == 1 else 1


def group_under_bound(group: int, staleness_limit: int | None) -> int:
    """How many batches may go in one call under the current staleness bound: a group holds one
    permit per batch, and a group larger than half the bound would leave training waiting for
    permits on every other step (1 for bounds below 4, synchronous training included)."""
    return group if staleness_limit is None else max(1, min(group, staleness_limit // 2))
