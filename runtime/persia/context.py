"""What every role's context shares: PERSIA's default logging, the device, and the stack of active
contexts that ``cnt_ctx()`` (and the NN worker's DataLoader) read.

torch is imported only by what needs it (a CUDA device, the ``device`` attribute, an NN worker's
contexts): a data loader that does not use torch starts without it (about 1.8 s of CPU less per
start, every restart included)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import traceback

from persia import env
from persia.allocator import tune_allocator
from persia.errors import PersiaValidationError
from persia.thread_names import name_os_threads

log = logging.getLogger(__name__)

# One stack per thread: a DataCtx sending from one thread and a TrainCtx training in another (one
# process, as in tests and notebooks) must not see, or pop, each other's contexts.
_stacks = threading.local()


def ctx_stack() -> list["BaseCtx"]:
    """This thread's active contexts, innermost last."""
    stack = getattr(_stacks, "stack", None)
    if stack is None:
        stack = _stacks.stack = []
    return stack


def cnt_ctx() -> "BaseCtx | None":
    """The innermost active context (PERSIA's name)."""
    stack = ctx_stack()
    return stack[-1] if stack else None


def set_torch_threads(threads: int) -> None:
    """torch's intra-op threads (``PERSIA_TORCH_THREADS``), now if torch is loaded, else for when
    it is: OpenMP and MKL read their thread counts from the environment when they load."""
    if threads < 1:
        raise ValueError(f"PERSIA_TORCH_THREADS must be >= 1, got {threads}")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
        return
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)


def torch_threads_setting(value: str, cores: int, local_procs: int, name: str = "PERSIA_TORCH_THREADS") -> tuple[int, bool]:
    """``PERSIA_TORCH_THREADS``: a count; ``auto``: start with this process's share of the cores and
    let the NN worker measure which count trains fastest (``persia.nn_worker.thread_tuning``);
    ``auto:N``: the same from N. Returns (threads to start with, whether to measure)."""
    text = value.strip().lower()
    measure = text == "auto" or text.startswith("auto:")
    if text == "auto":
        return max(1, cores // max(1, local_procs)), True
    try:
        threads = int(text[len("auto:"):] if measure else text)
    except ValueError:
        raise PersiaValidationError(
            f"{name} must be a count, 'auto' or 'auto:<count>', got {value!r}") from None
    if threads < 1:
        raise PersiaValidationError(f"{name} must be >= 1, got {value!r}")
    return threads, measure


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _role_name() -> str:
    rank = env.get_rank()
    if rank is not None:
        return f"nn-worker-{rank}"
    return f"data-loader-{env.get_replica_index()}"


class BaseCtx:
    def __init__(self, threadpool_worker_size: int = 10, device_id: int | None = None):
        tune_allocator()  # scripts: an exec'd process starts with glibc's defaults again (persia.allocator)
        name_os_threads()  # before the context starts its threads (persia.thread_names)
        if not logging.getLogger().handlers:  # a user script that set up no logging: PERSIA's default
            from persia.logger import setup_logging

            setup_logging(_role_name())
        self.threadpool_worker_size = threadpool_worker_size
        if device_id is not None and device_id < 0:  # PERSIA: a negative device id means CPU
            device_id = None
        if device_id is not None:
            import torch

            if not torch.cuda.is_available():
                raise PersiaValidationError(
                    f"device_id={device_id} but CUDA is not available; pass device_id=None (or -1) for CPU")
            if not 0 <= device_id < torch.cuda.device_count():
                raise PersiaValidationError(
                    f"device_id={device_id} out of range: {torch.cuda.device_count()} GPUs visible")
            torch.cuda.set_device(device_id)
        self.device_id = device_id
        # the NN worker's TrainCtx measures the counts when tune_torch_threads (``auto``)
        self.tune_torch_threads = False
        setting = os.environ.get("PERSIA_TORCH_THREADS")
        if setting:
            threads, self.tune_torch_threads = torch_threads_setting(
                setting, _available_cores(), int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
            # A context made inside a running one (an eval_ctx between training steps) keeps the
            # count in force: it may be the one the NN worker measured, and setting the start count
            # again would undo that choice for the rest of training.
            if not ctx_stack():
                set_torch_threads(threads)

    @functools.cached_property
    def device(self):
        """``torch.device`` of this context: ``cuda:<device_id>``, or the CPU (made on first use)."""
        import torch

        return torch.device(f"cuda:{self.device_id}") if self.device_id is not None else torch.device("cpu")

    def __enter__(self):
        self._enter()
        ctx_stack().append(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not issubclass(exc_type, SystemExit):  # SIGTERM's GracefulStop is not an error
            log.error("leaving %s with an exception:\n%s", type(self).__name__,
                      "".join(traceback.format_exception(exc_type, exc, tb)))
        try:
            self._exit(exc)
        finally:
            stack = ctx_stack()
            if stack and stack[-1] is self:
                stack.pop()
        return False

    def _enter(self) -> None:
        pass

    def _exit(self, exc: BaseException | None) -> None:
        pass


