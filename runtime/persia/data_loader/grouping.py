"""How many batches a data loader sends in one message per leg (``PERSIA_DATA_GROUP``).

Each NATS message costs its sender, nats-server and its receiver a few thread wake-ups, and on a
VM those, not the bytes, are most of what the embedding path spends per batch at batch 256
(docs/benchmarks.md, issue 15). So a data loader holds a batch until the next one for the same
embedding worker and NN rank, and sends both in one message on each leg (``ew.forward_group``,
``nn.batch_group``): half the messages. The receivers take each batch of a group as they would a
lone one, so retries, acknowledgements and accounting stay per batch.

The price, with a group of 2: ``send_data`` returns before its batch is acknowledged when it holds
it for the next one. A held batch goes with that one; alone once it has waited about
``PERSIA_DATA_GROUP_HOLD_MS`` (default 50, at most 1.5 times that), so a loader that produces
slowly, an online one, is not held back; or when the ``DataCtx`` closes. A failed group raises
from the ``send_data`` (or the close) that sent it, naming its batches, and each is counted as
failed; one sent after its hold ran out raises from the next ``send_data`` or the close.
``PERSIA_DATA_GROUP=1`` sends each batch alone and acknowledged before ``send_data`` returns. Pure
parts here; ``persia.data_loader.ctx`` does the sending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from persia.env import float_in_range, int_in_range
from persia.messages import MAX_SEND_GROUP

ENV_DATA_GROUP = "PERSIA_DATA_GROUP"
ENV_HOLD_MS = "PERSIA_DATA_GROUP_HOLD_MS"
DEFAULT_GROUP = 2
DEFAULT_HOLD_MS = 50.0
MAX_GROUP = MAX_SEND_GROUP  # the receivers' schemas refuse larger groups


def data_group_setting(environ: Mapping[str, str]) -> int:
    """``PERSIA_DATA_GROUP``: batches per message, 1 to ``MAX_GROUP`` (default 2); an error names a
    bad value."""
    raw = environ.get(ENV_DATA_GROUP, "").strip()
    return DEFAULT_GROUP if raw == "" else int_in_range(ENV_DATA_GROUP, raw, 1, MAX_GROUP)


def hold_setting(environ: Mapping[str, str]) -> float:
    """``PERSIA_DATA_GROUP_HOLD_MS``: how long a batch may wait for its group, in seconds (default
    0.05); an error names a bad value."""
    raw = environ.get(ENV_HOLD_MS, "").strip()
    if raw == "":
        return DEFAULT_HOLD_MS / 1e3
    return float_in_range(ENV_HOLD_MS, raw, 1, 60_000, "milliseconds") / 1e3


@dataclass
class HeldBatch:
    """One batch's two legs, ready to send."""

    worker: int
    rank: int
    batch_id: int
    ref: int
    ids: dict  # ew.forward's message
    dense: dict  # nn.batch's message
    batch: Any  # the user's PersiaBatch (its batch_id is reset if the send fails)
    held_at: float = 0.0  # time.monotonic() when send_data got it


class SendGroups:
    """Batches held per destination (embedding worker, NN rank) until ``size`` of them can go in
    one message each way."""

    def __init__(self, size: int):
        if not 1 <= size <= MAX_GROUP:
            raise ValueError(f"a send group holds 1 to {MAX_GROUP} batches, got {size}")
        self.size = size
        self._held: dict[tuple[int, int], list[HeldBatch]] = {}
        # when the longest-held batch was held (None: none is); kept as one attribute so that
        # another thread may read it without the sender's lock
        self.oldest: float | None = None

    def add(self, batch: HeldBatch) -> list[HeldBatch] | None:
        """Hold ``batch``; the group to send now when it completes one, else None."""
        key = (batch.worker, batch.rank)
        group = self._held.setdefault(key, [])
        group.append(batch)
        if len(group) < self.size:
            if self.oldest is None or batch.held_at < self.oldest:
                self.oldest = batch.held_at
            return None
        del self._held[key]
        self._update_oldest()
        return group

    def _update_oldest(self) -> None:
        self.oldest = min((g[0].held_at for g in self._held.values()), default=None)

    def take(self, worker: int, rank: int) -> list[list[HeldBatch]]:
        """The batches held for ``(worker, rank)`` (as one group, or none), no longer held."""
        group = self._held.pop((worker, rank), None)
        self._update_oldest()
        return [group] if group else []

    def take_held_since(self, before: float) -> list[list[HeldBatch]]:
        """The groups whose first batch was held at or before ``before``, oldest first; no longer held."""
        due = sorted((k for k, g in self._held.items() if g[0].held_at <= before),
                     key=lambda k: self._held[k][0].held_at)
        taken = [self._held.pop(k) for k in due]
        self._update_oldest()
        return taken

    def drain(self) -> list[list[HeldBatch]]:
        """Every group still held (incomplete), oldest first; none is held after."""
        groups = list(self._held.values())
        self._held.clear()
        self.oldest = None
        return groups

    def __len__(self) -> int:
        return sum(len(g) for g in self._held.values())


def message_bytes(obj: Any) -> int:
    """About how many bytes ``obj`` encodes to: its arrays' and byte strings' sizes, plus a little
    per item (the codec's framing is a few bytes an entry)."""
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes) + 64
    if isinstance(obj, (bytes, bytearray, memoryview, str)):
        return len(obj) + 8
    if isinstance(obj, dict):
        return 8 + sum(message_bytes(k) + message_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return 8 + sum(message_bytes(v) for v in obj)
    return 16


def fits_group(batch: HeldBatch, size: int, max_payload: int) -> bool:
    """Whether ``size`` batches like ``batch`` fit one NATS message on each leg, with room to
    spare (half of ``max_payload``): a batch too large to share one is sent alone, as it would be
    without groups, instead of making a group that NATS refuses."""
    return size * max(message_bytes(batch.ids), message_bytes(batch.dense)) <= max_payload // 2


def id_leg_failures(group: list[HeldBatch], reply: Any) -> list[tuple[HeldBatch, str]]:
    """The batches of a sent group whose ID features did not reach the embedding worker, each with
    why: all of them when the leg failed (``reply`` an exception), else those the worker refused
    (``ew.forward_group`` answers ``errors[i]`` per batch; a lone ``ew.forward`` refuses with an
    error reply, so its ``reply`` is the exception)."""
    if isinstance(reply, BaseException):
        return [(b, f"{type(reply).__name__}: {reply}") for b in group]
    if len(group) == 1:
        return []
    errors = reply.get("errors") if isinstance(reply, dict) else None
    if not isinstance(errors, list) or len(errors) != len(group):
        return [(b, f"malformed reply to a group of {len(group)}: {reply!r:.200}") for b in group]
    return [(b, str(why)) for b, why in zip(group, errors) if why is not None]
