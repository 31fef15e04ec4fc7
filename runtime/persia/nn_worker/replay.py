"""Own-update replay: the NN worker re-applies its own embedding updates that the PS had not yet
applied when a batch's rows were read, so hybrid training reads its own writes.

Pure functions, no I/O: :func:`applied_tables` computes, from the NN's copy of a lookup reply,
exactly the rows and gradients the PS will apply for one update (what the embedding worker's
``check_gradients`` + ``split_gradients`` send, over every replica); :class:`UpdateHistory` keeps
those updates by seq; :func:`correct_table` replays the missed ones on a looked-up table with the
PS's own optimizer step (:func:`persia.embedding_ps.optimizers.apply_step`), so the corrected rows
equal a read taken after those updates. Other ranks' updates stay stale, as in PERSIA.
"""

from __future__ import annotations

import bisect
import functools
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from persia.embedding_ps import kernels
from persia.embedding_ps.optimizers import apply_step, state_width

__all__ = ["SentUpdate", "applied_tables", "Corrected", "correct_table", "UpdateHistory"]


def _check_sorted_signs(signs: np.ndarray, field: str) -> None:
    if signs.ndim != 1 or signs.dtype != np.uint64:
        raise ValueError(f"field {field!r}: expected a 1-D uint64 array, got {signs.dtype} of shape {signs.shape}")
    if signs.size > 1 and not bool((signs[1:] > signs[:-1]).all()):
        raise ValueError(f"field {field!r}: signs must be sorted and distinct (searchsorted relies on it)")


@dataclass(frozen=True)
class SentUpdate:
    """One update the NN worker sent: ``tables``: dim -> (sorted distinct uint64 signs, float32
    (k, dim) gradients exactly as the PS applies them)."""

    seq: int
    tables: dict[int, tuple[np.ndarray, np.ndarray]]

    def __post_init__(self) -> None:
        if isinstance(self.seq, bool) or not isinstance(self.seq, (int, np.integer)) or self.seq < 0:
            raise ValueError(f"field 'seq': expected a non-negative integer, got {self.seq!r}")
        for dim, (signs, grads) in self.tables.items():
            _check_sorted_signs(signs, f"tables[{dim}].signs")
            if grads.dtype != np.float32 or grads.shape != (signs.size, dim):
                raise ValueError(f"field 'tables[{dim}].grads': expected float32 of shape ({signs.size}, {dim}), "
                                 f"got {grads.dtype} of shape {grads.shape}")


