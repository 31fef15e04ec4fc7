"""Synthetic Criteo-schema CTR data: generator, reader, shared model and result-line format.

Importable both by the PERSIA example scripts beside it and by bench/ (which puts
``examples/synthetic-ctr`` on ``sys.path``).
"""

from synthetic_ctr.schema import DENSE_NAMES, NUM_DENSE, NUM_SLOTS, SLOT_NAMES

__all__ = ["DENSE_NAMES", "NUM_DENSE", "NUM_SLOTS", "SLOT_NAMES"]
