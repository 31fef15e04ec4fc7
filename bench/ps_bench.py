"""Embedding PS storage engine benchmark (issue 3 item 6): speed near the memory limit, compactness,
checkpoint throughput. Every speed is a ratio to plain numpy on the same rows in the same run.

    python bench/ps_bench.py               # 10M rows, dim 16, Adagrad, 1M-ID batches (make bench-ps)
    python bench/ps_bench.py --small       # 1M rows, batches of 100K: a quick check
    python bench/ps_bench.py --pure-numpy  # the fallback engine path (no compiled kernel)

Method (one core, pinned):
* fill: ``rows`` distinct random uint64 IDs inserted by training lookups;
* memory: resident-set growth of the process over the fill, per row, against the raw bytes
  ``dim*4*(1+state)`` (state = dim for Adagrad); ``max_rows_24gib`` extrapolates it;
* warm-up: a few training steps (lookup of a Zipf batch, update of its distinct IDs), as in steady
  training (hot IDs settle in their home index slot then);
* lookup: batches of ``batch`` IDs drawn Zipf-like (rank ``~ Zipf(a)`` over a random permutation of
  the resident IDs), training lookups, against ``np.take(weights, rows, axis=0)`` of the same rows
  in a plain ``(rows, dim)`` array (the memory-bound limit of a gather); inference lookups of
  another such batch;
* update: batches of ``batch`` *distinct* IDs drawn Zipf-like (the embedding worker sends one
  reduced gradient per distinct ID), Adagrad, against the plain numpy scatter ``W[rows] = G`` of the
  same rows in a plain ``(rows, dim)`` array (``update_ratio``, the issue's baseline). Reported
  beside it: the same scatter with rows viewed as opaque 64-byte items (numpy's fastest scatter,
  about twice as fast as ``W[rows] = G``), and numpy doing the whole Adagrad step on known rows of
  plain weight/state arrays (gather, compute, scatter: a read-modify-write like the engine's);
* dump / load: the whole table to local disk (files fsync'ed, then dropped from the page cache so
  the load reads the disk), as GB/s of file bytes.
Lookups and updates are timed in CPU time of the (single) benchmark thread, page faults included,
so that other jobs sharing the machine's cores do not enter the ratios; the wall-clock lookup ratio
is reported beside it. Results go to ``bench/results/ps.json``, with the engine path measured (``compiled`` kernel, or
``numpy`` with ``--pure-numpy`` / ``PERSIA_PS_PURE_NUMPY=1`` / no kernel built).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from persia.allocator import tune_allocator
from persia.embedding_ps import AdagradConfig, EmbeddingStore, kernels
from persia.embedding_ps.optimizers import state_width

RESULTS = Path(__file__).resolve().parent / "results" / "ps.json"
GIB = 1 << 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pin_to_one_core() -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity)"
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to cpu {cpu}"


def zipf_ranks(rng: np.random.Generator, n: int, universe: int, a: float) -> np.ndarray:
    """``n`` ranks in ``[0, universe)`` with P(rank k) ~ (k+1)**-a (rejection of the tail)."""
    out = np.empty(0, dtype=np.int64)
    while out.shape[0] < n:
        r = rng.zipf(a, size=2 * n)
        out = np.concatenate([out, r[r <= universe] - 1])
    return out[:n]


def zipf_distinct(rng: np.random.Generator, n: int, universe: int, a: float) -> np.ndarray:
    """``n`` distinct ranks drawn without replacement with weights (k+1)**-a (Gumbel top-k)."""
    keys = -a * np.log(np.arange(1, universe + 1, dtype=np.float64)) + rng.gumbel(size=universe)
    top = np.argpartition(-keys, n - 1)[:n]
    rng.shuffle(top)
    return top


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_timed(fn) -> tuple[float, float]:
    """``(cpu, wall)`` seconds of ``fn``: the CPU time of this thread (user + system, page faults
    included) is what the lookup/update ratios use, because the development machine is shared
    by several agents and wall time there also counts the time this process waits for a core;
    wall time is kept beside it. The engine and the numpy baselines run on the calling thread."""
    c, w = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c, time.perf_counter() - w


def numpy_adagrad_step(weights, state, rows, grads, cfg: AdagradConfig, chunk: int = 1 << 16) -> None:
    """The baseline update: numpy's Adagrad on known rows of plain arrays (gather, compute, scatter),
    in cache-sized chunks like the engine."""
    wv = weights.view(np.dtype((np.void, weights.shape[1] * 4))).reshape(-1)
    sv = state.view(np.dtype((np.void, state.shape[1] * 4))).reshape(-1)
    for a in range(0, rows.shape[0], chunk):
        r, g = rows[a : a + chunk], grads[a : a + chunk]
        w = np.take(weights, r, axis=0)
        s = np.take(state, r, axis=0)
        s += g * g
        d = np.sqrt(s)
        d += np.float32(cfg.eps)
        np.divide(g, d, out=d)
        d *= np.float32(cfg.lr)
        w -= d
        wv[r] = w.view(wv.dtype).reshape(-1)
        sv[r] = s.view(sv.dtype).reshape(-1)


def drop_from_page_cache(directory: Path) -> None:
    """Evict the (fsync'ed, clean) checkpoint files from the page cache: the load reads the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in directory.rglob("*.emb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="1M rows, batches of 100K (a quick run)")
    ap.add_argument("--rows", type=int, default=None, help="resident rows (default 10M, --small 1M)")
    ap.add_argument("--batch", type=int, default=None, help="IDs per batch (default 1M, --small 100K)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--shards", type=int, default=16, help="num_hashmap_internal_shards")
    ap.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ID draws")
    ap.add_argument("--warmup", type=int, default=5, help="training steps before timing")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per operation")
    ap.add_argument("--workers", type=int, default=4, help="checkpointing_config.num_workers")
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    ap.add_argument("--pure-numpy", action="store_true", help="measure the pure-numpy engine path")
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    rows_n = args.rows or (1_000_000 if args.small else 10_000_000)
    batch = args.batch or (100_000 if args.small else 1_000_000)
    dim = args.dim
    pinned = "not pinned" if args.no_pin else pin_to_one_core()
    malloc = tune_allocator()  # as the PS process runs (persia-launcher sets it for every role)
    rng = np.random.default_rng(12345)
    cfg = AdagradConfig(lr=0.01)
    sw = state_width(cfg, dim)
    use_kernel = False if args.pure_numpy else kernels.default_use_kernel()
    path = "compiled" if use_kernel else "numpy"
    print(f"PS bench: {rows_n:,} rows, dim {dim}, Adagrad, {args.shards} internal shards, batches of {batch:,}, "
          f"Zipf a={args.zipf}; engine path: {path}; {pinned}; malloc: {malloc}", flush=True)

    # inputs first, so the memory measured below is the store's alone
    ids = np.unique(rng.integers(0, np.iinfo(np.uint64).max, size=int(rows_n * 1.001) + 16, dtype=np.uint64, endpoint=True))
    ids = rng.permutation(ids[:rows_n])
    if ids.shape[0] != rows_n:
        raise SystemExit("could not draw enough distinct IDs")
    rank_to_row = rng.permutation(rows_n)  # rank k of the Zipf law is resident row rank_to_row[k]

    per_shard = rows_n / args.shards  # internal shards fill unevenly: 5 standard deviations of headroom
    capacity = int(args.shards * (per_shard + 5 * math.sqrt(per_shard)))
    rss0 = rss_bytes()
    store = EmbeddingStore(capacity, args.shards, use_kernel=use_kernel)
    store.register_optimizer(cfg)
    fill_s = 0.0
    for a in range(0, rows_n, batch):
        fill_s += timed(lambda: store.lookup(ids[a : a + batch], dim, True))
    if len(store) != rows_n:
        raise SystemExit(f"fill left {len(store)} rows resident, expected {rows_n} (evictions?)")
    rss1 = rss_bytes()
    peak1 = peak_rss_bytes()
    raw_per_row = 4 * (dim + sw)  # dim * 4 * (1 + state), state = sw / dim
    array_bytes = store.memory_bytes()
    # A small table can fit in memory the allocator already held (RSS does not grow): then fall back
    # to the store's own array bytes, a lower bound of what it keeps resident.
    bytes_per_row = (rss1 - rss0) / rows_n if rss1 > rss0 else array_bytes / rows_n
    memory_ratio = bytes_per_row / raw_per_row
    peak_per_row = (peak1 - rss0) / rows_n
    max_rows = int((24 * GIB - rss0) / bytes_per_row)
    print(f"fill: {rows_n / fill_s / 1e6:.2f} M inserts/s; resident {bytes_per_row:.1f} B/row = "
          f"{memory_ratio:.3f} x raw {raw_per_row} B (arrays {array_bytes / rows_n:.1f} B/row); "
          f"fill peak {peak_per_row:.1f} B/row; max rows in 24 GiB: {max_rows / 1e6:.0f}M", flush=True)

    # plain numpy arrays for the baselines: same rows, known row numbers
    weights = rng.random((rows_n, dim), dtype=np.float32) * np.float32(0.02) - np.float32(0.01)
    state = np.full((rows_n, sw), cfg.initial_accumulator_value, dtype=np.float32)

    for _ in range(args.warmup):
        warm = ids[rank_to_row[zipf_ranks(rng, batch, rows_n, args.zipf)]]
        store.lookup(warm, dim, True)
        distinct = np.unique(warm)
        store.update(distinct, rng.standard_normal((distinct.shape[0], dim)).astype(np.float32) * np.float32(0.01))

    lookup_t, infer_t, gather_t = [], [], []
    lookup_w, infer_w, gather_w = [], [], []
    for _ in range(args.repeats):
        rows = rank_to_row[zipf_ranks(rng, batch, rows_n, args.zipf)]
        signs = ids[rows]
        # the inference lookup gets its own batch: on the training batch's rows it would find them
        # in cache (a small table fits the L3 cache in good part) and look faster than it is
        infer_signs = ids[rank_to_row[zipf_ranks(rng, batch, rows_n, args.zipf)]]
        for times, walls, fn in ((gather_t, gather_w, lambda: np.take(weights, rows, axis=0)),
                                 (lookup_t, lookup_w, lambda: store.lookup(signs, dim, True)),
                                 (infer_t, infer_w, lambda: store.lookup(infer_signs, dim, False))):
            cpu, wall = cpu_timed(fn)
            times.append(cpu)
            walls.append(wall)
        got = store.lookup(signs[:1000], dim, False)
        if not np.all(np.isfinite(got)) or not np.any(got):
            raise SystemExit("lookup returned no data")
    lookup_ratio = float(np.median(gather_t) / np.median(lookup_t))
    infer_ratio = float(np.median(gather_t) / np.median(infer_t))
    lookup_ratio_wall = float(np.median(gather_w) / np.median(lookup_w))
    print(f"lookup: {batch / np.median(lookup_t) / 1e6:.2f} M IDs/s (training), "
          f"{batch / np.median(infer_t) / 1e6:.2f} M IDs/s (inference); numpy gather "
          f"{batch / np.median(gather_t) / 1e6:.2f} M IDs/s -> ratio {lookup_ratio:.2f} (inference {infer_ratio:.2f}; "
          f"wall-clock ratio {lookup_ratio_wall:.2f}); CPU time of this thread",
          flush=True)

    update_t, step_t, scatter_t, void_t = [], [], [], []
    wv = weights.view(np.dtype((np.void, dim * 4))).reshape(-1)
    for _ in range(args.repeats):
        rows = rank_to_row[zipf_distinct(rng, batch, rows_n, args.zipf)]
        signs = ids[rows]
        grads = rng.standard_normal((batch, dim)).astype(np.float32) * np.float32(0.01)
        scatter_t.append(cpu_timed(lambda: weights.__setitem__(rows, grads))[0])  # W[rows] = G
        void_t.append(cpu_timed(lambda: wv.__setitem__(rows, grads.view(wv.dtype).reshape(-1)))[0])
        step_t.append(cpu_timed(lambda: numpy_adagrad_step(weights, state, rows, grads, cfg))[0])
        update_t.append(cpu_timed(lambda: store.update(signs, grads))[0])
    update_ratio = float(np.median(scatter_t) / np.median(update_t))
    void_ratio = float(np.median(void_t) / np.median(update_t))
    step_ratio = float(np.median(step_t) / np.median(update_t))
    print(f"update: {batch / np.median(update_t) / 1e6:.2f} M IDs/s; numpy W[rows] = G "
          f"{batch / np.median(scatter_t) / 1e6:.2f} M IDs/s -> ratio {update_ratio:.2f}; as 64-byte items "
          f"{batch / np.median(void_t) / 1e6:.2f} M IDs/s -> ratio {void_ratio:.2f}; numpy Adagrad on known rows "
          f"{batch / np.median(step_t) / 1e6:.2f} M IDs/s -> ratio {step_ratio:.2f}", flush=True)
    del weights, state, wv

    own_dir = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="ps-bench-")) if own_dir else Path(args.dir)
    try:
        dump_s = timed(lambda: store.dump(directory, 0, args.workers, replica_size=1))
        file_bytes = sum(p.stat().st_size for p in directory.rglob("*.emb"))
        drop_from_page_cache(directory)
        probe = ids[rng.integers(0, rows_n, 10_000)]
        expected = store.lookup(probe, dim, False)
        del store
        fresh = EmbeddingStore(capacity, args.shards, use_kernel=use_kernel)
        fresh.register_optimizer(cfg)
        load_s = timed(lambda: fresh.load(directory, 0, 1, args.workers))
        if len(fresh) != rows_n or not np.array_equal(fresh.lookup(probe, dim, False), expected):
            raise SystemExit("the loaded table differs from the dumped one")
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    dump_gbps = file_bytes / dump_s / 1e9
    load_gbps = file_bytes / load_s / 1e9
    print(f"checkpoint: {file_bytes / 1e9:.2f} GB; dump {dump_s:.2f} s = {dump_gbps:.2f} GB/s; "
          f"load {load_s:.2f} s = {load_gbps:.2f} GB/s", flush=True)

    result = {
        "lookup_ratio": round(lookup_ratio, 3),
        "update_ratio": round(update_ratio, 3),
        "memory_ratio": round(memory_ratio, 3),
        "dump_gbps": round(dump_gbps, 3),
        "load_gbps": round(load_gbps, 3),
        "max_rows_24gib": max_rows,
        "details": {
            "rows": rows_n, "dim": dim, "optimizer": "Adagrad", "internal_shards": args.shards,
            "batch": batch, "zipf_a": args.zipf, "small": bool(args.small), "pinned": pinned, "malloc": malloc,
            "engine_path": path,
            "lookup_ids_per_s": batch / float(np.median(lookup_t)),
            "inference_lookup_ids_per_s": batch / float(np.median(infer_t)),
            "inference_lookup_ratio": round(infer_ratio, 3),
            "timing": "CPU time of the benchmark thread (time.thread_time) for lookups and updates",
            "lookup_ratio_wall_clock": round(lookup_ratio_wall, 3),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "numpy_gather_ids_per_s": batch / float(np.median(gather_t)),
            "update_ids_per_s": batch / float(np.median(update_t)),
            "numpy_scatter_ids_per_s": batch / float(np.median(scatter_t)),
            "numpy_void_scatter_ids_per_s": batch / float(np.median(void_t)),
            "numpy_adagrad_ids_per_s": batch / float(np.median(step_t)),
            "update_ratio_vs_void_scatter": round(void_ratio, 3),
            "update_ratio_vs_numpy_adagrad": round(step_ratio, 3),
            "fill_inserts_per_s": rows_n / fill_s,
            "resident_bytes_per_row": round(bytes_per_row, 1),
            "array_bytes_per_row": round(array_bytes / rows_n, 1),
            "raw_bytes_per_row": raw_per_row,
            "fill_peak_bytes_per_row": round(peak_per_row, 1),
            "checkpoint_bytes": file_bytes, "dump_s": round(dump_s, 3), "load_s": round(load_s, 3),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        },
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[{path}] lookup_ratio {lookup_ratio:.2f}  update_ratio {update_ratio:.2f}  memory_ratio {memory_ratio:.3f}  "
          f"dump {dump_gbps:.2f} GB/s  load {load_gbps:.2f} GB/s  max_rows_24gib {max_rows:,}  -> {out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
