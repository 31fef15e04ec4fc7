"""PERSIA's public ``persia.embedding.optim``: re-exports the embedding optimizers
(``persia.nn_worker.optim``)."""

from persia.nn_worker.optim import SGD, Adagrad, Adam, Optimizer

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer"]
