"""Periodic checkpoints, resume and graceful SIGTERM on the NN worker (``TrainCtx``'s part).

A checkpoint is a consistent cut taken after a training step, identical on every rank:

1. every rank waits until each of its embedding gradient updates is applied on the PS (so the
   PS holds exactly the updates of the batches counted as trained);
2. the ranks exchange how many batches of each data loader they trained (a collective, which is
   also the barrier that makes every rank's flush happen before the dump);
3. rank 0 writes ``dense.pt``, ``opt.pt``, ``progress.json`` (step, loader positions) and asks
   every PS replica to dump its shard, all into ``<dir>/.tmp-ckpt-<step>``; then ``COMPLETE``,
   then the rename to ``<dir>/ckpt-<step>`` (published), then retention;
4. a second barrier: no rank sends updates before the dump has read the PS.

Resume (``resume: auto`` and a ``checkpoint_dir``) loads the newest published checkpoint before
the data loaders are answered (``nn.info``), so they learn where to start: ``DataCtx`` skips the
batches already trained (``persia.data_loader.resume``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from persia.bus import subject
from persia.errors import PersiaValidationError
from persia.env import grace_period_s
from persia.embedding_ps.checkpoint import write_json_atomic
from persia.nn_worker import checkpoint_plan as plan

log = logging.getLogger(__name__)

# durations of the latest periodic checkpoints kept on the context (``checkpoint_seconds``): a
# list of every one grew for as long as training ran (online training never ends)
CHECKPOINT_TIMES_KEPT = 1000


class GracefulStop(SystemExit):
    """SIGTERM ended training after a whole step (updates flushed, final checkpoint written when
    configured). A SystemExit, so the user's script ends without a traceback, exit code 143."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


# -- files ----------------------------------------------------------------------------------------
def scan(directory: Path) -> list[tuple[int, str]]:
    """Published checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return plan.complete_checkpoints((p.name, (p / plan.COMPLETE).is_file()) for p in directory.iterdir())


def read_progress(path: Path) -> dict:
    """``progress.json`` of a checkpoint (step and loader positions); an explicit checkpoint
    without one (written by ``dump_checkpoint``) resumes at step 0 with loaders from the start."""
    f = path / plan.PROGRESS
    if not f.exists():
        return {"step": 0, "world_size": None, "loaders": {}}
    try:
        data = json.loads(f.read_text())
    except ValueError as exc:  # truncated or damaged after it was written: json named no file
        raise ValueError(f"{f}: malformed progress file (truncated or corrupted?): {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int) or not isinstance(data.get("loaders"), dict):
        raise ValueError(f"{f}: malformed progress file")
    size = data.get("loader_size")
    if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ValueError(f"{f}: malformed progress file: loader_size {size!r}")
    for run in data.get("earlier") or ():
        if not (isinstance(run, dict) and isinstance(run.get("world_size"), int) and run["world_size"] >= 1
                and isinstance(run.get("loaders"), dict)):
            raise ValueError(f"{f}: malformed progress file: earlier run {run!r}")
    return data


def publish(tmp: Path, final: Path, marker: dict) -> None:
    """COMPLETE (written atomically, fsynced) inside ``tmp``, then ``tmp`` renamed to ``final``."""
    write_json_atomic(tmp / plan.COMPLETE, marker)
    trash = None
    if final.exists():  # the same step written again (a resumed job passing it once more)
        trash = final.with_name(plan.TMP_PREFIX + "old-" + final.name)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)  # the old copy is removed only once the new one is published
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def own_checkpoints(directory: Path | None, complete: list[tuple[int, str]]) -> set[str]:
    """The complete checkpoints this run wrote: their progress names this process's
    ``PERSIA_RUN_ID`` (none without one)."""
    run_id = os.environ.get(plan.ENV_RUN_ID)
    if not run_id or directory is None:
        return set()
    own = set()
    for _, name in complete:
        try:
            if read_progress(directory / name).get("run_id") == run_id:
                own.add(name)
        except (OSError, ValueError):  # unreadable: not this run's to resume from
            continue
    return own


LOCK_WAIT_S = 120.0  # how long a cut waits for another writer of the same directory


class CheckpointDirBusy(OSError):
    """Another process holds ``checkpoint_dir``'s writer lock (two jobs share the directory)."""


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@contextlib.contextmanager
def dir_lock(directory: Path, what: str, wait_s: float | None = None, poll_s: float = 0.1):
    """Holds ``directory``'s writer lock (``flock`` of the directory itself, released when the
    holder exits or dies) while a checkpoint is written and retention applied. Each cut removed
    *every* ``.tmp-ckpt-*`` directory as a killed writer's: with two jobs pointed at the same
    ``checkpoint_dir`` (a job launched twice, a zombie of an earlier launch), one removed the
    other's checkpoint while it was being written, and both (their cuts at the same multiples of
    the interval) wrote into the same ``.tmp-ckpt-<step>``: a failed checkpoint, or one published
    with the other job's files. After ``wait_s`` (``LOCK_WAIT_S``) a ``CheckpointDirBusy`` names
    the directory and the holder. Where a directory cannot be locked (NFS wants a writable
    descriptor) the lock is ``directory/.writer.lock``; a filesystem without locks is logged and
    written unlocked."""
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    directory.mkdir(parents=True, exist_ok=True)
    fd, on_file = os.open(directory, os.O_RDONLY | os.O_DIRECTORY), False
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _lock_holder(directory / plan.LOCK if on_file else directory)
                if time.monotonic() >= deadline:
                    raise CheckpointDirBusy(errno.EBUSY, f"checkpoint_dir {directory} is being written by another "
                                            f"process ({holder}) for more than {wait_s:.0f}s; two jobs pointed at "
                                            f"the same checkpoint_dir? no {what}", str(directory)) from None
                if not said:
                    said = True
                    log.warning("checkpoint_dir %s is being written by another process (%s): the %s waits for it "
                                "(two jobs pointed at the same checkpoint_dir?)", directory, holder, what)
                time.sleep(poll_s)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS + (errno.EBADF,):
                    raise
                why = exc
                if not on_file:
                    try:
                        lock_fd = os.open(directory / plan.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
                    except OSError as open_exc:  # a read-only directory: a resume still reads it
                        why = open_exc
                    else:
                        os.close(fd)
                        fd, on_file = lock_fd, True
                        continue
                log.warning("checkpoint_dir %s: cannot lock it (%s): the %s runs unlocked; "
                            "two jobs must not share it", directory, why, what)
                break
        if on_file:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}: {what}".encode(), 0)
            except OSError:  # informative only (a full disk: the cut itself will say so)
                pass
        yield
    finally:
        os.close(fd)


