"""PERSIA NN worker: one epoch of the synthetic CTR model, test AUC at a few points and at the end.

Prints ``PERSIA_RESULT {json}`` (rank 0) for the benchmark runner. Staleness comes from
``EMBEDDING_STALENESS`` (1 = the synchronous reference), batch ordering from ``REPRODUCIBLE``, the
dense model's device from ``SYNTHETIC_CTR_DEVICE`` (``cuda``: the local rank's GPU) and
``SYNTHETIC_CTR_MIXED_PRECISION``.
"""

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from persia.ctx import TrainCtx, eval_ctx
from persia.data import DataLoader, IterableDataset, StreamingDataset
from persia.embedding.optim import Adagrad
from persia.env import get_local_rank, get_rank, get_world_size

from batches import to_persia_batch
from synthetic_ctr.manifest import load_manifest
from synthetic_ctr.model import CTRTower, parse_hidden
from synthetic_ctr.reader import read_chunks
from synthetic_ctr.results import format_result_line
from synthetic_ctr.settings import ExampleSettings
from synthetic_ctr.training import auc_and_logloss, eval_schedule, gpu_memory_mb, make_dense_optimizer, peak_rss_mb

EVAL_BATCH_SIZE = 8192


class TestDataset(IterableDataset):
    def __init__(self, settings: ExampleSettings, rows: int | None):
        super().__init__(buffer_size=10)
        self.settings, self.rows = settings, rows

    def __iter__(self):
        for batch in read_chunks(self.settings.data_dir, EVAL_BATCH_SIZE, "test", max_rows=self.rows):
            yield to_persia_batch(batch, requires_grad=False)


def evaluate(model, settings: ExampleSettings, rows: int | None) -> tuple[float, float]:
    probs, labels = [], []
    with eval_ctx(model=model) as ctx:
        for batch in DataLoader(TestDataset(settings, rows)):
            output, batch_labels = ctx.forward(batch)
            probs.append(output.detach().cpu().numpy().reshape(-1))
            labels.append(batch_labels[0].cpu().numpy().reshape(-1))
    return auc_and_logloss(np.concatenate(labels), np.concatenate(probs))


def device_id_of(settings: ExampleSettings) -> int | None:
    """The local rank's GPU (ranks share the GPUs round-robin), or None for the CPU."""
    if settings.device == "cpu":
        return None
    if not torch.cuda.is_available():
        raise SystemExit("SYNTHETIC_CTR_DEVICE=cuda but torch sees no CUDA device")
    return (get_local_rank() or 0) % torch.cuda.device_count()


def main() -> None:
    settings = ExampleSettings.from_env()
    torch.manual_seed(settings.seed)
    rank, world_size = get_rank(), get_world_size()
    train_rows = min(settings.train_rows or math.inf, load_manifest(settings.data_dir).split("train").rows)
    marks = set(eval_schedule(math.ceil(train_rows / settings.batch_size / world_size), settings.eval_points))

    device_id = device_id_of(settings)
    model = CTRTower(parse_hidden(settings.mlp))
    # torch's fused kernel: the same formula in one pass over all parameters (what the fastest
    # torch baseline uses; the single-tensor default reads every Adam state tensor ~10 times)
    dense_optimizer = make_dense_optimizer(model.parameters(), settings.dense_optimizer, settings.dense_lr,
                                           fused=True)
    embedding_optimizer = Adagrad(lr=settings.embedding_lr)
    curve, samples, first_batch, train_s, started = [], 0, 0, 0.0, None
    window = [None, None]  # unix times of the first batch and the last step's end (bench/path_cpu.py)
    with TrainCtx(
        model=model,
        embedding_optimizer=embedding_optimizer,
        dense_optimizer=dense_optimizer,
        device_id=device_id,
        mixed_precision=settings.mixed_precision,
    ) as ctx:
        loader = DataLoader(
            StreamingDataset(buffer_size=10),
            reproducible=settings.reproducible,
            embedding_staleness=settings.staleness,
        )
        for i, batch in enumerate(loader):
            if started is None:  # the clock starts when data flows, not at process start-up
                started, window[0] = time.perf_counter(), time.time()
            output, labels = ctx.forward(batch)
            ctx.backward(F.binary_cross_entropy(output, labels[0]))
            window[1] = time.time()
            bs = labels[0].shape[0]
            samples += bs
            first_batch = first_batch or bs
            if (i + 1) in marks:
                train_s += time.perf_counter() - started
                auc, _ = evaluate(model, settings, settings.curve_eval_rows)
                curve.append({"samples": samples * world_size, "auc": auc, "train_seconds": train_s})
                started = time.perf_counter()
        if started is not None:  # time since the last evaluation (or since the first batch)
            train_s += time.perf_counter() - started
        auc, logloss = evaluate(model, settings, settings.test_rows)

    if rank == 0:
        timed = samples - first_batch  # the first batch only started the clock
        print(
            format_result_line(
                {
                    "auc": auc,
                    "test_logloss": logloss,
                    "train_samples": samples * world_size,
                    "train_seconds": train_s,
                    "samples_per_sec": timed * world_size / train_s if train_s > 0 else None,
                    "auc_curve": curve,
                    "train_window_unix": window if window[0] is not None else None,
                    "staleness": settings.staleness,
                    "world_size": world_size,
                    "threads": torch.get_num_threads(),
                    "device": settings.device,
                    "mixed_precision": settings.mixed_precision,
                    "gpu_memory_mb": gpu_memory_mb(ctx.device),
                    "peak_rss_mb": {"nn-worker": peak_rss_mb()},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
