"""The Criteo schema: 13 dense ("I1".."I13") and 26 categorical ("C1".."C26") slots.

Cardinalities are the per-slot distinct-value counts of the Criteo Kaggle (Display Advertising
Challenge) set as used by DLRM, so the mix of tiny and huge slots is realistic; ``scaled_cardinalities``
shrinks the big ones so that small runs stay small while the small slots keep their real size.
"""

from __future__ import annotations

import math

NUM_DENSE = 13
NUM_SLOTS = 26
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SLOT_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SLOTS + 1))

CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


def scaled_cardinalities(scale: float, floor: int = 1000) -> tuple[int, ...]:
    """Criteo's cardinalities times ``scale``; slots already at or below ``floor`` stay as they are
    and no scaled slot goes below ``floor``, so the tiny slots (3, 4, 10 values) keep their nature."""
    if not (0.0 < scale <= 1.0):
        raise ValueError(f"scale must be in (0, 1], got scale={scale!r}")
    if floor < 1:
        raise ValueError(f"floor must be >= 1, got floor={floor!r}")
    out = []
    for card in CRITEO_KAGGLE_CARDINALITIES:
        if card <= floor:
            out.append(card)
        else:
            out.append(max(floor, int(math.ceil(card * scale))))
    return tuple(out)
