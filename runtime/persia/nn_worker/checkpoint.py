"""Embedding checkpoints seen from the NN worker: every PS dumps/loads its own shard files; a
top-level marker says a dump is whole. The dense model and optimizer are saved beside it."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from persia.bus import subject
from persia.embedding_ps.checkpoint import (
    LAYOUT_KEY,
    CheckpointError,
    checkpoint_layout,
    layout_differences,
    write_json_atomic,
)
from persia.errors import PersiaError, RemoteError

log = logging.getLogger(__name__)

OPERATION_DEADLINE_S = 3600.0  # a PS dump or stage of a large table
STATUS_POLL_S = (0.02, 1.0)  # first and longest wait between two ps.status polls
WAITING_REPORT_S = 30.0
LAYOUT_DEADLINE_S = 60.0  # asking an embedding worker for its embedding layout (ew.info)


class PsRestarted(PersiaError):
    """A PS replica restarted while it ran a dump or a stage for us: what it wrote, or staged, is
    gone with the process that did it."""

EMBEDDING_DUMP_DONE = "embedding_dump_done"
CHECKPOINT_FORMAT = "persia-k8s-checkpoint/1"


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then a rename onto ``path``: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # a full disk kept every failed attempt's partial file
        if isinstance(exc, Exception):
            raise write_failure(exc, tmp) from exc
        raise


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_failure(exc: Exception, path: Path) -> OSError:
    """What a failed write of ``path`` raises: an OSError naming the file, with the space left on
    its filesystem. ``torch.save`` on a full disk said only ``[enforce fail at
    inline_container.cc:672] . unexpected pos 576 vs 534`` (no path, no errno)."""
    errno_ = exc.errno if isinstance(exc, OSError) else None
    reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
    free = _free_bytes(path)
    where = f" ({free} bytes free on its filesystem)" if free is not None else ""
    return OSError(errno_, f"cannot write {path}{where}: {reason}") if errno_ is not None else \
        OSError(f"cannot write {path}{where}: {reason}")


def begin_dump(directory: Path) -> None:
    """A dump into ``directory`` starts by removing its done marker, before any file is
    overwritten: until the dump's last step writes the marker again, the directory reads as
    unfinished, never as a whole checkpoint mixing new dense files with old embeddings."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / EMBEDDING_DUMP_DONE).unlink(missing_ok=True)


def require_whole(directory: Path) -> None:
    """Raises unless ``directory`` holds a finished dump (its done marker): checked before any of
    its files is read."""
    if not (directory / EMBEDDING_DUMP_DONE).exists():
        raise FileNotFoundError(
            f"{directory}: no {EMBEDDING_DUMP_DONE} marker: not an embedding checkpoint, or its dump did not finish"
        )


