"""PERSIA's public ``persia.ctx``: re-exports the contexts from their role packages.

The data loader's ``DataCtx`` lives in ``persia.data_loader``; the NN worker's contexts
(``TrainCtx``, ``eval_ctx``, ``InferCtx``) in ``persia.nn_worker``; ``BaseCtx`` and ``cnt_ctx`` in
``persia.context``.
"""

from persia.context import BaseCtx, _role_name, cnt_ctx, ctx_stack  # noqa: F401 (private names kept)
from persia.data_loader.ctx import DataCtx
from persia.data_loader.wire import _named_arrays, id_features_to_wire  # noqa: F401
from persia.nn_worker.checkpoint import CHECKPOINT_FORMAT, EMBEDDING_DUMP_DONE
from persia.nn_worker.embedding_ctx import (
    EmbeddingCtx,
    PreprocessMode,
    configure_embedding_parameter_servers,
    eval_ctx,
    register_optimizer_on_all_ps,
)
from persia.nn_worker.infer_ctx import InferCtx
from persia.nn_worker.train_ctx import TrainCtx

__all__ = [
    "BaseCtx",
    "CHECKPOINT_FORMAT",
    "DataCtx",
    "EMBEDDING_DUMP_DONE",
    "EmbeddingCtx",
    "InferCtx",
    "PreprocessMode",
    "TrainCtx",
    "cnt_ctx",
    "configure_embedding_parameter_servers",
    "eval_ctx",
    "id_features_to_wire",
    "register_optimizer_on_all_ps",
]
