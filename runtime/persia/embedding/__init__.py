"""PERSIA's public ``persia.embedding``: re-exports the embedding hyperparameters, which the NN
worker pushes to every PS (``persia.nn_worker.embedding_config``)."""

from persia.nn_worker.embedding_config import EmbeddingConfig, get_default_embedding_config

__all__ = ["EmbeddingConfig", "get_default_embedding_config"]