def applied_tables(tables: list[dict], slots: list[dict], grads: list, scale: float,
                   unused_slots: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """What the PS applies for one update, computed from the NN's copy of the lookup reply:
    ``tables[i]`` = {"dim", "signs" (sorted uint64, n), "rows", optional "gather" (k, bs)};
    ``slots`` as :func:`persia.embedding_worker.pipeline.lookup_reply` makes them. Equals
    ``pipeline.check_gradients`` + ``split_gradients`` over all replicas (sorted by sign): the
    scale undone by the same float32 multiply, a dim with any non-finite gradient dropped, rows
    only of used slots (raw slots: only kept rows, ``raw_index > 0``). Dims with no row to update
    are left out, as the PS gets nothing for them.
    """
    if len(grads) != len(tables):
        raise ValueError(f"field 'grads': expected {len(tables)} per-dim gradients, got {len(grads)}")
    unused = set()
    for x in unused_slots:
        if not 0 <= x < len(slots):
            raise ValueError(f"field 'unused_slots': slot position {x} out of range 0..{len(slots) - 1}")
        unused.add(x)
    by_dim = {}
    for i, t in enumerate(tables):
        if t["dim"] in by_dim:
            raise ValueError(f"field 'tables[{i}].dim': dim {t['dim']} appears twice")
        by_dim[t["dim"]] = t
    inv_scale = np.float32(1.0 / scale) if scale != 1.0 else None
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i, (t, g) in enumerate(zip(tables, grads)):
        if g is None:
            continue
        d, signs = t["dim"], t["signs"]  # sorted: checked once, when the update becomes a SentUpdate
        if g.shape != (signs.size, d):
            raise ValueError(f"field 'grads[{i}]': expected shape {(signs.size, d)}, got {tuple(g.shape)}")
        g = np.asarray(g, dtype=np.float32)
        if not np.isfinite(g).all():
            continue  # the embedding worker drops the whole dim
        if inv_scale is not None:
            g = g * inv_scale
        members = [(k, s) for k, s in enumerate(slots) if s["dim"] == d]
        if not any(k in unused or "raw_index" in s for k, s in members):
            sel = None  # every row of the dim occurs in a used summed slot
        else:
            mask = np.zeros(signs.size, dtype=bool)
            for k, s in members:
                if k in unused:
                    continue
                if "raw_index" in s:
                    raw = s["raw_index"]
                    mask[raw[raw > 0] - 1] = True  # only the IDs within sample_fixed_size
                elif "gather" in s:
                    mask[t["gather"][s["gather"]]] = True
                else:
                    mask[s["index"]] = True
            sel = np.flatnonzero(mask)
        if sel is None:
            if signs.size:
                out[d] = (signs, g)
        elif sel.size:
            out[d] = (signs[sel], g[sel])
    return out


class Corrected(NamedTuple):
    """A table after :func:`correct_table`: new ``rows`` and ``state`` arrays, the row-steps
    ``replayed``, and the positions ``touched`` (ascending: the rows any update stepped, the only
    ones that can differ from the input)."""

    rows: np.ndarray
    state: np.ndarray
    replayed: int
    touched: np.ndarray


_NONE_TOUCHED = np.zeros(0, dtype=np.intp)
_NONE_TOUCHED.flags.writeable = False


def correct_table(dim: int, rows: np.ndarray, state: np.ndarray, signs: np.ndarray,
                  replica: np.ndarray, absent: np.ndarray, applied: list[np.ndarray],
                  missed: list[SentUpdate], cfg, weight_bound: float, use_kernel: bool | None = None,
                  in_place: bool = False, release_gil: bool = False) -> Corrected:
    """``rows``/``state`` of one looked-up table as they would read had every update in
    ``missed`` (ascending seq) been applied before the read: for each update, the rows whose sign
    it has, that are not ``absent`` and whose PS replica (``replica[i]`` indexes ``applied``, each
    a sorted array of the seqs that replica had applied at the read) had not applied its seq, get
    ``apply_step(cfg, w, s, g, weight_bound)``, in seq order. Returns new arrays (the inputs are
    read-only wire views, never written), the number of row-steps replayed and the rows touched;
    with ``in_place`` it steps ``rows`` and ``state`` themselves and returns them (arrays an earlier
    correction returned: the second part of a batch's correction then copies nothing).

    Part of it runs on the training thread before every corrected batch, so it costs only what
    it must: O(1) checks of the inputs, then per update one call of the compiled kernel
    (``use_kernel``: None = when built, unless ``PERSIA_PS_PURE_NUMPY``) or, as the reference, one
    searchsorted and the optimizer on the rows it hits. ``signs`` must be sorted (the embedding
    worker's dedup, ``persia.unique``, makes them so; the kernel checks what it merges, and the
    same signs are checked when their update becomes a :class:`SentUpdate`). ``release_gil``: the kernel steps
    without the GIL (a lookup thread's correction, which the training thread should not wait for).
    """
    n = signs.shape[0]
    absent = np.asarray(absent, dtype=np.int64)
    if signs.ndim != 1 or signs.dtype != np.uint64:
        raise ValueError(f"field 'signs': expected a 1-D uint64 array, got {signs.dtype} of shape {signs.shape}")
    if rows.shape != (n, dim):
        raise ValueError(f"field 'rows': expected shape ({n}, {dim}), got {rows.shape}")
    width = state_width(cfg, dim)
    # a table no sample of the batch had IDs for comes back with no rows and no state columns (no
    # PS was asked): nothing to replay, whatever the optimizer's width
    if state.shape != (n, width) and not (n == 0 and state.ndim == 2 and state.shape[0] == 0):
        raise ValueError(f"field 'state': expected shape ({n}, {width}) for {type(cfg).__name__}, got {state.shape}")
    if replica.shape != (n,):
        raise ValueError(f"field 'replica': expected shape ({n},), got {replica.shape}")
    for a, b in zip(missed, missed[1:]):
        if b.seq <= a.seq:
            raise ValueError(f"field 'missed': seqs must ascend, got {a.seq} then {b.seq}")
    live = None
    if absent.size:
        if not (0 <= int(absent.min()) and int(absent.max()) < n):
            raise ValueError(f"field 'absent': positions must lie in 0..{n - 1}, got {int(absent.min())}..{int(absent.max())}")
        live = np.ones(n, dtype=bool)
        live[absent] = False
    if in_place:
        for field, a in (("rows", rows), ("state", state)):
            if a.dtype != np.float32 or not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"field {field!r}: in_place needs a writable C-contiguous float32 array, got "
                                 f"{a.dtype}{'' if a.flags.writeable else ', read-only'}"
                                 f"{'' if a.flags.c_contiguous else ', not contiguous'}")
        new_rows, new_state = rows, state
    else:
        new_rows = np.array(rows, dtype=np.float32, order="C")
        new_state = np.array(state, dtype=np.float32, order="C")
    updates = [(u.seq, u.tables[dim]) for u in missed if dim in u.tables] if n else []
    if not updates:
        return Corrected(new_rows, new_state, 0, _NONE_TOUCHED)
    if kernels.resolve_use_kernel(use_kernel):
        replayed, touched = _replay_compiled(new_rows, new_state, signs, replica, live, applied, updates, cfg,
                                             weight_bound, release_gil)
    else:
        replayed, touched = _replay_numpy(new_rows, new_state, signs, replica, live, applied, updates, cfg, weight_bound)
    return Corrected(new_rows, new_state, replayed, touched)


def _done_by(applied: list[np.ndarray], seq: int) -> np.ndarray:
    """Which replicas had applied update ``seq`` when they read (few replicas: a short loop)."""
    return np.array([a.size > 0 and bool(a[min(int(np.searchsorted(a, seq)), a.size - 1)] == seq) for a in applied],
                    dtype=bool)