def _lock_holder(path: Path) -> str:
    """Who holds the lock of ``path``: a lock file's content, else ``/proc/locks`` (same host)."""
    try:
        if path.is_file():
            return path.read_text().strip() or "unknown"
        st = os.stat(path)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and dev in fields and "->" not in fields:
                return f"{socket.gethostname()} pid {fields[fields.index(dev) - 1]}"
    except (OSError, ValueError, IndexError):
        pass
    return "another host, or unknown"


def remove_stale(directory: Path) -> None:
    """Removes the temporary directories a killed writer (or an interrupted retention) left; under
    the writer lock, so never a live writer's."""
    for stale in directory.glob(plan.TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def write_cut(directory: Path, progress: dict, write_parts: Callable[[Path], None], keep: int) -> dict:
    """Under ``dir_lock``: see ``_write_cut``."""
    with dir_lock(directory, f"checkpoint of step {int(progress['step'])}"):
        return _write_cut(directory, progress, write_parts, keep)


def _write_cut(directory: Path, progress: dict, write_parts: Callable[[Path], None], keep: int) -> dict:
    """Write one checkpoint: ``progress.json`` and ``write_parts(tmp)`` into ``.tmp-ckpt-<step>``,
    then publish it (``COMPLETE``, rename) and apply retention. A writer killed anywhere before the
    rename leaves only a temporary directory, which no reader looks at and the next cut removes
    (a failed cut removes its own at once: up to a whole checkpoint each, they filled disks);
    returns the marker."""
    step = int(progress["step"])
    tmp = directory / plan.tmp_name(step)
    final = directory / plan.checkpoint_name(step)
    remove_stale(directory)  # this step's, or a killed writer's
    tmp.mkdir(parents=True)
    try:
        write_json_atomic(tmp / plan.PROGRESS, progress)
        write_parts(tmp)
        now = time.time()
        marker = {"format": plan.FORMAT, "step": step, "time": now,
                  "datetime": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(),
                  "parts": sorted(p.name for p in tmp.iterdir()), "world_size": progress.get("world_size")}
        publish(tmp, final, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    marker["path"] = str(final)
    try:
        doomed = plan.to_delete(scan(directory), keep, published=final.name)
    except OSError as exc:  # the checkpoint is published: a failed retention must not undo that
        log.warning("retention skipped after publishing %s: cannot list %s: %s", final, directory, exc)
        doomed = []
    for name in doomed:
        retire(directory / name)
    return marker


def retire(path: Path) -> bool:
    """Delete a published checkpoint (retention): first renamed to a temporary name, which no
    reader picks and the next cut removes, then removed. ``shutil.rmtree`` alone removed files in
    directory order, so a deletion that failed or was killed part-way (a read-only file, EBUSY, a
    SIGKILL during minutes of unlinking on a network volume) left ``ckpt-<step>`` with its
    ``COMPLETE`` marker and some of its files gone: a resume could pick it. Failures are logged
    with the path; False when the checkpoint is still published."""
    trash = path.with_name(plan.TMP_PREFIX + "del-" + path.name)
    try:
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(path, trash)
    except OSError as exc:
        log.warning("retention: cannot delete checkpoint %s (it stays published): %s", path, exc)
        return False
    try:
        shutil.rmtree(trash)
    except OSError as exc:
        log.warning("retention: checkpoint %s unpublished but not all of it removed (%s); the next checkpoint "
                    "tries again: %s", path, trash, exc)
    return True


class PeriodicCheckpointing:
    """Mixin of ``TrainCtx`` (needs ``rank``, ``world_size``, ``bus``, ``model``, ``dense_optimizer``,
    ``_control_group``, ``_wait_for_updates``, ``dump_checkpoint``, ``load_checkpoint``)."""

    def _init_checkpointing(self, settings: plan.CheckpointSettings) -> None:
        self.checkpoint_settings = settings
        self.step = 0
        self.start_step = 0
        self.resumed_from: str | None = None
        self.last_checkpoint: dict | None = None
        # how long each of the latest periodic checkpoints took (all of them: /metrics' histogram)
        self.checkpoint_seconds: deque[float] = deque(maxlen=CHECKPOINT_TIMES_KEPT)
        self.checkpoint_failures = 0
        self._trained_per_loader: dict[int, int] = {}
        self._base_positions: dict[int, int] = {}  # this run's positions when training started
        self._earlier_runs: list[dict] = []  # positions of runs with another NN world size
        self._resume_info: dict | None = None
        self._last_ckpt_step = 0
        self._last_ckpt_time = time.monotonic()
        self._in_backward = False
        self._final_done = False
        self._old_sigterm = None
        self._sigterm_at: float | None = None  # set by the handler: a plain store, no lock
        self._sigterm_said = False
        self._grace = 0.0
        self._watchdog_off = False

    @property
    def _ckpt_dir(self) -> Path | None:
        d = self.checkpoint_settings.checkpoint_dir
        return Path(d) if d else None

    # -- resume -----------------------------------------------------------------------------------
    def _resume_at_enter(self) -> None:
        """Load what ``resume`` names before any data loader is answered; every rank loads the
        dense part, rank 0 the embeddings (stage on every PS, then commit)."""
        directory, s = self._ckpt_dir, self.checkpoint_settings
        if directory is not None and self.rank == 0:
            try:
                with dir_lock(directory, "resume's clean-up", wait_s=0.0):
                    remove_stale(directory)  # left by a killed writer
            except CheckpointDirBusy as exc:  # another job writes there now: its files are not stale
                log.warning("%s; its temporary files are left alone", exc)
        complete = scan(directory) if directory is not None else []
        choice = plan.resume_choice(s.resume, complete, own_checkpoints(directory, complete))
        if choice is None:
            return
        where, name = choice
        path = directory / name if where == "dir" else Path(name)
        if where == "path" and not path.is_dir():  # named, not at the first file the load misses
            raise PersiaValidationError(f"resume={name!r} (from {s.resume_source}) must be 'auto', 'never' or an "
                                        "existing checkpoint directory")
        progress = read_progress(path)
        t0 = time.monotonic()
        if self.rank == 0:
            self.load_checkpoint(str(path))
        else:
            self._load_dense_only(path)
        self._barrier()
        self.step = self.start_step = int(progress["step"])
        self._last_ckpt_step = self.step
        self.resumed_from = str(path)
        self._earlier_runs, self._trained_per_loader = plan.continue_positions(progress, self.world_size, self.rank)
        self._base_positions = dict(self._trained_per_loader)
        self._resume_info = {"step": self.step, "world_size": progress.get("world_size"),
                             "loader_size": progress.get("loader_size"),
                             "loaders": progress["loaders"], "earlier": progress.get("earlier") or [],
                             "path": str(path)}
        log.info("resumed from %s: step %d, loader positions %s%s (%.2fs)", path, self.step, progress["loaders"],
                 _other_world(progress, self.world_size), time.monotonic() - t0)

    def _load_dense_only(self, path: Path) -> None:
        for apply in self._dense_appliers(path, "dense.pt", "opt.pt", None):
            apply()

    def _serve_checkpoint_subjects(self) -> list:
        """Every rank answers ``nn.position.<rank>`` (where a data loader restarted in place
        resumes); rank 0 answers ``checkpoint.latest`` (docs/architecture.md, "Checkpoints"; the operator reads it)."""
        from persia.messages import NoPayload

        subs = [self.bus.serve(subject("nn", "position", self.rank), lambda _req: self._live_position(),
                               blocking=False, schema=NoPayload)]
        if self.rank != 0:
            return subs

        def latest(_req):
            last = self.last_checkpoint or {}
            return {"step": last.get("step"), "time": last.get("time"), "path": last.get("path"),
                    "resumed_from": self.resumed_from}

        return subs + [self.bus.serve(subject("checkpoint", "latest"), latest, blocking=False, schema=NoPayload)]

    def _live_position(self) -> dict:
        """``nn.position.<rank>``: per data loader, how many of its batches to this rank are spent
        in this run: its position when training started (a checkpoint's, or 0) plus every batch
        this rank has acknowledged from it since, whatever its process. A data loader restarted in
        place (``restartPolicy: OnFailure``: the NN ranks train on) replays its stream and skips
        them (``persia.data_loader.resume.live_resume``), so each batch is trained once:

        * an acknowledged batch is this rank's: it is trained, skipped as non-finite, or lost with
          its ID features (a process killed between its two legs; ``lost_id_features``), all of
          which a resend must not repeat; or it is abandoned because training stops, and then the
          job restarts from a checkpoint, whose positions count only the consumed batches;
        * a batch the killed process sent but this rank never acknowledged (not arrived, or
          answered busy) is not counted and is sent again, under the new process's session;
        * what was acknowledged is a prefix of what the process sent here: it waits for both legs
          of a batch before it sends the next. The one window is the dead process's last request
          still on its way or waiting for room (``busy_wait_s``, 0.5 s) when the new process asks;
          a restarted process takes seconds to get here (start, imports, NATS, discovery).

        Trained counts alone (what a checkpoint records) would send the acknowledged but untrained
        batches again while this rank still trains them: twice."""
        stream = self.__dict__.get("_rank_streams", {}).get(self.rank)
        delivered = stream.delivered_by_loader() if stream is not None else {}
        loaders = {str(l): self._base_positions.get(l, 0) + delivered.get(l, 0)
                   for l in set(self._base_positions) | set(delivered)}
        return {"rank": self.rank, "world_size": self.world_size, "earlier": self._earlier_runs, "loaders": loaders}

    # -- per step ---------------------------------------------------------------------------------
    def _count_trained(self, loader: int | None, outcome: str = "trained") -> None:
        """A step was made with a batch of ``loader`` (trained, or skipped as non-finite)."""
        self.step += 1
        self._advance_position(loader, outcome)

    def _advance_position(self, loader: int | None, outcome: str) -> None:
        """A batch of ``loader`` ended in ``outcome`` (trained, or reached and not trained: its ID
        features lost, the uneven tail DDP ranks drop); its loader's position moves past it when
        the outcome counts (``checkpoint_plan.advances_position``)."""
        if loader is not None and plan.advances_position(outcome):
            self._trained_per_loader[loader] = self._trained_per_loader.get(loader, 0) + 1

    def _after_step(self) -> None:
        """After a whole step: a periodic checkpoint when due, the end when SIGTERM asked for it
        (agreed by every rank, so they checkpoint and stop at the same step)."""
        s = self.checkpoint_settings
        due = plan.is_due(s, self.step, self._last_ckpt_step, time.monotonic() - self._last_ckpt_time)
        stop = self._sigterm_at is not None  # SIGTERM arrived
        if self.world_size > 1 and self._control_group is not None:
            flags = torch.tensor([0 if due else 1, 0 if stop else 1], dtype=torch.int32)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=self._control_group)
            due, stop = flags[0].item() == 0, flags[1].item() == 0
        if stop:
            self._say_sigterm()
        if (due or stop) and self._ckpt_dir is not None:
            self.save_checkpoint()
        if stop:
            self._final_done = True
            raise GracefulStop()

    # -- the cut ----------------------------------------------------------------------------------
    def save_checkpoint(self) -> dict | None:
        """Write and publish a checkpoint of the current step into ``checkpoint_dir`` (every rank
        calls it at the same step). Returns the published marker on rank 0, None when the write
        failed (logged as an error and counted in ``checkpoint_failures``; training goes on)."""
        directory = self._ckpt_dir
        if directory is None:
            raise ValueError("save_checkpoint needs a checkpoint_dir (checkpointing_config, PERSIA_CHECKPOINT_DIR "
                             "or TrainCtx(checkpoint_dir=...))")
        if self.step == self._last_ckpt_step:  # the same on every rank, so all of them return here
            return self.last_checkpoint  # nothing trained since the last one (or since the resume)
        t0 = time.monotonic()
        self._wait_for_updates()
        per_rank = self._gather_positions()
        marker = None
        if self.rank == 0:
            try:
                marker = self._write_cut(directory, per_rank)
            except Exception as exc:  # noqa: BLE001 - a full disk must not end days of training
                self.checkpoint_failures += 1
                self._checkpoint_metric("inc", "checkpoint_failures")
                # after a resume, the checkpoint resumed from is the last one (it said "None")
                stands = (self.last_checkpoint or {}).get("path") or self.resumed_from
                log.error("checkpoint of step %d failed, training goes on (the last published checkpoint, %s, "
                          "stands): %s: %s", self.step, stands or "none yet", type(exc).__name__, exc)
        self._barrier()
        self._last_ckpt_step, self._last_ckpt_time = self.step, time.monotonic()
        elapsed = time.monotonic() - t0
        if marker is not None:
            self.checkpoint_seconds.append(elapsed)
            self._checkpoint_metric("observe", "checkpoint_time_cost_sec", elapsed)
            log.info("checkpoint step %d published at %s (%.2fs)", self.step, marker["path"], elapsed)
        return marker

    def _checkpoint_metric(self, op: str, name: str, *args) -> None:
        metrics = getattr(self, "metrics", None)  # the NN worker's (TrainCtx), on /metrics
        if metrics is not None:
            getattr(metrics, op)(name, *args)

    def _write_cut(self, directory: Path, per_rank: list[dict[int, int]]) -> dict:
        progress = {"step": self.step, "world_size": self.world_size, "loaders": plan.merge_positions(per_rank)}
        if os.environ.get(plan.ENV_RUN_ID):  # a restart of this run resumes here, whatever resume says
            progress["run_id"] = os.environ[plan.ENV_RUN_ID]
        loaders = self._loader_size()
        if loaders is not None:  # a resume with another number is refused (data_loader.resume)
            progress["loader_size"] = loaders
        if self._earlier_runs:  # runs with other world sizes (only after such a resume)
            progress["earlier"] = self._earlier_runs
        # dense.pt, opt.pt, every PS shard, embedding_dump_done
        marker = write_cut(directory, progress, lambda tmp: self.dump_checkpoint(str(tmp)),
                           self.checkpoint_settings.keep)
        self.last_checkpoint = marker
        try:
            self.bus.publish(subject("checkpoint", "published"),
                             {"step": marker["step"], "time": marker["time"], "path": marker["path"]})
        except Exception as exc:  # noqa: BLE001 - the checkpoint is on disk; the event is informative
            log.warning("could not publish the checkpoint event: %s", exc)
        return marker

    def _loader_size(self) -> int | None:
        """How many data loaders feed this job: as their batches say (this rank's stream), else as
        the resumed checkpoint recorded it; None when neither knows (older loaders)."""
        stream = self.__dict__.get("_rank_streams", {}).get(self.rank)
        if stream is not None and stream.loader_size is not None:
            return int(stream.loader_size)
        return (self._resume_info or {}).get("loader_size")

    def _gather_positions(self) -> list[dict[int, int]]:
        """Every rank's per-loader trained counts (on rank 0), as int64 tensors over gloo: no pickle."""
        if self.world_size <= 1 or self._control_group is None:
            return [dict(self._trained_per_loader)]
        group = self._control_group
        size = torch.tensor([max(self._trained_per_loader, default=-1) + 1], dtype=torch.int64)
        torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=group)
        mine = torch.zeros(int(size.item()), dtype=torch.int64)
        for loader, n in self._trained_per_loader.items():
            mine[loader] = n
        parts = [torch.zeros_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, mine, group=group)
        return [{i: int(v) for i, v in enumerate(p.tolist()) if v} for p in parts]

    def _barrier(self) -> None:
        if self.world_size > 1 and self._control_group is not None:
            torch.distributed.barrier(group=self._control_group)

    # -- SIGTERM ----------------------------------------------------------------------------------
    def _install_sigterm(self) -> None:
        """SIGTERM: finish the step in progress, flush updates, final checkpoint when configured,
        exit 143; a watchdog ends the process at the grace period whatever happens. Installed
        after the NATS connection exists (a role that cannot connect keeps the default action),
        and the handler never blocks."""
        if threading.current_thread() is not threading.main_thread():
            return
        grace = self._grace = grace_period_s()

        def on_sigterm(signum, _frame):
            # Only plain stores and a raise here: logging or starting a thread takes locks the
            # interrupted main thread may hold (Thread.start's limbo lock, a handler's lock).
            if self._sigterm_at is not None:
                raise GracefulStop()
            self._sigterm_at = time.monotonic()
            if not self._in_step:
                raise GracefulStop()

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        self._watchdog_off = False
        threading.Thread(target=self._sigterm_watchdog, args=(grace,), name="persia-sigterm-watchdog",
                         daemon=True).start()

    def _sigterm_watchdog(self, grace: float, poll_s: float = 0.2) -> None:
        """Says that SIGTERM arrived and ends the process at the grace period whatever happens;
        polls what the handler stored (the handler itself never blocks)."""
        while True:
            at = self._sigterm_at
            if at is None:
                if self._watchdog_off:
                    return
            else:
                self._say_sigterm()
                if time.monotonic() - at >= max(1.0, grace - 1.0):
                    _out_of_time(grace)
            time.sleep(poll_s)

    def _say_sigterm(self) -> None:
        """The one warning that SIGTERM is being honoured (main thread or watchdog, first wins)."""
        if not self._sigterm_said:
            self._sigterm_said = True
            log.warning("SIGTERM: stopping after the current step (grace period %.0fs)", self._grace)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        self._watchdog_off = True  # ends the watchdog unless a SIGTERM is being honoured

    def _stop_between_steps(self) -> None:
        """SIGTERM arrived between steps (every update of a trained step is flushed by the caller):
        the final checkpoint, on one rank only (several ranks cannot agree outside a step)."""
        self._say_sigterm()
        if self._final_done or self._ckpt_dir is None:
            return
        self._final_done = True
        if self.world_size > 1:
            log.warning("SIGTERM between steps with %d ranks: no final checkpoint (the last periodic one stands)",
                        self.world_size)
            return
        self.save_checkpoint()


def _other_world(progress: dict, world_size: int) -> str:
    saved = progress.get("world_size")
    if saved is None or int(saved) == world_size:
        return ""
    return f" written by {saved} NN ranks, mapped onto {world_size} (data loaders skip what those ranks trained)"


def _out_of_time(grace: float) -> None:
    log.error("SIGTERM: still running after %.0fs (PERSIA_GRACE_PERIOD_SECONDS); exiting now", grace)
    logging.shutdown()
    os._exit(128 + signal.SIGTERM)
