"""The adult-income NN worker, printing a digest of its dense parameters after a resume and when
training ends, so a test can check that every DDP rank resumed, and ended, with the same dense
model (a rank that loaded nothing, or something else, would differ). Parameters only: buffers
(BatchNorm's running statistics) legitimately differ between ranks after a step, since DDP
broadcasts rank 0's before each forward and every rank then updates its own from its batch."""

import hashlib
import logging
import runpy
from pathlib import Path

from persia.nn_worker import train_ctx

log = logging.getLogger("digest_trainer")


def dense_digest(ctx) -> str:
    h = hashlib.sha256()
    for name, t in sorted(ctx.model.named_parameters()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


_resume, _exit = train_ctx.TrainCtx._resume_at_enter, train_ctx.TrainCtx._exit


def _resume_then_digest(self):
    _resume(self)
    if self.resumed_from:
        log.info("DENSE_DIGEST rank %d resumed step %d: %s", self.rank, self.step, dense_digest(self))


def _digest_then_exit(self, exc):
    try:
        if exc is None:
            self._wait_for_updates()
            log.info("DENSE_DIGEST rank %d final step %d: %s", self.rank, self.step, dense_digest(self))
    finally:
        _exit(self, exc)


train_ctx.TrainCtx._resume_at_enter = _resume_then_digest
train_ctx.TrainCtx._exit = _digest_then_exit
runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "adult-income" / "train.py"),
               run_name="__main__")
