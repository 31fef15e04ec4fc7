"""Settings of the PERSIA example scripts, read from the environment (the launcher passes its
environment to every role). One model serves both sides: the scripts read it with ``from_env`` and
the benchmark runner writes it with ``to_env``, so names cannot drift apart."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


# the dense optimizers the scripts know (synthetic_ctr.training builds them); here, not there, so
# that the data loader, which reads these settings, does not import torch (1.8 s of start-up)
DenseOptimizer = Literal["adam", "sgd"]

# field -> environment variable (EMBEDDING_STALENESS and REPRODUCIBLE are PERSIA's example names)
ENV_NAMES: dict[str, str] = {
    "data_dir": "SYNTHETIC_CTR_DATA",
    "mlp": "SYNTHETIC_CTR_MLP",
    "batch_size": "SYNTHETIC_CTR_BATCH_SIZE",
    "train_rows": "SYNTHETIC_CTR_TRAIN_ROWS",
    "test_rows": "SYNTHETIC_CTR_TEST_ROWS",
    "eval_points": "SYNTHETIC_CTR_EVAL_POINTS",
    "curve_eval_rows": "SYNTHETIC_CTR_CURVE_EVAL_ROWS",
    "seed": "SYNTHETIC_CTR_SEED",
    "dense_optimizer": "SYNTHETIC_CTR_DENSE_OPTIMIZER",
    "dense_lr": "SYNTHETIC_CTR_DENSE_LR",
    "embedding_lr": "SYNTHETIC_CTR_EMBEDDING_LR",
    "staleness": "EMBEDDING_STALENESS",
    "reproducible": "REPRODUCIBLE",
    "device": "SYNTHETIC_CTR_DEVICE",
    "mixed_precision": "SYNTHETIC_CTR_MIXED_PRECISION",
}


class ExampleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: str
    mlp: str = "mlp400"
    batch_size: int = Field(default=1024, ge=1, le=65535)
    train_rows: int | None = Field(default=None, ge=1)
    test_rows: int | None = Field(default=None, ge=1)
    eval_points: int = Field(default=4, ge=1)
    curve_eval_rows: int = Field(default=20000, ge=1)
    seed: int = Field(default=0, ge=0)
    dense_optimizer: DenseOptimizer = "adam"
    dense_lr: float | None = Field(default=None, gt=0)
    embedding_lr: float = Field(default=1e-2, gt=0)
    staleness: int = Field(default=10, ge=1)
    reproducible: bool = False
    # where the NN worker trains the dense model ("cuda": its local rank's GPU); the embeddings
    # stay on the PS either way
    device: Literal["cpu", "cuda"] = "cpu"
    mixed_precision: bool = False  # float16 autocast + GradScaler; CUDA only

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExampleSettings:
        env = os.environ if env is None else env
        raw = {field: env[name] for field, name in ENV_NAMES.items() if env.get(name, "") != ""}
        if "data_dir" not in raw:
            raise ValueError(f"{ENV_NAMES['data_dir']} must name the generated dataset directory")
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "?"
            name = ENV_NAMES.get(field, field)
            raise ValueError(f"bad {name}={raw.get(field)!r}: {err['msg']}") from None

    def to_env(self) -> dict[str, str]:
        out = {}
        for field, name in ENV_NAMES.items():
            value = getattr(self, field)
            if value is None:
                continue
            out[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out
