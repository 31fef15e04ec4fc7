"""persia.embedding.EmbeddingConfig: PERSIA's defaults, validated fields, wire form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from persia.embedding import EmbeddingConfig, get_default_embedding_config


def test_defaults_match_persia():
    config = get_default_embedding_config()
    assert config == EmbeddingConfig()
    assert config.emb_initialization == (-0.01, 0.01)
    assert config.admit_probability == 1.0
    assert config.weight_bound == 10.0


def test_positional_signature_and_normalisation():
    config = EmbeddingConfig([np.float32(-0.5), 1], np.float64(0.25), 0)
    assert config.emb_initialization == (-0.5, 1.0) and isinstance(config.emb_initialization, tuple)
    assert config.admit_probability == 0.25 and config.weight_bound == 0.0
    assert EmbeddingConfig((0.0, 0.0)).emb_initialization == (0.0, 0.0)  # constant init allowed


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"emb_initialization": (0.1, -0.1)}, ValueError, r"bounds are out of order: lower 0.1 > upper -0.1"),
        ({"emb_initialization": (0.1,)}, TypeError, r"emb_initialization must be a \(lower, upper\) pair"),
        ({"emb_initialization": "ab"}, TypeError, r"emb_initialization must be a \(lower, upper\) pair"),
        ({"emb_initialization": (-math.inf, 0.1)}, ValueError, r"emb_initialization\[0\] must be finite, got -inf"),
        ({"emb_initialization": (-0.1, "x")}, TypeError, r"emb_initialization\[1\] must be a real number, got str"),
        ({"admit_probability": 0}, ValueError, r"admit_probability must be in \(0, 1\], got 0.0"),
        ({"admit_probability": 1.5}, ValueError, r"admit_probability must be in \(0, 1\], got 1.5"),
        ({"admit_probability": True}, TypeError, r"admit_probability must be a real number, got bool"),
        ({"weight_bound": -1}, ValueError, r"weight_bound must be >= 0 \(0 disables clipping\), got -1.0"),
        ({"weight_bound": math.nan}, ValueError, r"weight_bound must be finite, got nan"),
    ],
)
def test_bad_fields_name_field_and_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        EmbeddingConfig(**kwargs)


def test_dict_round_trip_and_unknown_fields():
    config = EmbeddingConfig((-0.2, 0.3), 0.5, 2.5)
    assert EmbeddingConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['lr'\]"):
        EmbeddingConfig.from_dict({"lr": 0.1})
    with pytest.raises(ValueError, match="admit_probability"):
        EmbeddingConfig.from_dict({"admit_probability": 2})
