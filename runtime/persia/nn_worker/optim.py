"""Embedding optimizers, PERSIA's signatures. Every parameter reaches the PS and is honoured
(PERSIA dropped SGD momentum and Adam/Adagrad weight decay on the floor)."""

from __future__ import annotations

from typing import Tuple

from persia.embedding_ps.optimizers import AdagradConfig, AdamConfig, OptimizerConfig, SGDConfig, optimizer_to_wire


class Optimizer:
    """Its hyperparameters read and write as attributes, as in PERSIA (``SGD(lr=0.1).lr``);
    setting one re-validates it and takes effect at the next ``apply()`` / ``TrainCtx`` entry."""

    config: OptimizerConfig

    def __getattr__(self, name: str):
        config = self.__dict__.get("config")
        if config is not None and name in type(config).model_fields:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        config = self.__dict__.get("config")
        if config is not None and name in type(config).model_fields:
            value = tuple(value) if name == "betas" else value
            object.__setattr__(self, "config", type(config)(**{**config.model_dump(), name: value}))
        else:
            object.__setattr__(self, name, value)

    def to_wire(self) -> dict:
        return optimizer_to_wire(self.config)

    def apply(self) -> None:
        """Register this optimizer on every PS replica (TrainCtx does this when entered)."""
        from persia.nn_worker.embedding_ctx import register_optimizer_on_all_ps

        register_optimizer_on_all_ps(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


class SGD(Optimizer):
    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.config = SGDConfig(lr=lr, momentum=momentum, weight_decay=weight_decay)


class Adam(Optimizer):
    def __init__(
        self,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ):
        self.config = AdamConfig(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps)


class Adagrad(Optimizer):
    def __init__(
        self,
        lr: float = 1e-2,
        initial_accumulator_value: float = 1e-2,
        weight_decay: float = 0.0,
        g_square_momentum: float = 1.0,
        eps: float = 1e-10,
        vectorwise_shared: bool = False,
    ):
        self.config = AdagradConfig(
            lr=lr,
            initial_accumulator_value=initial_accumulator_value,
            weight_decay=weight_decay,
            g_square_momentum=g_square_momentum,
            eps=eps,
            vectorwise_shared=vectorwise_shared,
        )
