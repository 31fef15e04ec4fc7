"""Dense data parallelism for NN workers (torch DDP; gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from persia.errors import UnsupportedError

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 23456


class DistributedBaseOption:
    def __init__(self, master_port: int = DEFAULT_MASTER_PORT, master_addr: str | None = None):
        self.master_port = master_port
        self.master_addr = master_addr

    def convert2distributed_model(self, model, world_size, rank_id, device_id=None, master_addr=None, optimizer=None):
        raise NotImplementedError

    def init_with_env_file(self) -> bool:
        return False


class DDPOption(DistributedBaseOption):
    """``initialization_method`` "tcp" (master address found over NATS) or "file" (``sync_file``)."""

    def __init__(self, initialization_method: str = "tcp", backend: str = "nccl", **options: Any):
        if initialization_method not in ("tcp", "file"):
            raise ValueError(f"DDPOption.initialization_method must be 'tcp' or 'file', got {initialization_method!r}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"DDPOption.backend must be 'nccl' or 'gloo', got {backend!r}")
        if initialization_method == "file" and "sync_file" not in options:
            raise ValueError("DDPOption(initialization_method='file') needs a sync_file option")
        super().__init__(options.pop("master_port", DEFAULT_MASTER_PORT), options.pop("master_addr", None))
        self.initialization_method = initialization_method
        self.backend = backend
        self.options = options

    def init_with_env_file(self) -> bool:
        return self.initialization_method == "file"

    def init_method(self, master_addr: str | None) -> str:
        if self.initialization_method == "file":
            return f"file://{self.options['sync_file']}"
        addr = master_addr or self.master_addr
        if not addr:
            raise ValueError("DDP tcp initialisation needs a master address")
        return f"tcp://{addr}:{self.master_port}"

    def convert2distributed_model(self, model, world_size, rank_id, device_id=None, master_addr=None, optimizer=None):
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("DDPOption(backend='nccl') needs CUDA; use backend='gloo' on CPU")
        if self.initialization_method == "tcp":
            store = self._tcp_store(master_addr, world_size, rank_id)
            torch.distributed.init_process_group(self.backend, store=store, rank=rank_id, world_size=world_size)
        else:
            torch.distributed.init_process_group(
                self.backend, init_method=self.init_method(master_addr), rank=rank_id, world_size=world_size
            )
        ddp_kwargs = {"find_unused_parameters": self.options.get("find_unused_parameters", False)}
        if device_id is not None:
            ddp_kwargs["device_ids"] = [device_id]
            ddp_kwargs["output_device"] = device_id
        model = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        return model, optimizer


    def _tcp_store(self, master_addr: str | None, world_size: int, rank_id: int):
        """The rendezvous store, its server (rank 0) listening on ``PERSIA_BIND_ADDRESS`` only
        (torch's ``tcp://`` init listens on every interface)."""
        import datetime
        import socket

        from persia.security import bind_address

        addr = master_addr or self.master_addr
        if not addr:
            raise ValueError("DDP tcp initialisation needs a master address")
        timeout = datetime.timedelta(minutes=30)  # torch's default for tcp:// init
        if rank_id != 0:
            return torch.distributed.TCPStore(addr, self.master_port, world_size, False, timeout=timeout)
        bind = bind_address()
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.create_server((bind, self.master_port), family=family)
        return torch.distributed.TCPStore(addr, self.master_port, world_size, True, timeout=timeout,
                                          master_listen_fd=self._listener.fileno())


def get_default_distributed_option(device_id: int | None = None) -> DDPOption:
    return DDPOption(backend="nccl" if device_id is not None else "gloo")


class BaguaDistributedOption(DistributedBaseOption):
    """PERSIA's Bagua option. Bagua is not part of this runtime, so constructing one fails with
    the options that are supported rather than training without the algorithm asked for."""

    def __init__(self, algorithm: str, **options: Any):
        raise UnsupportedError(
            f"BaguaDistributedOption(algorithm={algorithm!r}): Bagua is not available in this runtime; "
            "use DDPOption(backend='nccl') on GPUs or DDPOption(backend='gloo') on CPU "
            "(or get_default_distributed_option(device_id), which picks one)"
        )
