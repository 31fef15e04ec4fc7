"""The NN worker's own embedding updates, numbered, so that hybrid training reads its own writes.

With embedding staleness k > 1 a batch is looked up while up to k - 1 earlier batches' gradients
are not yet applied on the PS, so its rows miss those updates: that is where hybrid training's AUC
cost comes from (Adagrad's first updates of a row are its largest, docs/benchmarks.md). This NN
worker made those updates itself, so it can apply them to the rows it got: each update gets a
*seq*; a lookup says below which seq every update is known applied (``since``), and the PS answers
with the rows' optimizer state and which of the seqs at or above ``since`` it had applied when it
read them (per replica). Just before the batch is trained, :meth:`OwnUpdates.correct` replays the
rest with the PS's own formula (:mod:`persia.nn_worker.replay`). With one NN rank hybrid training
then reads what synchronous training reads; other ranks' updates stay as stale as in PERSIA.
"""

from __future__ import annotations

import os
import secrets
import threading

from persia.embedding_ps.optimizers import OptimizerConfig
from persia.nn_worker.replay import SentUpdate, UpdateHistory, applied_tables, correct_table

ENV_REPLAY = "PERSIA_REPLAY_OWN_UPDATES"


def replay_setting(value: bool | None, environ: dict[str, str] | None = None) -> bool:
    """The TrainCtx argument if given, else ``PERSIA_REPLAY_OWN_UPDATES`` (1/0, true/false), else on."""
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"replay_own_updates must be True or False, got {value!r}")
        return value
    raw = (os.environ if environ is None else environ).get(ENV_REPLAY, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {ENV_REPLAY} must be 1 or 0, got {raw!r}")


class OwnUpdates:
    """Seqs, acknowledgements and the history of one NN worker's updates (thread-safe: the
    training thread numbers and corrects, lookup and update threads read ``since`` and ack)."""

    def __init__(self, cfg: OptimizerConfig, weight_bound: float, source: int | None = None):
        self.source = source if source is not None else secrets.randbelow(1 << 62) + 1
        self.cfg = cfg
        self.weight_bound = float(weight_bound)
        self.history = UpdateHistory()
        self.replayed_row_steps = 0  # rows re-applied, summed over updates (metrics, tests)
        self.corrected_batches = 0
        self._lock = threading.Lock()
        self._next = 1
        self._unacked: set[int] = set()

    def renewed(self) -> "OwnUpdates":
        """The same optimizer, a new source, nothing sent yet."""
        return OwnUpdates(self.cfg, self.weight_bound)

    def since(self) -> int:
        """Every update below this seq is applied on every PS replica: a lookup dispatched now
        reflects them all. Non-decreasing, so the batches (trained in dispatch order) see
        non-decreasing values, and the history below a trained batch's value can go."""
        with self._lock:
            return min(self._unacked, default=self._next)

    def query(self, since: int) -> dict:
        """The ``replay`` field of a lookup request."""
        return {"source": self.source, "since": since}

    def sent(self, tables: list[dict], slots: list[dict], grads: list, scale: float,
             unused_slots: list[int]) -> int:
        """Number one update (its batch's reply ``tables`` carry the rows' ``signs``) and keep
        what the PS will apply of it; the seq goes in the update's message."""
        applied = applied_tables(tables, slots, grads, scale, unused_slots) if tables and "signs" in tables[0] else {}
        with self._lock:
            seq = self._next
            self._next += 1
            self._unacked.add(seq)
        self.history.add(SentUpdate(seq, applied))
        return seq

    def acked(self, seq: int | None) -> None:
        """The call that carried update ``seq`` returned: the PS applied it (or training fails)."""
        if seq is None:
            return
        with self._lock:
            self._unacked.discard(seq)

    def correct(self, tables: list[dict], replay: dict) -> int:
        """Re-apply to a looked-up batch's rows (``tables[i]["rows"]``, replaced) the updates its
        lookup missed; returns the row-steps replayed (0: the rows are as they came, also for a
        lookup made under an earlier source: before the PS's rows were cleared or loaded)."""
        if int(replay["source"]) != self.source:
            return 0
        since = int(replay["since"])
        missed = self.history.since(since)
        self.history.forget_below(since)  # later batches were dispatched later: their since is >=
        if not missed:
            return 0
        done = 0
        for table, extra in zip(tables, replay["tables"]):
            rows, _state, n = correct_table(int(table["dim"]), table["rows"], extra["state"], extra["signs"],
                                            extra["replica"], extra["absent"], extra["applied"], missed,
                                            self.cfg, self.weight_bound)
            if n:
                table["rows"] = rows
                done += n
        if done:
            self.replayed_row_steps += done
            self.corrected_batches += 1
        return done
