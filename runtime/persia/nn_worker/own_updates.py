"""The NN worker's own embedding updates, numbered, so that hybrid training reads its own writes.

With embedding staleness k > 1 a batch is looked up while up to k - 1 earlier batches' gradients
are not yet applied on the PS, so its rows miss those updates: that is where hybrid training's AUC
cost comes from (Adagrad's first updates of a row are its largest, docs/benchmarks.md). This NN
worker made those updates itself, so it can apply them to the rows it got: each update gets a
*seq*; a lookup says below which seq every update is known applied (``since``), and the PS answers
with the rows' optimizer state and which of the seqs at or above ``since`` it had applied when it
read them (per replica). The rest is replayed with the PS's own formula
(:mod:`persia.nn_worker.replay`) in up to three parts, each picking up where the last stopped
(``replay["through"]``): the updates already sent when the reply comes in, by the lookup thread
(:meth:`OwnUpdates.correct_ahead`); those sent since, by the next batch's corrector while the
training thread steps (:meth:`OwnUpdates.correct_next`,
:mod:`persia.nn_worker.next_batch_correction`); and what is left just before the batch is
trained, on the training thread (:meth:`OwnUpdates.correct`). With one NN rank hybrid training then reads what synchronous training reads; other ranks' updates
stay as stale as in PERSIA.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import NamedTuple

import numpy as np

from persia.embedding_ps.optimizers import OptimizerConfig
from persia.env import switch_on
from persia.nn_worker.replay import SentUpdate, UpdateHistory, applied_tables, correct_table

ENV_REPLAY = "PERSIA_REPLAY_OWN_UPDATES"


def replay_setting(value: bool | None, environ: dict[str, str] | None = None) -> bool:
    """The TrainCtx argument if given, else ``PERSIA_REPLAY_OWN_UPDATES`` (1/0, true/false), else on."""
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"replay_own_updates must be True or False, got {value!r}")
        return value
    return switch_on(ENV_REPLAY, os.environ if environ is None else environ)


class OwnUpdates:
    """Seqs, acknowledgements and the history of one NN worker's updates (thread-safe: the
    training thread numbers and corrects, lookup and update threads read ``since`` and ack)."""

    def __init__(self, cfg: OptimizerConfig, weight_bound: float, source: int | None = None):
        self.source = source if source is not None else secrets.randbelow(1 << 62) + 1
        self.cfg = cfg
        self.weight_bound = float(weight_bound)
        self.history = UpdateHistory()
        self.replayed_row_steps = 0  # rows re-applied, summed over updates (metrics, tests)
        self.replayed_ahead_row_steps = 0  # of which by the lookup thread
        self.replayed_next_row_steps = 0  # of which by the next batch's corrector (correct_next)
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
        if applied:  # an update of a lookup without replay (synchronous training) replays nothing,
            # and no batch's correction would ever forget it: kept, it grew by a record a step
            self.history.add(SentUpdate(seq, applied))
        return seq

    def acked(self, seq: int | None) -> None:
        """The call that carried update ``seq`` returned: the PS applied it (or training fails)."""
        if seq is None:
            return
        with self._lock:
            self._unacked.discard(seq)

    def correct_ahead(self, tables: list[dict], replay: dict) -> int:
        """The lookup thread's part of the correction, as soon as the reply is in: replay the
        updates already sent that the read missed, so the training thread replays only the
        updates sent after that (see :meth:`_replay`), in place on arrays this thread copies from
        the reply (so the training thread's part copies nothing). Returns the row-steps replayed."""
        if int(replay["source"]) != self.source:
            return 0
        for table, extra in zip(tables, replay["tables"]):  # the reply's read-only views, copied once
            table["rows"] = np.array(table["rows"], dtype=np.float32, order="C")
            extra["state"] = np.array(extra["state"], dtype=np.float32, order="C")
            extra["owned"] = True
        # without the GIL: the training thread goes on meanwhile (the rows are this thread's copies)
        done = self._replay(tables, replay, self.history.since(int(replay["since"])), release_gil=True).replayed
        replay["ahead"] = done
        self._count(done, batch=False, part="ahead")
        return done

    def correct_next(self, tables: list[dict], replay: dict) -> "Correction":
        """The next batch's correction, off the training thread (``NextBatchCorrector``): replay
        every update sent so far that the read missed and no earlier part replayed. Forgets
        nothing (another batch may still need older updates); without the GIL."""
        if int(replay["source"]) != self.source:
            return Correction(0, [None] * len(tables))
        fixed = self._replay(tables, replay, self._missed(replay), release_gil=True)
        replay["ahead"] = int(replay.get("ahead") or 0) + fixed.replayed
        self._count(fixed.replayed, batch=False, part="next")
        return fixed

    def _missed(self, replay: dict) -> list[SentUpdate]:
        """The updates sent that a batch's read missed and that no part of its correction replayed."""
        missed = self.history.since(int(replay["since"]))
        through = replay.get("through")
        return missed if through is None else [u for u in missed if u.seq > through]

    def correct(self, tables: list[dict], replay: dict) -> "Correction":
        """Re-apply to a looked-up batch's rows the updates its lookup missed and
        :meth:`correct_ahead` did not; just before the batch is trained. Rows as they came
        (nothing replayed) for a lookup made under an earlier source: before the PS's rows were
        cleared or loaded."""
        if int(replay["source"]) != self.source:
            return Correction(0, [None] * len(tables))
        missed = self._missed(replay)
        self.history.forget_below(int(replay["since"]))  # later batches were dispatched later: their since is >=
        fixed = self._replay(tables, replay, missed)
        self._count(fixed.replayed, batch=bool(fixed.replayed or replay.get("ahead")))
        return fixed

    def _replay(self, tables: list[dict], replay: dict, missed: list[SentUpdate],
                release_gil: bool = False) -> "Correction":
        """Step the rows of each table by ``missed`` (ascending seqs): ``tables[i]["rows"]`` and
        the reply's ``state`` replaced where rows changed, and ``replay["through"]`` moved to the
        last seq, so that no later part (nor a second forward of the batch) steps them again."""
        done, touched = 0, []
        for table, extra in zip(tables, replay["tables"]):
            fixed = None
            if missed:
                # arrays the lookup thread copied (correct_ahead) are ours: stepped in place, not copied again
                fixed = correct_table(int(table["dim"]), table["rows"], extra["state"], extra["signs"],
                                      extra["replica"], extra["absent"], extra["applied"], missed,
                                      self.cfg, self.weight_bound, in_place=bool(extra.get("owned")),
                                      release_gil=release_gil)
            if fixed is None or not fixed.replayed:
                touched.append(None)
                continue
            table["rows"], extra["state"] = fixed.rows, fixed.state
            extra["owned"] = True
            done += fixed.replayed
            touched.append(fixed.touched)
        if missed:  # the history only grows in seq order (one training thread numbers updates)
            replay["through"] = missed[-1].seq
        return Correction(done, touched)

    def _count(self, row_steps: int, batch: bool, part: str = "training") -> None:
        with self._lock:
            self.replayed_row_steps += row_steps
            self.replayed_ahead_row_steps += row_steps if part == "ahead" else 0
            self.replayed_next_row_steps += row_steps if part == "next" else 0
            self.corrected_batches += int(batch)


class Correction(NamedTuple):
    """What :meth:`OwnUpdates.correct` or :meth:`~OwnUpdates.correct_next` replayed: the row-steps, and per
    table the positions whose rows it changed (None: none), which the tensors built ahead need
    rewritten."""

    replayed: int
    touched: list[np.ndarray | None]
