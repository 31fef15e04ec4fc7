"""PERSIA's public ``persia.ctx``: re-exports the contexts from their role packages.

The data loader's ``DataCtx`` lives in ``persia.data_loader``; the NN worker's contexts
(``TrainCtx``, ``eval_ctx``, ``InferCtx``) in ``persia.nn_worker``; ``BaseCtx`` and ``cnt_ctx`` in
``persia.context``. The NN worker's names are imported when first used, so that a data loader
(``from persia.ctx import DataCtx``) does not load torch.
"""

import sys

from persia.context import BaseCtx, _role_name, cnt_ctx, ctx_stack  # noqa: F401 (private names kept)
from persia.data_loader.ctx import DataCtx
from persia.data_loader.wire import _named_arrays, id_features_to_wire  # noqa: F401

_NN_WORKER = {  # name -> the persia.nn_worker module it lives in
    "CHECKPOINT_FORMAT": "checkpoint",
    "EMBEDDING_DUMP_DONE": "checkpoint",
    "EmbeddingCtx": "embedding_ctx",
    "PreprocessMode": "embedding_ctx",
    "configure_embedding_parameter_servers": "embedding_ctx",
    "eval_ctx": "embedding_ctx",
    "register_optimizer_on_all_ps": "embedding_ctx",
    "InferCtx": "infer_ctx",
    "TrainCtx": "train_ctx",
}


def __getattr__(name: str):
    if name not in _NN_WORKER:
        raise AttributeError(f"module 'persia.ctx' has no attribute {name!r}")
    from persia.nn_worker import checkpoint, embedding_ctx, infer_ctx, train_ctx  # noqa: F401 (torch, on first use)

    value = globals()[name] = getattr(sys.modules[f"persia.nn_worker.{_NN_WORKER[name]}"], name)  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NN_WORKER))


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
