"""Run a function once on every thread of the calling thread's OpenMP team.

Some settings are per thread: the MXCSR register's denormal bits (``denormals``), a thread's CPU
affinity (``cpu_placement``). torch's intra-op threads are OpenMP's, made by the runtime and out of
Python's reach, so the only way to set them is from inside: one parallel region of the OpenMP
runtime torch loaded, in which each team thread calls the function for itself. The calling thread
is thread 0 of its team, so it runs the function too.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

# the OpenMP runtimes whose GOMP entry points torch's CPU builds use (libgomp; Intel's libiomp5
# exports the same ABI)
OPENMP_LIBRARIES = ("libgomp", "libiomp5")

_runtime_lock = threading.Lock()
_team_call = None  # (GOMP_parallel, its callback type), once an OpenMP runtime was found


def openmp_library(maps: str) -> str | None:
    """Path of the OpenMP runtime mapped into a process, from the text of its /proc/<pid>/maps."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(OPENMP_LIBRARIES):
            return fields[5].strip()
    return None


def _openmp_team_call():
    """``GOMP_parallel`` of the OpenMP runtime torch loaded and its callback type, or None."""
    global _team_call
    with _runtime_lock:
        if _team_call is None:
            try:
                with open("/proc/self/maps") as f:
                    path = openmp_library(f.read())
            except OSError:
                path = None
            if path is None:
                return None
            runtime = ctypes.CDLL(path)  # the library already mapped: the same thread pools
            callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
            parallel = runtime.GOMP_parallel  # void GOMP_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags)
            parallel.argtypes = (callback_type, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
            parallel.restype = None
            _team_call = (parallel, callback_type)
        return _team_call


def on_each_team_thread(fn: Callable[[], object], threads: int) -> list | None:
    """``fn()`` on each of ``threads`` team threads (the caller among them); their results, in no
    order, or None when no OpenMP runtime is loaded (threads made later then inherit whatever the
    caller set on itself). A result list shorter than ``threads`` means the runtime gave fewer."""
    call = _openmp_team_call()
    if call is None:
        return None
    parallel, callback_type = call
    results: list = []

    def on_each_thread(_data) -> None:  # runs in every team thread; ctypes takes the GIL for it
        results.append(fn())

    parallel(callback_type(on_each_thread), None, threads, 0)  # a CDLL call: the GIL is released
    return results
