"""What a data loader knows of each NN rank: whether it left training, and whether it came back.

A ``TrainCtx`` publishes ``nn.done`` with its rank when it exits. That alone does not say the rank
is gone: the same process may open another ``TrainCtx`` moments later (one that only loaded a
checkpoint, then the one that trains), which answers on the same subjects. So the loader keeps,
per rank, when its ``nn.done`` arrived, and forgets it as soon as anything answers for that rank
again. The one rule (``rank_gone``) for every request to a rank, batches and ends of stream:

    a rank is gone when its latest news is ``nn.done`` (no answer from it since), nobody listens
    on its subject now (``NoRespondersError``: a busy or slow listener is somebody), and the
    patience of that request has passed since the ``nn.done``.

The patience is what differs, by what giving up costs: a send gives up batches and the end of an
epoch gives up its count, so both wait ``TRAINER_GRACE_S`` for a comeback; the final end of
stream carries nothing a finished trainer needs, so it waits none (a loader ending just after its
trainer, the usual ``until="epoch"`` job, would otherwise wait the grace out at every exit).
A rank with no ``nn.done`` (killed, or not started yet) is never gone: its requests keep their
deadline (``send_deadline_s``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from persia.errors import PersiaError

TRAINER_GRACE_S = 30.0
"""How long a rank that said ``nn.done`` may be away before a send to it fails; also how long the
end of stream waits for a rank that neither answers nor said ``nn.done`` (a trainer between two
contexts or two loops is back within it)."""


def rank_gone(done_at: float | None, now: float, patience_s: float, nobody_listens: bool) -> bool:
    """The rule above: ``done_at`` is when the rank's ``nn.done`` arrived (monotonic seconds; None
    when it never came, or something answered for the rank since)."""
    return nobody_listens and done_at is not None and now - done_at >= patience_s


class TrainerGone(PersiaError):
    """An NN rank finished training (``nn.done``) and no NN worker answers for it any more."""

    def __init__(self, rank: int, silent_s: float, unsent: str):
        super().__init__(f"NN rank {rank} finished training (nn.done {silent_s:.1f}s ago) and no NN worker "
                         f"answers for it: {unsent} not sent")
        self.rank = rank


class TrainerRestarted(PersiaError):
    """An NN rank refused this loader process's batches: the rank was restarted (resuming its
    checkpoint) while this process streamed on, and the batches it had taken since died with its
    earlier process; or the NN ranks were rescaled, and this process still sends to the ranks of
    before. This process stops without ending its stream; started again, it finds the ranks, asks
    each where it is (``nn.position``) and resends from there."""

    def __init__(self, rank: int, why: str, what: str):
        super().__init__(f"NN rank {rank} refused {what}: {why}")
        self.rank = rank


class TrainerNews:
    """Per rank, when its ``nn.done`` arrived, until an answer from it clears it. Written from the
    bus loop (the ``nn.done`` handler, replies as they arrive), read from it and from loader
    threads: hence the lock. Replies are recorded on the loop as they come, so an answer sent
    before an ``nn.done`` (and so received before it) never clears that ``nn.done``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._done_at: dict[int, float] = {}

    def done(self, rank: int) -> None:
        """The rank's ``nn.done``: a later one (a second context that left too) restarts its grace."""
        with self._lock:
            self._done_at[rank] = self._clock()

    def answered(self, rank: int) -> None:
        """Something answered for the rank: it is back (or never left)."""
        with self._lock:
            self._done_at.pop(rank, None)

    def done_at(self, rank: int) -> float | None:
        with self._lock:
            return self._done_at.get(rank)

    def gone(self, rank: int, patience_s: float, nobody_listens: bool) -> bool:
        return rank_gone(self.done_at(rank), self._clock(), patience_s, nobody_listens)

    def gone_error(self, rank: int, unsent: str) -> TrainerGone:
        done_at = self.done_at(rank)
        return TrainerGone(rank, 0.0 if done_at is None else self._clock() - done_at, unsent)
