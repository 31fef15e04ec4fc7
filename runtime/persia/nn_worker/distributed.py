"""Dense data parallelism for NN workers (torch DDP; gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping

import torch

from persia.errors import PersiaValidationError, UnsupportedError

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


INIT_METHODS = ("tcp", "file")
BACKENDS = ("nccl", "gloo")
PERSIA_OPTIONS = ("master_addr", "master_port", "sync_file")
"""The ``**options`` PERSIA's own DDPOption read; every other option must be one of torch DDP's."""
SET_BY_NN_WORKER = frozenset({"module", "device_ids", "output_device", "process_group", "device_mesh"})
"""DDP constructor arguments the NN worker decides (its model, its device, the group it creates)."""


def ddp_constructor_options() -> frozenset[str]:
    """The keyword options this torch's ``DistributedDataParallel`` takes, less those the NN worker
    sets: read from the signature so a newer torch's options pass without a change here."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters.values()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in keyword) - SET_BY_NN_WORKER


def resolve_initialization_method(initialization_method: str | None, init_method: str | None) -> str:
    """PERSIA's later ``initialization_method``, or ``init_method`` (its earlier name, still in its
    tutorial); "tcp" when neither is given. Both given and different is refused, not guessed."""
    if initialization_method is not None and init_method is not None and initialization_method != init_method:
        raise PersiaValidationError(
            f"DDPOption got initialization_method={initialization_method!r} and init_method={init_method!r}: "
            "init_method is PERSIA's older name for initialization_method; pass one of them"
        )
    method = initialization_method if initialization_method is not None else init_method
    method = "tcp" if method is None else method
    if method not in INIT_METHODS:
        raise PersiaValidationError(
            f"DDPOption.initialization_method must be one of {INIT_METHODS}, got {method!r}")
    return method


def split_options(options: Mapping[str, Any], initialization_method: str,
                  ddp_options: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(persia_options, ddp_kwargs)`` from DDPOption's ``**options``. PERSIA kept options it
    never read; here each one is used or refused, so a misspelt or misplaced option fails at
    construction instead of training without it."""
    persia: dict[str, Any] = {}
    ddp: dict[str, Any] = {}
    for name, value in options.items():
        if name in PERSIA_OPTIONS:
            persia[name] = value
        elif name in ddp_options:
            ddp[name] = value
        else:
            why = ("the NN worker sets it (from the context's device_id and the process group it creates)"
                   if name in SET_BY_NN_WORKER else "unknown option")
            raise PersiaValidationError(
                f"DDPOption option {name}={value!r} is not accepted ({why}); DDPOption takes "
                f"initialization_method (or init_method) {INIT_METHODS}, backend {BACKENDS}, "
                f"master_addr, master_port, sync_file (file init), and torch DistributedDataParallel's {', '.join(sorted(ddp_options))}"
            )
    if initialization_method == "file" and not persia.get("sync_file"):
        raise PersiaValidationError(
            f"DDPOption(initialization_method='file') needs a sync_file option, got {persia.get('sync_file')!r}")
    if initialization_method != "file" and "sync_file" in persia:
        raise PersiaValidationError(
            f"DDPOption option sync_file={persia['sync_file']!r} is only used with initialization_method='file', "
            f"got initialization_method={initialization_method!r}"
        )
    if "master_port" in persia:
        port = persia["master_port"]
        try:
            persia["master_port"] = int(port)
        except (TypeError, ValueError):
            raise PersiaValidationError(f"DDPOption option master_port must be a port number, got {port!r}") from None
        if not 0 < persia["master_port"] < 65536:
            raise PersiaValidationError(f"DDPOption option master_port must be in 1..65535, got {port!r}")
    return persia, ddp


def ddp_kwargs(user: Mapping[str, Any], device_id: int | None) -> dict[str, Any]:
    """The DDP constructor's keywords: the user's, over PERSIA's ``find_unused_parameters=True``
    (a model with a parameter unused in some step, e.g. a branch, must train as it did in PERSIA;
    the cost, one autograd-graph walk per step, is within noise next to the step itself), plus
    the device the NN worker runs on."""
    kwargs: dict[str, Any] = {"find_unused_parameters": True, **user}
    if device_id is not None:
        kwargs["device_ids"] = [device_id]
        kwargs["output_device"] = device_id
    return kwargs


class DDPOption(DistributedBaseOption):
    """PERSIA's DDP option: ``initialization_method`` (PERSIA's older name ``init_method`` works
    too) "tcp" (master address found over NATS, or ``master_addr``) or "file" (``sync_file``);
    ``backend`` "nccl" or "gloo"; every other option is torch ``DistributedDataParallel``'s and
    is passed to it (``find_unused_parameters`` defaults to True, as in PERSIA). Anything else
    is refused, naming it."""

    def __init__(self, initialization_method: str | None = None, backend: str = "nccl",
                 init_method: str | None = None, **options: Any):
        method = resolve_initialization_method(initialization_method, init_method)
        if backend not in BACKENDS:
            raise PersiaValidationError(f"DDPOption.backend must be one of {BACKENDS}, got {backend!r}")
        persia, ddp = split_options(options, method, ddp_constructor_options())
        super().__init__(persia.pop("master_port", DEFAULT_MASTER_PORT), persia.pop("master_addr", None))
        self.initialization_method = method
        self.backend = backend
        self.options = persia  # PERSIA's own options left after master_*: sync_file
        self.ddp_options = ddp

    @property
    def init_method(self) -> str:
        """PERSIA's older attribute name for ``initialization_method``."""
        return self.initialization_method

    def init_with_env_file(self) -> bool:
        return self.initialization_method == "file"

    def init_url(self, master_addr: str | None) -> str:
        if self.initialization_method == "file":
            return f"file://{self.options['sync_file']}"
        addr = master_addr or self.master_addr
        if not addr:
            raise ValueError("DDP tcp initialisation needs a master address")
        return f"tcp://{addr}:{self.master_port}"

    def convert2distributed_model(self, model, world_size, rank_id, device_id=None, master_addr=None, optimizer=None):
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("DDPOption(backend='nccl') needs CUDA; use backend='gloo' on CPU")
        if torch.distributed.is_initialized():  # an earlier TrainCtx of this process joined the ranks
            check_joined_group(torch.distributed.get_world_size(), torch.distributed.get_rank(),
                               str(torch.distributed.get_backend()), world_size, rank_id, self.backend)
        elif self.initialization_method == "tcp":
            store = self._tcp_store(master_addr, world_size, rank_id)
            torch.distributed.init_process_group(self.backend, store=store, rank=rank_id, world_size=world_size)
        else:
            torch.distributed.init_process_group(
                self.backend, init_method=self.init_url(master_addr), rank=rank_id, world_size=world_size
            )
        model = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs(self.ddp_options, device_id))
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


def check_joined_group(group_world: int, group_rank: int, group_backend: str,
                       world_size: int, rank: int, backend: str) -> None:
    """A process group already initialised in this process (by an earlier ``TrainCtx``, or by the
    user) is reused by the next one only if it is the group that context would have made: torch
    keeps one default group per process, and joining the ranks again would wait for ever on a
    rendezvous the other ranks' reused groups never come to."""
    if (group_world, group_rank, group_backend) != (world_size, rank, backend):
        raise PersiaValidationError(
            f"this process already joined a torch.distributed group of world size {group_world} as rank "
            f"{group_rank} on {group_backend}, but this TrainCtx is rank {rank} of {world_size} on {backend}; "
            "call torch.distributed.destroy_process_group() on every rank before entering it")


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
