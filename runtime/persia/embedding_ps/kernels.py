"""The compiled kernels (``_kernels.c``) behind a thin typed layer, and the choice between them and
the pure-numpy code.

The extension is built by ``pip install`` (setup.py). A store uses it when it is importable,
unless ``PERSIA_PS_PURE_NUMPY=1`` is set (or the store is made with ``use_kernel=False``); the
numpy code stays as the fallback and the reference: the engine tests run against both paths.

Inputs are validated in Python before any call (``store.py`` checks the caller's signs and
gradients; these wrappers make them contiguous and of the kernel's dtypes, and the table arrays
are the engine's own). The C side checks every array's dtype, shape, contiguity and length again
and bounds-checks every row number it reads from the index, so a wrong call raises ``ValueError``
(a corrupt index ``RuntimeError``) instead of touching memory it should not.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import numpy as np

from persia.embedding_ps import index as ix
from persia.embedding_ps.optimizers import AdagradConfig, AdamConfig, OptimizerConfig, SGDConfig, optimizer_code
from persia.hashing import seed_salt

log = logging.getLogger(__name__)

try:
    from persia.embedding_ps import _kernels
except ImportError:  # a source tree without a build: numpy only
    _kernels = None

ABI = 5  # the _kernels.c interface this module calls (2: the stamp is a cell of the row, stamp_col; 3: replay;
# 4: replay's release_gil; 5: insert, init_rows)


def stale_reason(module) -> str | None:
    """Why a built extension cannot be used with this code (built from an older ``_kernels.c``,
    e.g. a checkout updated without reinstalling), or None."""
    got = getattr(module, "ABI", 1)
    if got != ABI:
        return (f"persia.embedding_ps._kernels was built from another _kernels.c (interface {got}, this code needs "
                f"{ABI}): rebuild it (make venv, or pip install -e .)")
    return None


_STALE = stale_reason(_kernels) if _kernels is not None else None
if _STALE is not None:  # never call it with arguments it does not know: numpy path, and say why
    _kernels = None
    log.warning("%s; the embedding PS uses the pure-numpy path meanwhile", _STALE)

__all__ = [
    "ABI",
    "stale_reason",
    "ENV_PURE_NUMPY",
    "available",
    "unavailable_reason",
    "default_use_kernel",
    "resolve_use_kernel",
    "locate",
    "update",
    "update_args",
    "scratch_for",
    "replay",
    "partition",
    "insert",
    "init_rows",
    "sign_hash",
    "optimizer_args",
]

ENV_PURE_NUMPY = "PERSIA_PS_PURE_NUMPY"


def available() -> bool:
    """Whether the compiled extension was built and imports."""
    return _kernels is not None


def unavailable_reason() -> str | None:
    """Why the compiled extension is not in use (stale or not built), or None when it is."""
    if _kernels is not None:
        return None
    return _STALE or "persia.embedding_ps._kernels is not built (make venv, or pip install -e .)"


def default_use_kernel() -> bool:
    """The kernel when it is built, unless ``PERSIA_PS_PURE_NUMPY`` is set to anything but ''/0."""
    return available() and os.environ.get(ENV_PURE_NUMPY, "") in ("", "0")


def resolve_use_kernel(use_kernel: bool | None) -> bool:
    """``None`` means the default; ``True`` when the kernel is not built is an error."""
    if use_kernel is None:
        return default_use_kernel()
    if use_kernel and not available():
        raise RuntimeError(
            f"use_kernel=True but {_STALE}" if _STALE else
            "use_kernel=True but persia.embedding_ps._kernels is not built (reinstall the package: pip install -e .)"
        )
    return bool(use_kernel)


def _c(a: np.ndarray, dtype) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)


def locate(table, signs: np.ndarray, out: np.ndarray | None = None, *, positions: bool = True,
           stamp: int | None = None) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None, np.ndarray | None, int]:
    """Probe ``table`` (a :class:`~persia.embedding_ps.table.DimTable`) for ``signs`` in one pass:
    copy weights into ``out`` (zeros for misses) and stamp found rows with ``stamp`` (a training
    lookup). Returns ``(rows, hit, slots, home, misses)`` as ``DimTable.locate``; rows, slots and
    home are None unless ``positions``. The caller holds the read locks of the signs' shards."""
    q = _c(signs, np.uint64)
    n = q.shape[0]
    hit = np.empty(n, dtype=bool)
    rows = slots = home = None
    if positions:
        rows, slots, home = (np.empty(n, dtype=np.int64) for _ in range(3))
    if out is not None and (out.dtype != np.float32 or out.shape != (n, table.dim) or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous float32 array of shape ({n}, {table.dim}), got {out.dtype} {out.shape}")
    misses = _kernels.locate(
        table.index, table.rows, q, table.num_shards, table.M, table.key_col, table.stamp_col, table.dim,
        ix.INTERNAL_SHARD_SALT, hit, out, rows, slots, home, stamp is not None, 0 if stamp is None else int(stamp),
    )
    return rows, hit, slots, home, misses


def insert(index: np.ndarray, h: np.ndarray, rows: np.ndarray, num_shards: int, slots: int) -> int:
    """:func:`persia.embedding_ps.index.insert` (without its duplicate check) compiled: each absent
    entry (distinct rows) takes the first free slot of its probe sequence. Home slots are claimed
    first, last entry first, so a free home slot goes to the last entry whose home it is, as in
    the numpy code's first round; the slots the others end in may differ from numpy's later
    rounds, and both leave every entry reachable from its home slot. Returns the tombstones
    reused."""
    return _kernels.insert(index, _c(h, np.uint64), _c(rows, np.int64), int(num_shards), int(slots))


def init_rows(table, rows: np.ndarray, signs: np.ndarray, stamp: int, lower: float, upper: float,
              seed: int = 0) -> None:
    """Write new ``rows`` of ``table`` whole in one pass: the initial weights of
    :func:`persia.hashing.uniform_from_signs` (the same floats), the sign, ``stamp`` and the
    optimizer's initial state (the numpy code builds a block and scatters it)."""
    _kernels.init_rows(table.rows, table.state, _c(rows, np.int64), _c(signs, np.uint64), table.dim, table.key_col,
                       table.stamp_col, int(stamp), float(lower), float(upper), int(seed_salt(seed)),
                       float(table.state_init))


def optimizer_args(cfg: OptimizerConfig) -> dict:
    """The optimizer as the kernel's keyword arguments (code plus every hyperparameter)."""
    args = dict(code=optimizer_code(cfg), lr=float(cfg.lr), weight_decay=float(cfg.weight_decay), eps=0.0,
                momentum=0.0, g_square_momentum=1.0, beta1=0.0, beta2=0.0, vectorwise=False)
    if isinstance(cfg, SGDConfig):
        args.update(momentum=float(cfg.momentum))
    elif isinstance(cfg, AdagradConfig):
        args.update(eps=float(cfg.eps), g_square_momentum=float(cfg.g_square_momentum),
                    vectorwise=bool(cfg.vectorwise_shared))
    elif isinstance(cfg, AdamConfig):
        args.update(eps=float(cfg.eps), beta1=float(cfg.betas[0]), beta2=float(cfg.betas[1]))
    else:
        raise TypeError(f"not an optimizer config: {type(cfg).__name__}")
    return args


def update_args(cfg: OptimizerConfig, weight_bound: float) -> dict:
    """The kernel arguments an update call shares for every table and shard."""
    return dict(optimizer_args(cfg), salt=ix.INTERNAL_SHARD_SALT, weight_bound=float(weight_bound))


class UpdateResult(NamedTuple):
    missing: int  # gradients whose sign has no row (counted per gradient, repeats included)
    folded: int  # gradients of found rows summed into another one of the same sign
    promoted: int  # index entries moved to their home slot


def scratch_for(n: int) -> np.ndarray:
    """The set :func:`update` checks ``n`` signs for repeats in (reusable across calls)."""
    return np.empty(1 << max(1, int(2 * n - 1).bit_length()), dtype=np.uint32)


def update(table, signs: np.ndarray, grads: np.ndarray, args: dict, hit: np.ndarray,
           scratch: np.ndarray | None = None) -> UpdateResult:
    """One optimizer step on the rows of ``signs`` in place (``args`` from :func:`update_args`);
    ``hit`` (bool, len(signs)) gets which signs had a row. The caller owns the shard of every
    sign and passes contiguous ``signs`` (uint64) and ``grads`` (float32, (n, dim)); ``scratch``
    (:func:`scratch_for`, at least for n) may be reused from call to call.

    A repeated sign gets the sum of its gradients in a single step, as on the numpy path: the
    kernel refuses such a batch untouched and it is folded here first (rare: the embedding worker
    sends one gradient per distinct ID)."""
    n = signs.shape[0]
    if n == 0:
        return UpdateResult(0, 0, 0)
    if scratch is None or scratch.shape[0] < 2 * n:
        scratch = scratch_for(n)
    common = dict(index=table.index, rows=table.rows, state=table.state, num_shards=table.num_shards,
                  slots_per_region=table.M, key_col=table.key_col, stamp_col=table.stamp_col, dim=table.dim,
                  gbuf=np.empty(2 * table.dim, dtype=np.float32), **args)
    size = 1 << int(2 * n - 1).bit_length()  # the smallest power of two that fits: stays in cache
    repeats, missing, promoted = _kernels.update(signs=signs, grads=grads, hit=hit, scratch=scratch[:size], **common)
    if not repeats:
        return UpdateResult(missing, 0, promoted)
    # sum each sign's gradients in batch order (as np.add.at on the numpy path), one step each
    uniq, inverse, counts = np.unique(signs, return_inverse=True, return_counts=True)
    summed = np.zeros((uniq.shape[0], table.dim), dtype=np.float32)
    np.add.at(summed, inverse, grads)
    hit_u = np.empty(uniq.shape[0], dtype=bool)
    _, _, promoted = _kernels.update(signs=uniq, grads=summed, hit=hit_u, **common)
    hit[:] = hit_u[inverse]
    return UpdateResult(int(counts[~hit_u].sum()), int((counts[hit_u] - 1).sum()), promoted)


def replay(rows: np.ndarray, state: np.ndarray, signs: np.ndarray, replica: np.ndarray, live: np.ndarray | None,
           done: np.ndarray, usigns: np.ndarray, ugrads: np.ndarray, touched: np.ndarray, args: dict,
           gbuf: np.ndarray, release_gil: bool = False) -> int:
    """One missed update of an NN worker stepped, in place, onto its copy of a looked-up table
    (:func:`persia.nn_worker.replay.correct_table` validates and prepares the arrays; ``args``:
    :func:`optimizer_args` and ``weight_bound``). Returns the row-steps; sets ``touched`` where it
    stepped. One C call per update: the sorted-merge lookup and the steps run in C, holding the GIL
    unless ``release_gil`` (a lookup thread's replay: the training thread's is too short to be
    worth handing the GIL away and waiting to get it back)."""
    return _kernels.replay(rows=rows, state=state, signs=signs, replica=replica, live=live, done=done, usigns=usigns,
                           ugrads=ugrads, touched=touched, gbuf=gbuf, release_gil=release_gil, **args)


def partition(signs: np.ndarray, grads: np.ndarray, num_shards: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """``(bounds, signs, grads)`` of a batch (contiguous uint64 signs, float32 (n, dim) grads)
    sorted by internal shard, stably, in one pass: shard ``k`` owns ``[bounds[k], bounds[k+1])``."""
    bounds = np.empty(num_shards + 1, dtype=np.int64)
    q = np.empty_like(signs)
    g = np.empty_like(grads)
    _kernels.partition(signs, grads, num_shards, ix.INTERNAL_SHARD_SALT, bounds, q, g)
    return bounds.tolist(), q, g


def sign_hash(signs: np.ndarray) -> np.ndarray:
    """The kernel's internal hash of each sign (must equal :func:`persia.embedding_ps.index.sign_hash`)."""
    q = _c(signs, np.uint64)
    out = np.empty(q.shape[0], dtype=np.uint64)
    _kernels.sign_hash(q, ix.INTERNAL_SHARD_SALT, out)
    return out
