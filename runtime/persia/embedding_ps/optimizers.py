"""Sparse (row-wise) embedding optimizers with torch's semantics and every parameter honoured.

PERSIA silently dropped SGD ``momentum`` and Adam/Adagrad ``weight_decay``; here each config field
reaches the update. A row is only touched in a step where it received a gradient ("lazy" sparse
optimizers): its state, including Adam's per-row step count, advances only then. The math of one
step on a batch of rows is a pure function (:func:`apply_step`) so it is tested against
``torch.optim`` without a store around it.

State layout per row (float32, ``state_width`` columns, stored beside the row and in checkpoints):

========================  ===========================================================
SGD, momentum == 0        nothing
SGD, momentum > 0         momentum buffer (dim)
Adagrad                   sum of squares (dim), or 1 column if ``vectorwise_shared``
Adam                      exp_avg (dim) | exp_avg_sq (dim) | step count (1)
========================  ===========================================================
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "SGDConfig",
    "AdagradConfig",
    "AdamConfig",
    "OptimizerConfig",
    "optimizer_to_wire",
    "optimizer_from_wire",
    "state_width",
    "initial_state_value",
    "optimizer_code",
    "OPTIMIZER_CODES",
    "apply_step",
]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SGDConfig(_Config):
    """torch.optim.SGD with dampening 0 and nesterov False."""

    lr: float = Field(gt=0, allow_inf_nan=False)
    momentum: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class AdagradConfig(_Config):
    """torch.optim.Adagrad (lr_decay 0) plus PERSIA's ``g_square_momentum`` and ``vectorwise_shared``.

    ``s = g_square_momentum * s + g*g`` (torch is ``g_square_momentum == 1``); with
    ``vectorwise_shared`` a row keeps one scalar ``s`` updated with ``mean(g*g)``.
    """

    lr: float = Field(default=1e-2, gt=0, allow_inf_nan=False)
    initial_accumulator_value: float = Field(default=1e-2, ge=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    g_square_momentum: float = Field(default=1.0, ge=0, le=1, allow_inf_nan=False)
    eps: float = Field(default=1e-10, gt=0, allow_inf_nan=False)
    vectorwise_shared: bool = False


class AdamConfig(_Config):
    """torch.optim.Adam (L2 weight decay added to the gradient, not AdamW) with per-row step counts."""

    lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    eps: float = Field(default=1e-8, gt=0, allow_inf_nan=False)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        return betas


OptimizerConfig = Union[SGDConfig, AdagradConfig, AdamConfig]

_WIRE_TYPES: dict[str, type[_Config]] = {"SGD": SGDConfig, "Adagrad": AdagradConfig, "Adam": AdamConfig}
# Stable codes written into checkpoint headers (never renumber).
OPTIMIZER_CODES: dict[str, int] = {"none": 0, "SGD": 1, "Adagrad": 2, "Adam": 3}


def _type_name(cfg: Any) -> str:
    for name, cls in _WIRE_TYPES.items():
        if isinstance(cfg, cls):
            return name
    raise TypeError(f"not an optimizer config: {type(cfg).__name__}")


def optimizer_code(cfg: OptimizerConfig | None) -> int:
    """The checkpoint-header code of an optimizer type (0 when none is registered)."""
    return OPTIMIZER_CODES["none" if cfg is None else _type_name(cfg)]


def optimizer_to_wire(cfg: OptimizerConfig) -> dict:
    """A plain msgpack-able dict with a ``type`` key (``SGD``/``Adagrad``/``Adam``)."""
    d = cfg.model_dump()
    if "betas" in d:
        d["betas"] = [float(b) for b in d["betas"]]
    return {"type": _type_name(cfg), **d}


def optimizer_from_wire(d: dict) -> OptimizerConfig:
    """Rebuild (and re-validate) an optimizer config; bad input raises ``ValueError`` naming it."""
    if not isinstance(d, dict):
        raise ValueError(f"optimizer config must be a dict with a 'type' key, got {type(d).__name__}")
    if "type" not in d:
        raise ValueError(f"optimizer config has no 'type' key (one of {sorted(_WIRE_TYPES)}), got keys {sorted(d)}")
    kind = d["type"]
    if kind not in _WIRE_TYPES:
        raise ValueError(f"optimizer config field 'type': unknown optimizer {kind!r}, expected one of {sorted(_WIRE_TYPES)}")
    fields = {k: v for k, v in d.items() if k != "type"}
    if "betas" in fields and isinstance(fields["betas"], list):
        fields["betas"] = tuple(fields["betas"])
    return _WIRE_TYPES[kind](**fields)  # pydantic's ValidationError is a ValueError naming field and value


def state_width(cfg: OptimizerConfig | None, dim: int) -> int:
    """Floats of optimizer state per row."""
    if cfg is None:
        return 0
    if isinstance(cfg, SGDConfig):
        return dim if cfg.momentum > 0 else 0
    if isinstance(cfg, AdagradConfig):
        return 1 if cfg.vectorwise_shared else dim
    if isinstance(cfg, AdamConfig):
        return 2 * dim + 1
    raise TypeError(f"not an optimizer config: {type(cfg).__name__}")


def initial_state_value(cfg: OptimizerConfig | None) -> float:
    """The value every state element of a new row starts from."""
    if isinstance(cfg, AdagradConfig):
        return float(cfg.initial_accumulator_value)
    return 0.0


def apply_step(
    cfg: OptimizerConfig,
    weights: np.ndarray,
    state: np.ndarray,
    grads: np.ndarray,
    weight_bound: float = 0.0,
) -> None:
    """One optimizer step on a batch of distinct rows, in place.

    ``weights`` (n, dim) and ``state`` (n, state_width) may be strided views of a gathered block;
    ``grads`` (n, dim) float32 is not modified. ``weight_bound > 0`` clips the new weights to
    ``[-weight_bound, weight_bound]`` afterwards (PERSIA's convention).
    """
    g = grads
    if cfg.weight_decay:
        g = grads + np.float32(cfg.weight_decay) * weights  # L2, as torch: grad += wd * param
    if isinstance(cfg, SGDConfig):
        _sgd(cfg, weights, state, g)
    elif isinstance(cfg, AdagradConfig):
        _adagrad(cfg, weights, state, g)
    elif isinstance(cfg, AdamConfig):
        _adam(cfg, weights, state, g)
    else:
        raise TypeError(f"not an optimizer config: {type(cfg).__name__}")
    if weight_bound > 0:
        np.clip(weights, -np.float32(weight_bound), np.float32(weight_bound), out=weights)


def _sgd(cfg: SGDConfig, w: np.ndarray, state: np.ndarray, g: np.ndarray) -> None:
    lr = np.float32(cfg.lr)
    if cfg.momentum > 0:
        buf = state  # torch: buf = g on the first step, which is momentum * 0 + g
        buf *= np.float32(cfg.momentum)
        buf += g
        w -= lr * buf
    else:
        w -= lr * g


def _adagrad(cfg: AdagradConfig, w: np.ndarray, state: np.ndarray, g: np.ndarray) -> None:
    sq = g * g
    if cfg.vectorwise_shared:
        sq = sq.mean(axis=1, keepdims=True, dtype=np.float32)
    if cfg.g_square_momentum != 1.0:
        state *= np.float32(cfg.g_square_momentum)
    state += sq
    denom = np.sqrt(state) if not cfg.vectorwise_shared else np.broadcast_to(np.sqrt(state), g.shape).copy()
    denom += np.float32(cfg.eps)
    np.divide(g, denom, out=denom)
    denom *= np.float32(cfg.lr)
    w -= denom


def _adam(cfg: AdamConfig, w: np.ndarray, state: np.ndarray, g: np.ndarray) -> None:
    dim = w.shape[1]
    beta1, beta2 = cfg.betas
    m = state[:, :dim]
    v = state[:, dim : 2 * dim]
    step = state[:, 2 * dim : 2 * dim + 1]
    step += np.float32(1.0)  # per-row count of steps that had a gradient (lazy Adam)
    m *= np.float32(beta1)
    m += np.float32(1.0 - beta1) * g
    v *= np.float32(beta2)
    v += np.float32(1.0 - beta2) * (g * g)
    t = step.astype(np.float64)
    step_size = (cfg.lr / (1.0 - np.power(beta1, t))).astype(np.float32)  # bias corrections in double, as torch
    bc2_sqrt = np.sqrt(1.0 - np.power(beta2, t)).astype(np.float32)
    denom = np.sqrt(v)
    denom /= bc2_sqrt
    denom += np.float32(cfg.eps)
    np.divide(m, denom, out=denom)
    denom *= step_size
    w -= denom
