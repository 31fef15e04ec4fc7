"""The single-process training loop shared by the baselines: one epoch held in memory as the
trainer's tensors, AUC at a few points, training time measured without evaluation, start-up and
data preparation, one result dict (the PERSIA_RESULT keys)."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from bench import _paths  # noqa: F401  (puts synthetic_ctr on sys.path)
from bench.spec import RunSpec
from persia.nn_worker.denormals import FlushDenormals
from synthetic_ctr.manifest import load_manifest
from synthetic_ctr.reader import Batch, read_chunks
from synthetic_ctr.training import auc_and_logloss, eval_schedule, peak_rss_mb, set_threads


class Trainer(Protocol):
    def prepare(self, batch: Batch) -> Any:
        """The batch as the step takes it (tensors, rows of the table): done for the whole epoch
        before the clock starts, as a torch user holding the data in memory would."""

    def train_step(self, inputs: Any) -> float: ...

    def predict(self, batch: Batch) -> np.ndarray: ...


def load_split(data_dir: str, split: str, rows: int | None = None, batch_size: int = 8192) -> list[Batch]:
    return list(read_chunks(data_dir, batch_size, split, max_rows=rows))


def evaluate(trainer: Trainer, batches: list[Batch]) -> tuple[float, float]:
    probs = np.concatenate([trainer.predict(b).reshape(-1) for b in batches])
    labels = np.concatenate([b.label.reshape(-1) for b in batches])
    return auc_and_logloss(labels, probs)


def run_training(spec: RunSpec, build: Callable[[RunSpec], Trainer], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    # the numerics our NN worker trains with: denormals flushed to zero on every torch thread (Adam
    # on denormals runs many times slower), for this call only (tests run it in their process)
    with FlushDenormals({}) as denormals:
        return _run_training(spec, build, extra) | {"flush_denormal": denormals.why}


def _run_training(spec: RunSpec, build: Callable[[RunSpec], Trainer], extra: dict[str, Any] | None) -> dict[str, Any]:
    wall_start = time.perf_counter()
    threads = set_threads(spec.threads)
    torch.manual_seed(spec.seed)
    np.random.seed(spec.seed)
    manifest = load_manifest(spec.data_dir)
    total = manifest.split("train").rows
    train_rows = min(spec.train_rows or total, total)
    n_batches = math.ceil(train_rows / spec.batch_size)
    marks = set(eval_schedule(n_batches, spec.eval_points))

    trainer = build(spec)
    train = [(b.dense.shape[0], trainer.prepare(b)) for b in read_chunks(spec.data_dir, spec.batch_size, "train", max_rows=train_rows)]
    test = load_split(spec.data_dir, "test", rows=spec.test_rows)
    curve_set = load_split(spec.data_dir, "test", rows=spec.curve_eval_rows)
    setup_s = time.perf_counter() - wall_start

    curve: list[dict[str, float]] = []
    train_s = eval_s = train_cpu_s = 0.0
    samples = 0
    losses: list[float] = []
    started, cpu_started = time.perf_counter(), time.process_time()
    for i, (rows, inputs) in enumerate(train):
        losses.append(trainer.train_step(inputs))
        samples += rows
        if (i + 1) in marks:
            now, cpu_now = time.perf_counter(), time.process_time()
            train_s += now - started
            train_cpu_s += cpu_now - cpu_started
            auc, _ = evaluate(trainer, curve_set)
            curve.append({"samples": samples, "auc": auc, "train_seconds": train_s})
            started, cpu_started = time.perf_counter(), time.process_time()
            eval_s += started - now
    eval_start = time.perf_counter()
    auc, logloss = evaluate(trainer, test)
    eval_s += time.perf_counter() - eval_start
    tail = losses[-max(1, len(losses) // 10) :]
    result = {
        "system": spec.system,
        "label": spec.label,
        "mlp": spec.mlp,
        "batch_size": spec.batch_size,
        "seed": spec.seed,
        "threads": threads,
        "train_samples": samples,
        "test_samples": int(sum(b.dense.shape[0] for b in test)),
        "train_seconds": train_s,
        "samples_per_sec": samples / train_s if train_s > 0 else None,
        "train_cpu_seconds": train_cpu_s,  # process CPU time (all threads) of the timed steps
        "auc": auc,
        "test_logloss": logloss,
        "final_train_loss": float(np.mean(tail)) if tail else None,
        "auc_curve": curve,
        "setup_seconds": setup_s,
        "eval_seconds": eval_s,
        "wall_seconds": time.perf_counter() - wall_start,
        "peak_rss_mb": {"trainer": peak_rss_mb()},
        "teacher_auc": manifest.teacher.test_auc,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if extra:
        result.update(extra)
    return result