def _replay_compiled(rows: np.ndarray, state: np.ndarray, signs: np.ndarray, replica: np.ndarray,
                     live: np.ndarray | None, applied: list[np.ndarray], updates: list, cfg,
                     weight_bound: float, release_gil: bool = False) -> tuple[int, np.ndarray]:
    """Each update by one call of the compiled kernel (a merge of the sorted signs, the steps in
    C), in place on ``rows``/``state``."""
    n, dim = rows.shape
    if replica.dtype != np.uint16:
        if replica.size and not (0 <= int(replica.min()) and int(replica.max()) < len(applied)):
            raise ValueError(f"field 'replica': a replica index is not below len(applied) = {len(applied)}")
        replica = replica.astype(np.uint16)
    replica = np.ascontiguousarray(replica)
    signs = np.ascontiguousarray(signs)
    mark = np.zeros(n, dtype=bool)
    gbuf = np.empty(2 * dim, dtype=np.float32)
    args = _kernel_args(cfg, weight_bound)
    done = 0
    for seq, (usigns, ugrads) in updates:  # the kernel checks the order of the signs it merges and the replicas
        done += kernels.replay(rows, state, signs, replica, live, _done_by(applied, seq), usigns, ugrads, mark, args,
                               gbuf, release_gil)
    return done, (np.flatnonzero(mark) if done else _NONE_TOUCHED)


@functools.lru_cache(maxsize=16)
def _kernel_args(cfg, weight_bound: float) -> dict:
    return dict(kernels.optimizer_args(cfg), weight_bound=float(weight_bound))


def _replay_numpy(rows: np.ndarray, state: np.ndarray, signs: np.ndarray, replica: np.ndarray,
                  live: np.ndarray | None, applied: list[np.ndarray], updates: list, cfg,
                  weight_bound: float) -> tuple[int, np.ndarray]:
    """The reference: per update one searchsorted, the optimizer on the rows it hits (gathered
    once for all updates, no sort), in place on ``rows``/``state``."""
    n = signs.shape[0]
    hits = []  # per update with rows to replay: (table positions, its gradient rows)
    for seq, (usigns, ugrads) in updates:
        pos = np.searchsorted(signs, usigns)
        np.minimum(pos, n - 1, out=pos)
        hit = signs[pos] == usigns
        if live is not None:
            hit &= live[pos]
        done = _done_by(applied, seq)
        if done.any():
            try:
                hit &= ~done[replica[pos]]
            except IndexError:
                raise ValueError(f"field 'replica': a replica index is not below len(applied) = {len(applied)}") from None
        sel = np.flatnonzero(hit)
        if sel.size:
            hits.append((pos[sel], np.take(ugrads, sel, axis=0)))
    if not hits:
        return 0, _NONE_TOUCHED
    # the rows any update hits, gathered once; each update steps its own subset, in seq order
    if len(hits) == 1:
        touched = hits[0][0]  # ascending: searchsorted of sorted signs
        w, s = rows[touched], state[touched]
        apply_step(cfg, w, s, hits[0][1], weight_bound)
    else:
        mark = np.zeros(n, dtype=bool)
        for p, _ in hits:
            mark[p] = True
        touched = np.flatnonzero(mark)
        at = np.empty(n, dtype=np.intp)  # table position -> its place in ``touched``
        at[touched] = np.arange(touched.size)
        w, s = rows[touched], state[touched]
        for p, g in hits:
            i = at[p]
            wi, si = w[i], s[i]
            apply_step(cfg, wi, si, g, weight_bound)
            w[i], s[i] = wi, si
    rows[touched] = w
    state[touched] = s
    return int(sum(p.size for p, _ in hits)), touched


class UpdateHistory:
    """Thread-safe store of sent updates by seq: ``add(SentUpdate)`` (seqs strictly ascending),
    ``since(seq)`` -> the ascending list of updates with seq >= given, ``forget_below(seq)``.
    Asking ``since`` below what was forgotten raises: those updates can no longer be replayed,
    and a silently short list would leave rows stale."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seqs: list[int] = []
        self._updates: list[SentUpdate] = []
        self._horizon = 0  # every update with seq below it was forgotten

    def add(self, update: SentUpdate) -> None:
        with self._lock:
            if self._seqs and update.seq <= self._seqs[-1]:
                raise ValueError(f"field 'seq': {update.seq} is not above the last added seq {self._seqs[-1]}")
            if update.seq < self._horizon:
                raise ValueError(f"field 'seq': {update.seq} is below the forgotten horizon {self._horizon}")
            self._seqs.append(int(update.seq))
            self._updates.append(update)

    def since(self, seq: int) -> list[SentUpdate]:
        with self._lock:
            if seq < self._horizon:
                raise ValueError(f"since({seq}): updates below seq {self._horizon} were forgotten")
            return self._updates[bisect.bisect_left(self._seqs, seq):]

    def forget_below(self, seq: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._seqs, seq)
            del self._seqs[:i], self._updates[:i]
            self._horizon = max(self._horizon, int(seq))

    def __len__(self) -> int:
        with self._lock:
            return len(self._seqs)
