"""PERSIA's public ``persia.data``: re-exports the NN worker's datasets and DataLoader from
``persia.nn_worker`` (the lookup pipeline with bounded staleness lives in ``nn_worker/loader.py``)."""

from persia.nn_worker.datasets import IterableDataset, IterableDatasetBase, StreamingDataset
from persia.nn_worker.loader import _END, DataLoader, _LoaderIterator  # noqa: F401 (private names kept)
from persia.nn_worker.lookahead import Lookahead
from persia.nn_worker.reorder import BatchReorderer, _reordered  # noqa: F401
from persia.nn_worker.training_batch import PersiaTrainingBatch

__all__ = [
    "BatchReorderer",
    "DataLoader",
    "IterableDataset",
    "IterableDatasetBase",
    "Lookahead",
    "PersiaTrainingBatch",
    "StreamingDataset",
]
