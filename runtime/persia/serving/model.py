"""The jitted dense model, reloaded when a new version appears (no restart).

``resolve_model_file`` is the pure choice of which file to serve; ``DenseModel`` polls it every
``poll_seconds`` and swaps the model in only once the new file loads (a half-written or broken
file is logged, counted and retried at the next poll; the old model keeps serving) and its
``check`` passes (the model server's: the new model takes what the served one takes, else it is
refused, said in ``refused``, and the old model keeps serving).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

JIT_NAME = "jit_dense.pt"
_CKPT = re.compile(r"^ckpt-(\d+)$")
_COMPLETE = "COMPLETE"


def resolve_model_file(path: str | os.PathLike) -> Path | None:
    """The file to serve for ``path``: the file itself; in a directory its ``jit_dense.pt``, else
    the newest ``ckpt-<step>/jit_dense.pt`` whose ``COMPLETE`` marker exists (periodic
    checkpoints, docs/checkpoints). None when there is nothing to serve yet."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        return None
    if (p / JIT_NAME).is_file():
        return p / JIT_NAME
    steps = []
    for child in p.iterdir():
        m = _CKPT.match(child.name)
        if m and (child / _COMPLETE).is_file() and (child / JIT_NAME).is_file():
            steps.append((int(m.group(1)), child / JIT_NAME))
    return max(steps)[1] if steps else None


def file_version(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path), st.st_mtime_ns, st.st_size)


class DenseModel:
    """Holds the current ``torch.jit`` model; ``current()`` is safe from any thread."""

    def __init__(self, path: str | os.PathLike, poll_seconds: float = 5.0, device: str = "cpu",
                 on_load: Callable[[bool], None] | None = None,
                 check: Callable[[torch.jit.ScriptModule], str | None] | None = None,
                 on_refused: Callable[[str], None] | None = None):
        """``check(new)``: why a model loaded to replace the served one must not be (None: swap it
        in); a refused version keeps the old model serving, is reported in ``refused`` and to
        ``on_refused(why)`` once, and is tried again when its file changes."""
        self.path = path
        self.poll_seconds = poll_seconds
        self.device = device
        self._on_load = on_load
        self._check = check
        self._on_refused = on_refused
        #: the newest model version refused by ``check`` ("<file>: why"), until a model is swapped in
        self.refused: str | None = None
        self._model: torch.jit.ScriptModule | None = None
        self.version: tuple | None = None
        self.loaded_at: float | None = None
        self.last_error: str | None = None
        self._failed_version: tuple | None = None  # the file version that failed to load last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> torch.jit.ScriptModule | None:
        return self._model

    def poll(self) -> bool:
        """Load the model if its file changed; True when a new version was swapped in."""
        target = resolve_model_file(self.path)
        if target is None:
            if self._model is None:
                self.last_error = f"no model at {self.path} yet"
            return False
        try:
            version = file_version(target)
        except OSError:  # replaced between resolve and stat: next poll
            return False
        if version == self.version or version == self._failed_version:
            return False  # served already, or refused already: tried again once the file changes
        try:
            model = torch.jit.load(str(target), map_location=self.device)
            model.train(False)  # inference mode: dropout off, batch-norm statistics frozen
        except Exception as exc:  # noqa: BLE001 - a partial or foreign file: keep the old model
            self.last_error = f"{target}: {type(exc).__name__}: {exc}"
            # not loaded again every poll (a warning and a whole file read each time, for ever):
            # a copy still being written changes its version, and is tried again then
            self._failed_version = version
            log.warning("cannot load model %s (keeping the current one; tried again when the file changes): %s",
                        target, exc)
            if self._on_load:
                self._on_load(False)
            return False
        why = self._check(model) if self._check is not None and self._model is not None else None
        if why is not None:
            self._failed_version = version  # not loaded and probed again every poll
            self.refused = f"{target}: {why}"
            log.error("refused to reload the model from %s (still serving %s; tried again when the file "
                      "changes): %s", target, self.version[0] if self.version else "?", why)
            if self._on_refused:
                self._on_refused(self.refused)
            return False
        self._model, self.version, self.loaded_at, self.last_error = model, version, time.time(), None
        self.refused = None
        log.info("serving model %s", target)
        if self._on_load:
            self._on_load(True)
        return True

    def start(self) -> None:
        self.poll()

        def loop():
            while not self._stop.wait(self.poll_seconds):
                try:
                    self.poll()
                except Exception:  # noqa: BLE001 - keep polling
                    log.exception("model poll failed")

        self._thread = threading.Thread(target=loop, name="serve-model-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
