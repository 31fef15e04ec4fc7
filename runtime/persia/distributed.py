"""PERSIA's public ``persia.distributed``: re-exports the NN worker's DDP options."""

from persia.nn_worker.distributed import (
    DEFAULT_MASTER_PORT,
    BaguaDistributedOption,
    DDPOption,
    DistributedBaseOption,
    get_default_distributed_option,
)

__all__ = ["DEFAULT_MASTER_PORT", "BaguaDistributedOption", "DDPOption", "DistributedBaseOption", "get_default_distributed_option"]