class EmbeddingCheckpoints:
    """Checkpoint methods of ``EmbeddingCtx`` (needs ``_ps_all``, ``model``, ``device``)."""

    @staticmethod
    def _local_dir(path: str | os.PathLike) -> Path:
        s = str(path)
        if "://" in s and not s.startswith("file://"):
            raise ValueError(f"checkpoint directory {s!r}: only local paths are supported (no hdfs:// yet)")
        return Path(s.removeprefix("file://"))

    def _wait_for_updates(self) -> None:
        pass

    def _begin_dump(self, directory: Path) -> None:
        """``begin_dump`` once the dump started earlier with ``blocking=False`` ended (its error
        raised): it would write its done marker into a directory this dump is rewriting."""
        self._wait_kind("dump")
        begin_dump(directory)

    def dump_embedding(self, dst_dir: str, blocking: bool = True) -> None:
        """Every PS writes its own shard files; then a top-level done marker says the dump is whole."""
        directory = self._local_dir(dst_dir)
        self._begin_dump(directory)
        self._wait_for_updates()

        def run():
            results = self._ps_operation("dump", directory)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
            marker = {
                "format": CHECKPOINT_FORMAT,
                "num_shards": len(results),
                "rows": [r["rows"] for r in results],
                "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            }
            layout = self._embedding_layout("dump")
            if layout is not None:  # where each slot's rows live: checked by whoever loads them
                marker[LAYOUT_KEY] = layout
            write_json_atomic(directory / EMBEDDING_DUMP_DONE, marker)

        self._run_maybe_async(run, blocking, "dump")

    def _embedding_layout(self, purpose: str) -> dict | None:
        """The embedding layout of the embedding workers' ``embedding_config.yml`` (``ew.info``;
        ``checkpoint.embedding_layout``); None, with a warning, when no worker says."""
        try:
            info = self.bus.request_retry(subject("ew", "info"), None, deadline_s=LAYOUT_DEADLINE_S, timeout=2.0,
                                          what="the embedding workers' embedding layout")
            layout = info.get("layout") if isinstance(info, dict) else None
        except Exception as exc:  # noqa: BLE001 - the layout is a check, the dump or load goes on
            log.warning("no embedding worker told its embedding layout (%s: %s): the %s is not checked against, "
                        "nor records, the embedding config", type(exc).__name__, exc, purpose)
            return None
        if layout is None:
            log.warning("the embedding workers do not tell their embedding layout: the %s is not checked against, "
                        "nor records, the embedding config", purpose)
        return layout

    def _check_embedding_layout(self, directory: Path) -> None:
        """Raises ``CheckpointLoadError`` (nothing loaded) when ``directory`` was trained with
        another embedding layout than the running embedding config: every row would sit under
        signs no lookup asks for. A checkpoint that records none (older) is loaded with a warning."""
        try:
            recorded = checkpoint_layout(directory)
        except CheckpointError as exc:
            raise CheckpointLoadError(f"{directory}: {exc}; nothing was loaded") from None
        if recorded is None:
            log.warning("%s records no embedding layout (written before it was recorded): loaded without checking "
                        "that this job's embedding_config.yml is the one it was trained with", directory)
            return
        current = self._embedding_layout("load")
        if current is None:
            return
        why, notes = layout_differences(recorded, current)
        if why is not None:
            raise CheckpointLoadError(
                f"{directory}: trained with another embedding layout than this job's embedding_config.yml: {why}; "
                f"its rows would never be looked up (every ID a miss); nothing was loaded")
        for note in notes:
            log.warning("%s: %s", directory, note)

    def load_embedding(self, src_dir: str, blocking: bool = True) -> None:
        """Load every PS replica's rows, all or nothing (see ``_load_all_or_nothing``)."""
        self._load_all_or_nothing(self._local_dir(src_dir), [], blocking)

    def _ps_operation(self, op: str, directory: Path, deadline_s: float = OPERATION_DEADLINE_S) -> list[Any]:
        """``op`` (dump, stage) on every PS replica, each on the PS's own thread: started with
        ``ps.start.<i>``, then followed with short ``ps.status.<i>`` polls. A NATS restart costs
        a retry (one request of up to an hour lost its reply and left the caller waiting that
        long); a PS that restarted meanwhile is a ``PsRestarted`` within a poll. Each replica's
        result or exception, in replica order."""
        op_id = uuid.uuid4().hex
        payload = {"op": op, "dir": str(directory.resolve()), "id": op_id}
        started = self._ps_each("start", payload, timeout=60)
        results: list[Any] = list(started)
        incarnation = {i: r["incarnation"] for i, r in enumerate(started) if not isinstance(r, BaseException)}
        pending = set(incarnation)
        began = time.monotonic()
        report_at, wait = began + WAITING_REPORT_S, STATUS_POLL_S[0]
        while pending:
            for i in sorted(pending):
                try:
                    status = self.bus.request_retry(subject("ps", "status", i), {"id": op_id}, deadline_s=60,
                                                    timeout=5, what=f"PS {i} status of its {op}")
                except Exception as exc:  # noqa: BLE001 - this replica's outcome
                    results[i] = exc
                    pending.discard(i)
                    continue
                outcome = status.get("operation")
                if status["incarnation"] != incarnation[i] or outcome is None:
                    results[i] = PsRestarted(f"PS replica {i} restarted during the {op} of {directory}: "
                                             f"its {op} is lost")
                elif outcome["state"] == "done":
                    results[i] = outcome["result"]
                elif outcome["state"] == "failed":
                    results[i] = RemoteError(f"PS {i} {op}", outcome["error"])
                else:
                    continue
                pending.discard(i)
            now = time.monotonic()
            if pending and now - began > deadline_s:
                for i in pending:
                    results[i] = TimeoutError(f"PS replica {i}: its {op} of {directory} did not end within "
                                              f"{deadline_s:.0f}s")
                break
            if pending and now >= report_at:
                log.warning("the %s of %s runs on PS replicas %s for %.0fs", op, directory, sorted(pending), now - began)
                report_at = now + WAITING_REPORT_S
            if pending:
                time.sleep(wait)
                wait = min(STATUS_POLL_S[1], wait * 2)
        return results

    def _ps_each(self, method: str, payload: Any, timeout: float = 3600.0) -> list[Any]:
        """``method`` on every PS replica; every answer or exception, in replica order (waits for all)."""
        n = self._ps_count()
        with ThreadPoolExecutor(max_workers=min(n, 16), thread_name_prefix="persia-ps-each") as pool:
            futs = [pool.submit(self.bus.request_retry, subject("ps", method, i), payload, deadline_s=timeout,
                                timeout=timeout, retry_busy=True, what=f"PS {i} {method}") for i in range(n)]
            out = []
            for f in futs:
                try:
                    out.append(f.result())
                except Exception as exc:  # noqa: BLE001 - returned to the caller, which raises
                    out.append(exc)
            return out

    def _load_all_or_nothing(self, directory: Path, apply_dense: list[Callable[[], None]], blocking: bool) -> None:
        """Stage the embeddings on every PS replica (each validates its files and builds its tables
        beside the live ones); if any replica refuses, every replica drops its staged tables and
        nothing live has changed. Then the dense parts (already validated) are applied and every
        replica commits (a swap). Replaces PERSIA's load, where a refusing replica left the others,
        and the dense model, switched."""
        require_whole(directory)
        self._check_embedding_layout(directory)

        def run():
            staged = self._ps_operation("stage", directory)
            failed = [(i, r) for i, r in enumerate(staged) if isinstance(r, BaseException)]
            if failed:
                self._ps_each("abort", None, timeout=60)
                i, err = failed[0]
                raise CheckpointLoadError(f"{directory}: PS replica {i} refused the checkpoint ({err}); "
                                          f"nothing was loaded ({len(failed)} of {len(staged)} replicas refused)") from err
            try:
                for fn in apply_dense:
                    fn()
            except BaseException:
                self._ps_each("abort", None, timeout=60)
                raise
            committed = self._ps_each("commit", None, timeout=600)
            bad = [(i, r) for i, r in enumerate(committed) if isinstance(r, BaseException)]
            if bad:  # only a replica that died between stage and commit: the job must restart
                raise CheckpointLoadError(f"{directory}: PS replica {bad[0][0]} could not commit the staged "
                                          f"checkpoint ({bad[0][1]}); restart the job") from bad[0][1]
            self._embeddings_replaced()

        self._run_maybe_async(run, blocking, "load")

    def _run_maybe_async(self, fn, blocking: bool, kind: str) -> None:
        # one dump (or load) at a time, as the PS replicas take them: a new one waits for the one
        # started with blocking=False, and that one's error is raised here, not overwritten
        self._wait_kind(kind)
        if blocking:
            fn()
            return

        def wrapper():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait_for_*
                setattr(self, f"_{kind}_error", exc)

        t = threading.Thread(target=wrapper, name=f"persia-{kind}", daemon=True)
        setattr(self, f"_{kind}_thread", t)
        setattr(self, f"_{kind}_error", None)
        t.start()

    def _wait_kind(self, kind: str) -> None:
        t = getattr(self, f"_{kind}_thread")
        if t is not None:
            t.join()
            setattr(self, f"_{kind}_thread", None)
        err = getattr(self, f"_{kind}_error")
        setattr(self, f"_{kind}_error", None)
        if err is not None:
            raise err

    def _finish_background(self, exc: BaseException | None) -> None:
        """At the context's exit, a dump or load started with ``blocking=False`` that nobody
        waited for: joined, and its error raised, so a failed last dump is not an exit 0. Leaving
        with an exception already, it is not waited for, and its state goes to the log."""
        errors = []
        for kind in ("dump", "load"):
            thread = getattr(self, f"_{kind}_thread", None)
            if exc is not None and thread is not None and thread.is_alive():
                log.error("leaving with a %s started with blocking=False still running; it is abandoned "
                          "(a dump's directory stays unfinished: no %s)", kind, EMBEDDING_DUMP_DONE)
                continue
            try:
                self._wait_kind(kind)
            except BaseException as err:  # noqa: BLE001 - raised below, or logged beside exc
                errors.append(err)
                log.error("the %s started with blocking=False failed: %s: %s", kind, type(err).__name__, err)
        if errors and exc is None:
            raise errors[0]

    def wait_for_dump_embedding(self) -> None:
        self._wait_kind("dump")

    def wait_for_load_embedding(self) -> None:
        self._wait_kind("load")

    def _dense_module(self) -> torch.nn.Module:
        m = self.model
        return m.module if isinstance(m, torch.nn.parallel.DistributedDataParallel) else m

    def dump_checkpoint(self, dst_dir: str, dense_filename: str = "dense.pt",
                        jit_dense_filename: str = "jit_dense.pt", blocking: bool = True,
                        with_jit_model: bool = False) -> None:
        directory = self._local_dir(dst_dir)
        self._begin_dump(directory)
        if self.model is not None:
            dense = self._dense_module()
            write_atomically(directory / dense_filename, lambda tmp: torch.save(dense.state_dict(), tmp))
            if with_jit_model:
                scripted = torch.jit.script(dense)
                write_atomically(directory / jit_dense_filename, lambda tmp: torch.jit.save(scripted, str(tmp)))
        self.dump_embedding(str(directory), blocking)

    def _dense_loader(self, directory: Path, dense_filename: str, map_location) -> list[Callable[[], None]]:
        """Read and validate the dense model file; returns what applies it (nothing live changes here).
        A missing file is an error (PERSIA skipped it and kept the model as it was)."""
        dense_path = directory / dense_filename
        if self.model is None:
            return []
        if not dense_path.is_file():
            raise FileNotFoundError(f"{dense_path}: no dense model file (dense_filename {dense_filename!r}); "
                                    "nothing was loaded. load_embedding() loads the embeddings alone")
        module = self._dense_module()
        state = load_state_file(dense_path, map_location or self.device)
        check_state_dict(module.state_dict(), state, dense_path)
        return [lambda: module.load_state_dict(state)]

    def load_checkpoint(self, src_dir: str, map_location: str | None = None,
                        dense_filename: str = "dense.pt", blocking: bool = True) -> None:
        directory = self._local_dir(src_dir)
        require_whole(directory)
        self._load_all_or_nothing(directory, self._dense_loader(directory, dense_filename, map_location), blocking)

    def dump_torch_state_dict(self, torch_instance, dst_dir: str, file_name: str, is_jit: bool = False) -> None:
        """PERSIA's: ``dst_dir/file_name`` gets the module's (or optimizer's) state dict, or with
        ``is_jit`` the module as TorchScript. Written under a temporary name, then renamed."""
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        if is_jit:
            scripted = torch_instance if isinstance(torch_instance, torch.jit.ScriptModule) else torch.jit.script(torch_instance)
            write_atomically(directory / file_name, lambda tmp: torch.jit.save(scripted, str(tmp)))
        else:
            write_atomically(directory / file_name, lambda tmp: torch.save(torch_instance.state_dict(), tmp))

    def load_torch_state_dict(self, torch_instance, src_dir: str, map_location: str | None = None) -> None:
        """PERSIA's: ``src_dir`` is the file ``dump_torch_state_dict`` wrote (tensors only: no
        pickled code is loaded)."""
        state = load_state_file(Path(self._local_dir(src_dir)), map_location or self.device)
        torch_instance.load_state_dict(state)

class CheckpointLoadError(RuntimeError):
    """A checkpoint that was not loaded; nothing live changed (unless the message says restart)."""


def load_state_file(path: Path, map_location) -> Any:
    """``torch.load`` (tensors only) of a checkpoint's state file; a file that cannot be read is a
    ``CheckpointLoadError`` naming it. A truncated ``dense.pt`` said only ``PytorchStreamReader
    failed reading zip archive: failed finding central directory``, an empty one a bare
    ``EOFError``: which file of which checkpoint, the resume did not say."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every way a damaged file fails
        try:
            size = f"{path.stat().st_size} bytes"
        except OSError:
            size = "size unknown"
        raise CheckpointLoadError(f"{path}: unreadable ({size}; truncated or corrupted after it was written?): "
                                  f"{type(exc).__name__}: {str(exc)[:200]}; nothing was loaded") from exc


def check_state_dict(current: dict, loaded: Any, path: Path) -> None:
    """The loaded state dict has the model's keys with the same shapes (before anything is loaded)."""
    if not isinstance(loaded, dict):
        raise CheckpointLoadError(f"{path}: not a state dict ({type(loaded).__name__})")
    missing, extra = sorted(set(current) - set(loaded)), sorted(set(loaded) - set(current))
    if missing or extra:
        raise CheckpointLoadError(f"{path}: does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, value in current.items():
        got = loaded[key]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(value.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise CheckpointLoadError(f"{path}: {key} has shape {shape}, the model's is {tuple(value.shape)}")


def check_optimizer_state(optimizer: torch.optim.Optimizer, loaded: Any, path: Path) -> None:
    """The loaded optimizer state has the optimizer's parameter groups (before anything is loaded)."""
    if not isinstance(loaded, dict) or not isinstance(loaded.get("param_groups"), list):
        raise CheckpointLoadError(f"{path}: not an optimizer state dict")
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g.get("params", ())) for g in loaded["param_groups"]]
    if mine != theirs:
        raise CheckpointLoadError(f"{path}: parameter groups of sizes {theirs}, the optimizer has {mine}")
