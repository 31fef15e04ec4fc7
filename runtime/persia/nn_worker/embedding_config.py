"""Embedding hyperparameters pushed from the NN worker to every PS at context entry.

``EmbeddingConfig`` keeps PERSIA's signature and defaults but validates its fields, so a bad value
fails on the NN worker with the field's name instead of misbehaving inside the PS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Mapping, Optional, Tuple

import numpy as np

__all__ = ["EmbeddingConfig", "get_default_embedding_config"]


def _real(field: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"EmbeddingConfig.{field} must be a real number, got {type(value).__name__} {value!r:.40}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"EmbeddingConfig.{field} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class EmbeddingConfig:
    """How new embedding rows are created and bounded.

    emb_initialization: ``(lower, upper)`` of the uniform initial value (``lower <= upper``; equal
        bounds give a constant initial value).
    admit_probability: chance, in ``(0, 1]``, that an unseen ID gets a row on its first training
        lookup (otherwise it reads as zeros and is not stored).
    weight_bound: after every update each element is clipped to ``[-weight_bound, weight_bound]``;
        ``0`` disables clipping (PERSIA's "``> 0`` enables" convention).
    seed: (not in PERSIA) initial values and admission draws are functions of (ID, seed), so two
        synchronous runs with one seed match whatever the PS count; ``None``: the last
        ``persia.utils.setup_seed``, else 0.
    """

    emb_initialization: Tuple[float, float] = (-0.01, 0.01)
    admit_probability: float = 1.0
    weight_bound: float = 10
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        bounds = self.emb_initialization
        if isinstance(bounds, (str, bytes)) or not hasattr(bounds, "__len__") or len(bounds) != 2:
            raise TypeError(
                f"EmbeddingConfig.emb_initialization must be a (lower, upper) pair, got {bounds!r:.60}"
            )
        lower = _real("emb_initialization[0]", bounds[0])
        upper = _real("emb_initialization[1]", bounds[1])
        if lower > upper:
            raise ValueError(
                f"EmbeddingConfig.emb_initialization bounds are out of order: lower {lower} > upper {upper}"
            )
        admit = _real("admit_probability", self.admit_probability)
        if not 0.0 < admit <= 1.0:
            raise ValueError(f"EmbeddingConfig.admit_probability must be in (0, 1], got {admit}")
        bound = _real("weight_bound", self.weight_bound)
        if bound < 0:
            raise ValueError(f"EmbeddingConfig.weight_bound must be >= 0 (0 disables clipping), got {bound}")
        object.__setattr__(self, "emb_initialization", (lower, upper))
        object.__setattr__(self, "admit_probability", admit)
        object.__setattr__(self, "weight_bound", bound)
        if self.seed is not None:
            if isinstance(self.seed, (bool, np.bool_)) or not isinstance(self.seed, (int, np.integer)):
                raise TypeError(f"EmbeddingConfig.seed must be an integer or None, got {type(self.seed).__name__} {self.seed!r:.40}")
            if not 0 <= int(self.seed) < 1 << 63:
                raise ValueError(f"EmbeddingConfig.seed must be in [0, 2**63), got {self.seed}")
            object.__setattr__(self, "seed", int(self.seed))

    def to_dict(self) -> dict:
        """Plain values for the wire (the PS rebuilds it with :meth:`from_dict`, re-validating)."""
        return {
            "emb_initialization": list(self.emb_initialization),
            "admit_probability": self.admit_probability,
            "weight_bound": self.weight_bound,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EmbeddingConfig":
        unknown = set(d) - {"emb_initialization", "admit_probability", "weight_bound", "seed"}
        if unknown:
            raise ValueError(f"EmbeddingConfig: unknown field(s) {sorted(unknown)}")
        kwargs = dict(d)
        if "emb_initialization" in kwargs and isinstance(kwargs["emb_initialization"], list):
            kwargs["emb_initialization"] = tuple(kwargs["emb_initialization"])
        return cls(**kwargs)


def get_default_embedding_config() -> EmbeddingConfig:
    """PERSIA's defaults: uniform(-0.01, 0.01), admit every ID, clip to +-10."""
    return EmbeddingConfig()
