"""Kernel-visible names for a role's threads, so that ``top -H``, ``ps -L``, perf and
``/proc/<pid>/task/<tid>/comm`` tell them apart.

Python names its threads (``persia-forward_0``, ``nats-local-…``, ``persia-replay``) only inside
the interpreter: to the kernel every one of them is the process's name, ``python``. Finding which
thread of an NN worker holds a core, or wakes most often, then needs a Python-aware profiler
attached to the process (docs/benchmarks.md, "Where local mode spends its time"). Here each thread
started after :func:`name_os_threads` gives itself its Python name (without the ``persia-``
prefix, cut to the kernel's 15 bytes) as it starts running (a moment after ``start()`` returns),
through ``threading.setprofile``: a hook that runs once in the new thread and removes itself (putting back any profile function that was set
before). The main thread keeps the process's name, which ``ps`` shows for the whole process.
Linux only; elsewhere nothing is named.
"""

from __future__ import annotations

import ctypes
import sys
import threading

MAX_BYTES = 15  # the kernel's TASK_COMM_LEN (16) less the terminating NUL
DROPPED_PREFIX = "persia-"  # every PERSIA thread has it; the 15 bytes are better spent on the rest
_PR_SET_NAME = 15

_lock = threading.Lock()
_installed = False
_prctl = None  # libc's prctl, once looked up; False where there is none


def os_thread_name(name: str) -> str:
    """Pure: the kernel name for a thread named ``name``: without the ``persia-`` prefix, at most
    15 bytes of UTF-8, never cutting a character in two."""
    if name.startswith(DROPPED_PREFIX) and len(name) > len(DROPPED_PREFIX):
        name = name[len(DROPPED_PREFIX):]
    raw = name.encode("utf-8")[:MAX_BYTES]
    return raw.decode("utf-8", errors="ignore")


def set_os_thread_name(name: str) -> bool:
    """Give the calling thread the kernel name for ``name``; False where that cannot be done."""
    prctl, short = _libc_prctl(), os_thread_name(name)
    if not prctl or not short:
        return False
    return prctl(_PR_SET_NAME, ctypes.c_char_p(short.encode("utf-8")), 0, 0, 0) == 0


def name_os_threads() -> bool:
    """From now on, every thread this process starts names itself for the kernel (idempotent);
    False where the platform has no thread names."""
    global _installed
    if not sys.platform.startswith("linux"):
        return False
    with _lock:
        if _installed:
            return True
        if not _libc_prctl():  # looked up here, once, rather than in the first thread that starts
            return False
        previous = threading.getprofile()

        def name_this_thread(frame, event, arg):
            sys.setprofile(previous)  # once per thread: from here on the thread runs as before
            set_os_thread_name(threading.current_thread().name)
            if previous is not None:
                return previous(frame, event, arg)
            return None

        threading.setprofile(name_this_thread)
        _installed = True
    return True


def _libc_prctl():
    """libc's ``prctl`` from the symbols the interpreter already loaded (``dlopen(NULL)``: no
    search of the library path, no subprocess), or False; looked up once."""
    global _prctl
    if _prctl is None:
        _prctl = _find_prctl()
    return _prctl


def _find_prctl():
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, TypeError):
        return False
    prctl.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    prctl.restype = ctypes.c_int
    return prctl
