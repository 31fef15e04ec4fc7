"""Embedding optimizers, PERSIA's signatures. Every parameter reaches the PS and is honoured
(PERSIA dropped SGD momentum and Adam/Adagrad weight decay on the floor)."""

from __future__ import annotations

import numbers
from typing import Any, Tuple

import numpy as np

from persia.embedding_ps.optimizers import AdagradConfig, AdamConfig, OptimizerConfig, SGDConfig, optimizer_to_wire
from persia.errors import PersiaValidationError


def _is_number(value: Any) -> bool:
    """A real number (numpy's too), not a bool (``lr=True`` is not 1.0) and not text."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _checked(owner: str, config_cls: type, name: str, value: Any) -> Any:
    """``value`` for hyperparameter ``name`` of ``config_cls``, its type checked (the config checks
    the range); a PersiaValidationError names the optimizer, the hyperparameter and the value."""
    kind = config_cls.model_fields[name].annotation
    if name == "betas":
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or isinstance(value, dict):
            raise PersiaValidationError(
                f"{owner}: betas must be a pair of numbers (beta1, beta2), got {type(value).__name__} {value!r:.80}")
        pair = tuple(value)
        if len(pair) != 2:
            raise PersiaValidationError(f"{owner}: betas must be a pair of numbers (beta1, beta2), got {len(pair)} "
                                        f"values {value!r:.80}")
        for i, beta in enumerate(pair):
            if not _is_number(beta):
                raise PersiaValidationError(
                    f"{owner}: betas[{i}] must be a number, got {type(beta).__name__} {beta!r:.80}")
        return tuple(float(b) for b in pair)
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise PersiaValidationError(f"{owner}: {name} must be a bool, got {type(value).__name__} {value!r:.80}")
        return bool(value)
    if kind is float and not _is_number(value):
        raise PersiaValidationError(f"{owner}: {name} must be a number, got {type(value).__name__} {value!r:.80}")
    return value


class Optimizer:
    """Its hyperparameters read and write as attributes, as in PERSIA (``SGD(lr=0.1).lr``);
    setting one re-validates it and takes effect at the next ``apply()`` / ``TrainCtx`` entry.
    Any other public attribute is refused (``sgd.learning_rate = ...`` would be ignored)."""

    config: OptimizerConfig

    def _configure(self, config_cls: type, **values: Any) -> None:
        owner = type(self).__name__
        checked = {name: _checked(owner, config_cls, name, value) for name, value in values.items()}
        object.__setattr__(self, "config", config_cls(**checked))

    def __getattr__(self, name: str):
        config = self.__dict__.get("config")
        if config is not None and name in type(config).model_fields:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        config = self.__dict__.get("config")
        if config is None or name == "config" or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        fields = type(config).model_fields
        if name not in fields:
            raise AttributeError(
                f"{type(self).__name__} has no hyperparameter {name!r}; its hyperparameters are "
                f"{', '.join(fields)}")
        value = _checked(type(self).__name__, type(config), name, value)
        object.__setattr__(self, "config", type(config)(**{**config.model_dump(), name: value}))

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
        self._configure(SGDConfig, lr=lr, momentum=momentum, weight_decay=weight_decay)


class Adam(Optimizer):
    def __init__(
        self,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
    ):
        self._configure(AdamConfig, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


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
        self._configure(
            AdagradConfig,
            lr=lr,
            initial_accumulator_value=initial_accumulator_value,
            weight_decay=weight_decay,
            g_square_momentum=g_square_momentum,
            eps=eps,
            vectorwise_shared=vectorwise_shared,
        )
