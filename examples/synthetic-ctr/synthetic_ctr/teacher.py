"""The hidden teacher that draws labels: per-slot embeddings + a one-hidden-layer MLP + a wide term.

Everything is a deterministic function of the seed, so the same config always yields the same
labels, and the teacher's own probabilities give the AUC a perfect student could reach (the
benchmark's upper bound). The embeddings are folded into per-slot projection tables
(``card x hidden`` and ``card``) at construction, so labelling a chunk is 26 gathers and adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from synthetic_ctr.schema import NUM_DENSE, NUM_SLOTS

TEACHER_DIM = 8
TEACHER_HIDDEN = 32


@dataclass
class Teacher:
    hidden_tables: list[np.ndarray]  # per slot, (card, hidden) = E_s @ W1_s
    wide_tables: list[np.ndarray]  # per slot, (card,) = E_s @ w_wide_s
    dense_hidden: np.ndarray  # (13, hidden)
    dense_wide: np.ndarray  # (13,)
    hidden_bias: np.ndarray  # (hidden,)
    out_weight: np.ndarray  # (hidden,)
    logit_scale: float = 1.0
    logit_bias: float = 0.0

    def raw_logit(self, dense_latent: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Unscaled logit for rows with latent dense values (n, 13) and per-slot ranks (n, 26)."""
        h = dense_latent @ self.dense_hidden + self.hidden_bias
        wide = dense_latent @ self.dense_wide
        for s in range(NUM_SLOTS):
            r = ranks[:, s]
            h += self.hidden_tables[s][r]
            wide += self.wide_tables[s][r]
        np.maximum(h, 0.0, out=h)
        return h @ self.out_weight + wide

    def probability(self, dense_latent: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        z = self.logit_scale * self.raw_logit(dense_latent, ranks) + self.logit_bias
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)


def build_teacher(cardinalities: tuple[int, ...], rng: np.random.Generator) -> Teacher:
    """Draw the teacher's parameters. Slot weights vary so that some slots matter more than others."""
    hidden, tdim = TEACHER_HIDDEN, TEACHER_DIM
    fan_in = NUM_DENSE + NUM_SLOTS * tdim
    slot_weight = rng.uniform(0.3, 1.0, size=NUM_SLOTS)
    hidden_tables, wide_tables = [], []
    for s, card in enumerate(cardinalities):
        emb = rng.standard_normal((card, tdim), dtype=np.float32) * np.float32(slot_weight[s])
        w1 = rng.standard_normal((tdim, hidden), dtype=np.float32) / np.float32(np.sqrt(fan_in))
        ww = rng.standard_normal(tdim, dtype=np.float32) / np.float32(np.sqrt(fan_in))
        hidden_tables.append(emb @ w1)
        wide_tables.append(emb @ ww)
    return Teacher(
        hidden_tables=hidden_tables,
        wide_tables=wide_tables,
        dense_hidden=rng.standard_normal((NUM_DENSE, hidden), dtype=np.float32) / np.float32(np.sqrt(fan_in)),
        dense_wide=rng.standard_normal(NUM_DENSE, dtype=np.float32) / np.float32(np.sqrt(fan_in)),
        hidden_bias=(rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.1)),
        out_weight=rng.standard_normal(hidden, dtype=np.float32) / np.float32(np.sqrt(hidden)),
    )


def calibrate(teacher: Teacher, raw_logits: np.ndarray, logit_std: float, ctr: float) -> Teacher:
    """Scale the logit to ``logit_std`` (sets how separable labels are, hence the teacher AUC) and
    pick the bias by bisection so the mean click probability is ``ctr``."""
    if not (0.0 < ctr < 1.0):
        raise ValueError(f"ctr must be in (0, 1), got ctr={ctr!r}")
    if logit_std <= 0:
        raise ValueError(f"teacher_logit_std must be > 0, got teacher_logit_std={logit_std!r}")
    centred = raw_logits - raw_logits.mean()
    scale = logit_std / float(centred.std())
    z = scale * centred
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(np.mean(1.0 / (1.0 + np.exp(-(z + mid))))) < ctr:
            lo = mid
        else:
            hi = mid
    teacher.logit_scale = scale
    teacher.logit_bias = 0.5 * (lo + hi) - scale * float(raw_logits.mean())
    return teacher
