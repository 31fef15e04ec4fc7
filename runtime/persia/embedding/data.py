"""PERSIA's public ``persia.embedding.data``: re-exports the batch types a data loader builds
(``persia.data_loader.batch``)."""

from persia.data_loader.batch import *  # noqa: F401,F403
from persia.data_loader.batch import __all__  # noqa: F401
