"""Incremental updates (PERSIA's ``enable_incremental_update``): a training PS ships the rows its
gradients changed to timestamped packet directories; an inference PS applies new packets.

::

    <incremental_dir>/s<i>/inc_<YYYYmmddHHMMSS>_<usec>_<seq>/
        dim_<d>_part_<j>.inc      same format as checkpoint files (kind = incremental)
        inc_update_done           JSON manifest, written last

A packet is written once ``incremental_buffer_size`` distinct signs have changed (or on
``flush``/``close``), by a background thread: ``update`` only appends the changed signs to a list.
The packet name is taken once per packet (PERSIA took it per chunk, so chunks could straddle two
directories). Rows carry their current weights and optimizer state; evicted rows are skipped
(deletions are not shipped, as in PERSIA).

Packets are kept ``retention_s`` (``incremental_retention_seconds``, default a day): after each
packet it writes, a training PS deletes its own older ones (PERSIA kept them all: a packet per
``incremental_buffer_size`` changed rows, about 136 MB at dim 16, until the disk filled). An
inference PS that falls further behind than that misses the deleted packets' rows until they change
again or it loads a newer checkpoint; it forgets the packets that are gone, so what it remembers and
scans stays bounded too.

Failures are not silent: a packet that cannot be written (disk full, an NFS hiccup) keeps its rows
pending for the next packet (at most ``max_retained`` of them) and is counted in
``write_failures``; ``flush`` and ``close`` raise while rows are left unshipped. An inference PS
whose ``incremental_dir`` does not exist logs an error (once per change) and says so in
``dir_missing``.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from persia.embedding_ps import checkpoint as ckpt
from persia.env import float_in_range
from persia.hashing import PS_SHARD_SALT, shard_of

if TYPE_CHECKING:  # pragma: no cover
    from persia.embedding_ps.store import EmbeddingStore

log = logging.getLogger(__name__)

INC_DONE_MARKER = "inc_update_done"
INCOMPLETE_GRACE_S = 600.0  # a packet without its marker this old was left by a killed writer
INC_FORMAT = "persia-embedding-ps-inc/1"
_ANY_DIM = 0  # key of signs recorded without a dim: looked up in every dim when written
POLL_ENV = "PERSIA_INCREMENTAL_POLL_SECONDS"
DEFAULT_POLL_S = 10.0  # PERSIA's inference PS scans every 10 s
MIN_POLL_S, MAX_POLL_S = 0.01, 86_400.0


def poll_interval_s(environ=None) -> float:
    """``PERSIA_INCREMENTAL_POLL_SECONDS`` (default 10): how often an inference PS scans for new
    packets. 0, a negative number or NaN would make the poll loop spin, and a typo ("10s") must name
    the variable: a ValueError says which, the range and the value."""
    environ = os.environ if environ is None else environ
    raw = environ.get(POLL_ENV, "").strip()
    if raw == "":
        return DEFAULT_POLL_S
    return float_in_range(POLL_ENV, raw, MIN_POLL_S, MAX_POLL_S, "seconds")


class IncrementalDumper:
    """Collects changed signs of a training store and writes them as packets in the background.

    With ``attach`` (default) it listens to the store's updates itself, so callers need not call
    :meth:`record`; ``record`` is for signs changed some other way. The signs of a packet that
    failed to write stay pending (the next packet retries them); beyond ``max_retained`` (default
    ``max(4 * buffer_size, 2**20)`` distinct signs) the excess is dropped, logged and counted in
    ``rows_dropped``.
    """

    def __init__(
        self,
        store: "EmbeddingStore",
        incremental_dir: str | Path,
        replica_index: int,
        buffer_size: int,
        num_workers: int = 4,
        *,
        attach: bool = True,
        fsync: bool = True,
        max_retained: int | None = None,
        retention_s: float = 0.0,
    ):
        if buffer_size <= 0:
            raise ValueError(f"incremental_buffer_size must be positive, got {buffer_size}")
        self.store = store
        self.directory = Path(incremental_dir) / f"s{int(replica_index)}"
        self.replica_index = int(replica_index)
        self.buffer_size = int(buffer_size)
        self.num_workers = max(1, int(num_workers))
        self.fsync = fsync
        self.max_retained = max(1, int(max_retained or max(4 * self.buffer_size, 1 << 20)))
        self.retention_s = float(retention_s)  # 0: keep every packet
        self.packets_deleted = 0
        self.packets_written = 0
        self.rows_written = 0
        self.write_failures = 0  # packets that could not be written (their rows stay pending)
        self.rows_dropped = 0  # changed signs given up on: more failed rows than max_retained
        self.last_error: BaseException | None = None  # of the latest write; None once one succeeds
        self._pending: dict[int, list[np.ndarray]] = {}
        self._pending_count = 0
        self._next_check = self.buffer_size
        self._flush_requested = 0  # flush generations: asked for / written
        self._flush_done = 0
        self._closing = False
        self._seq = 0
        self._cond = threading.Condition()
        self.incomplete_removed = self._remove_incomplete(time.time())
        self._thread = threading.Thread(target=self._run, name=f"ps-incremental-{replica_index}", daemon=True)
        self._thread.start()
        self._attached = attach
        if attach:
            store.add_update_listener(self._on_update)

    def _on_update(self, dim: int, signs: np.ndarray) -> None:
        self.record(signs, dim)

    def record(self, signs: np.ndarray, dim: int | None = None) -> None:
        """Remember that these signs' rows (of ``dim``, or of any dim) changed."""
        signs = np.asarray(signs, dtype=np.uint64)
        if signs.size == 0:
            return
        with self._cond:
            if self._closing:  # an update racing shutdown: its rows miss the last packet
                log.warning("incremental dumper closed: %d changed signs not shipped", signs.shape[0])
                return
            self._pending.setdefault(int(dim) if dim else _ANY_DIM, []).append(signs.copy())
            self._pending_count += signs.shape[0]
            if self._pending_count > 2 * self.max_retained:  # the writer is stuck (a hung mount)
                self._compact_pending()
            if self._pending_count >= self._next_check:
                self._cond.notify_all()

    def _compact_pending(self) -> None:
        """Under the lock, while a write hangs: the pending signs deduplicated, and beyond
        ``max_retained`` distinct ones dropped (logged, counted in ``rows_dropped``): an update
        stream of a million IDs a second kept every copy until memory ran out."""
        batch = {d: np.unique(np.concatenate(arrs)) for d, arrs in self._pending.items() if arrs}
        distinct = sum(a.shape[0] for a in batch.values())
        kept, distinct = self._bound(batch, distinct)
        self._pending = {d: [a] for d, a in kept.items()}
        self._pending_count = distinct

    def flush(self, timeout: float | None = 60.0) -> None:
        """Write whatever is pending now and wait until it is on disk; a RuntimeError if that write
        failed (its rows stay pending: the next flush or packet retries them)."""
        with self._cond:
            self._flush_requested += 1
            wanted = self._flush_requested
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._flush_done >= wanted, timeout):
                raise TimeoutError("incremental packet not written in time")
            error, unshipped = self.last_error, self._pending_count
        if error is not None:
            raise RuntimeError(
                f"incremental dump to {self.directory} failed, {unshipped} changed signs pending: {error}"
            ) from error

    def close(self) -> None:
        """Write what is pending, stop the writer thread and detach from the store. Raises a
        RuntimeError if that last packet failed: its rows never reach the inference PSs, and a PS
        shutting down must say so rather than exit as if they had."""
        if self._attached:
            self.store.remove_update_listener(self._on_update)
            self._attached = False
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self.last_error is not None:
            raise RuntimeError(
                f"incremental dump to {self.directory} failed at shutdown: {self._pending_count} changed "
                f"signs not shipped ({self.write_failures} failed writes, {self.rows_dropped} signs dropped "
                f"earlier): {self.last_error}"
            ) from self.last_error

    # -- writer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closing
                    or self._flush_requested > self._flush_done
                    or self._pending_count >= self._next_check
                )
                serving = self._flush_requested  # every flush asked so far is served by this round
                closing = self._closing
                forced = closing or serving > self._flush_done
                pending, self._pending, self._pending_count = self._pending, {}, 0
            # deduplicate outside the lock: update() keeps appending meanwhile
            batch = {d: np.unique(np.concatenate(arrs)) for d, arrs in pending.items() if arrs}
            distinct = sum(a.shape[0] for a in batch.values())
            attempted, error = False, None
            if distinct and (forced or distinct >= self.buffer_size):
                attempted = True
                try:
                    self.write_packet(batch)
                except Exception as exc:  # keep serving and keep the rows; flush()/close() report it
                    error = exc
                    log.exception("incremental packet write to %s failed (%d changed signs kept for the next "
                                  "packet)", self.directory, distinct)
                    batch, distinct = self._bound(batch, distinct)
                else:
                    batch, distinct = {}, 0
            with self._cond:
                if attempted:
                    self.last_error = error
                    self.write_failures += error is not None
                if distinct:  # not enough distinct signs yet, or not written: keep them, look again later
                    for d, arr in batch.items():
                        self._pending.setdefault(d, []).insert(0, arr)
                    self._pending_count += distinct
                    self._next_check = distinct + max(self.buffer_size - distinct, distinct // 2)
                else:
                    self._next_check = self.buffer_size
                self._flush_done = max(self._flush_done, serving)
                self._cond.notify_all()
            if closing:
                return

    def _bound(self, batch: dict[int, np.ndarray], distinct: int) -> tuple[dict[int, np.ndarray], int]:
        """At most ``max_retained`` of a failed packet's signs, kept for the next one: a write that
        keeps failing must not grow the pending set without bound."""
        if distinct <= self.max_retained:
            return batch, distinct
        kept, room = {}, self.max_retained
        for d, arr in batch.items():
            kept[d], room = arr[:room], room - min(room, arr.shape[0])
        self.rows_dropped += distinct - self.max_retained
        log.error("incremental dump to %s keeps failing: %d changed signs dropped (more than %d pending); "
                  "their rows reach the inference PSs only when they change again",
                  self.directory, distinct - self.max_retained, self.max_retained)
        return {d: a for d, a in kept.items() if a.shape[0]}, self.max_retained

    def write_packet(self, batch: dict[int, np.ndarray]) -> Path | None:
        """Write one packet directory with the current rows of ``batch`` (dim -> signs)."""
        parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]] = []
        for dim, signs in batch.items():
            for d in ([dim] if dim != _ANY_DIM else self.store.dims()):
                found, weights, state, code = self.store.read_rows(signs, d)
                if found.shape[0]:
                    parts.append((d, found, weights, state, code))
        if not parts:
            return None
        now = _dt.datetime.now(_dt.timezone.utc)
        self._seq += 1
        pdir = self.directory / f"inc_{now:%Y%m%d%H%M%S}_{now.microsecond:06d}_{self._seq:06d}"
        pdir.mkdir(parents=True, exist_ok=False)
        try:
            jobs = []
            for d, found, weights, state, code in parts:
                chunks = np.array_split(np.arange(found.shape[0]), min(self.num_workers, found.shape[0]))
                for j, idx in enumerate(chunks):
                    jobs.append((pdir / f"dim_{d}_part_{j}.inc", found[idx], weights[idx], state[idx], code))
            with ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="ps-inc") as pool:
                entries = list(pool.map(
                    lambda job: ckpt.write_rows_file(*job, kind=ckpt.KIND_INCREMENTAL, fsync=self.fsync), jobs
                ))
            rows = sum(e["rows"] for e in entries)
            ckpt.write_json_atomic(pdir / INC_DONE_MARKER, {
                "format": INC_FORMAT, "replica_index": self.replica_index, "rows": rows,
                "created_unix": now.timestamp(), "files": entries,
            }, fsync=self.fsync)
        except BaseException:  # no half-written packet left behind: the retry writes a new one
            shutil.rmtree(pdir, ignore_errors=True)
            raise
        self.packets_written += 1
        self.rows_written += rows
        if self.retention_s > 0:
            self._delete_older_than(now.timestamp() - self.retention_s)
        self.incomplete_removed += self._remove_incomplete(now.timestamp())  # a restart within the grace
        return pdir

    def _remove_incomplete(self, now_unix: float) -> int:
        """Remove the packets of this replica that a killed process left half-written (no done
        marker: no reader ever applies them), kept until the retention otherwise, for good with
        retention 0. Only those older than ``INCOMPLETE_GRACE_S`` by their names: a replica's
        previous process is gone by then, and no packet takes that long to write. At the start
        and after each packet (a process restarted within the grace finds it later)."""
        removed = self._remove_packets(
            lambda packet, created: abandoned_packet(created, (packet / INC_DONE_MARKER).exists(), now_unix),
            "incomplete incremental packet %s not removed: %s")
        for packet in removed:
            log.warning("removed incomplete incremental packet %s (its writer was killed while writing it)", packet)
        return len(removed)

    def _delete_older_than(self, cutoff_unix: float) -> None:
        """Remove this replica's packets created before ``cutoff_unix`` (by their names: no
        manifest is read). A failure is logged; the next packet's round tries again."""
        self.packets_deleted += len(self._remove_packets(
            lambda _packet, created: created is not None and created < cutoff_unix,
            "incremental packet %s not deleted after its retention: %s"))

    def _remove_packets(self, doomed, failure: str) -> list[Path]:
        """Remove this replica's packet directories for which ``doomed(path, created)`` holds
        (``created``: the time in its name); the ones removed. A failure is logged (``failure``)."""
        if not self.directory.is_dir():
            return []
        removed = []
        for packet in sorted(self.directory.glob("inc_*")):
            if not doomed(packet, packet_time(packet.name)):
                continue
            try:
                shutil.rmtree(packet)
            except OSError as exc:
                log.warning(failure, packet, exc)
                continue
            removed.append(packet)
        return removed


def abandoned_packet(created_unix: float | None, complete: bool, now_unix: float,
                     grace_s: float | None = None) -> bool:
    """Whether a packet directory is one a killed writer left half-written (pure): no done marker,
    and named more than ``grace_s`` (``INCOMPLETE_GRACE_S``) ago; a name that is not a packet's is
    never one."""
    grace = INCOMPLETE_GRACE_S if grace_s is None else grace_s
    return created_unix is not None and not complete and now_unix - created_unix > grace


def packet_time(name: str) -> float | None:
    """The creation time (unix seconds, UTC) in a packet directory's name, None for another name."""
    parts = name.split("_")
    if len(parts) != 4 or parts[0] != "inc":
        return None
    try:
        stamp = _dt.datetime.strptime(parts[1], "%Y%m%d%H%M%S").replace(tzinfo=_dt.timezone.utc)
        return stamp.timestamp() + int(parts[2]) / 1e6
    except ValueError:
        return None


def complete_packets(incremental_dir: str | Path) -> list[Path]:
    """Every finished packet under ``incremental_dir`` (all training replicas), oldest first."""
    base = Path(incremental_dir)
    if not base.is_dir():
        return []
    packets = [p for p in base.glob("s*/inc_*") if p.is_dir() and (p / INC_DONE_MARKER).exists()]
    return sorted(packets, key=lambda p: (p.name, p.parent.name))


def read_packet(packet: Path, replica_index: int, replica_size: int) -> tuple[float, dict[int, ckpt.RowsPart]]:
    """The packet's creation time and its rows that belong to this replica, by dim."""
    manifest = ckpt.read_manifest(packet / INC_DONE_MARKER)
    if manifest.get("format") != INC_FORMAT or not isinstance(manifest.get("files"), list):
        raise ckpt.CheckpointError(f"{packet}: not an incremental packet manifest ({manifest.get('format')!r})")
    parts = []
    listed: set[str] = set()
    for entry in manifest["files"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "/" in entry["file"]:
            raise ckpt.CheckpointError(f"{packet}: malformed file entry {entry!r}")
        if entry["file"] in listed:
            raise ckpt.CheckpointError(f"{packet}: the manifest lists {entry['file']} twice")
        listed.add(entry["file"])
        path = packet / entry["file"]
        header, part = ckpt.read_rows_file(path, entry)
        if header.kind != ckpt.KIND_INCREMENTAL:
            raise ckpt.CheckpointError(f"{path}: a checkpoint file, not an incremental packet")
        if replica_size > 1:
            mine = shard_of(part.signs, replica_size, PS_SHARD_SALT) == replica_index
            part = ckpt.RowsPart(part.dim, part.state_code, part.signs[mine], part.weights[mine], part.state[mine])
        parts.append((path, part))
    by_dim = ckpt.merge_parts(parts)
    for dim, part in by_dim.items():  # what store.upsert would refuse, refused before any dim is applied
        if part.signs.shape[0] and np.unique(part.signs).shape[0] != part.signs.shape[0]:
            raise ckpt.CheckpointError(f"{packet}: rows of dim {dim} list a sign twice (its files overlap)")
    created = manifest.get("created_unix", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise ckpt.CheckpointError(f"{packet}: created_unix is not a number: {created!r}")
    return float(created), by_dim


READ_ATTEMPTS = 3  # polls in which a packet that hit an I/O error is read before it is rejected


def read_failure(exc: BaseException, attempts: int, max_attempts: int = READ_ATTEMPTS) -> str:
    """What an inference PS does about a packet whose read failed for the ``attempts``-th time
    (pure): ``"retry"`` at the next poll, applying no later packet meanwhile (a later packet
    applied first would be overwritten with older rows by the retried one), or ``"reject"``.
    An I/O error (EIO, ESTALE on NFS, EACCES until a volume's permissions are fixed) may pass;
    every packet was rejected at its first failure, and its rows never reached the served model
    until they changed again. A packet that is gone (retention) or invalid is rejected at once."""
    err = exc if isinstance(exc, OSError) else exc.__context__
    if not isinstance(err, OSError) or isinstance(err, (FileNotFoundError, NotADirectoryError)):
        return "reject"
    return "retry" if attempts < max_attempts else "reject"


class IncrementalApplier:
    """Inference side: applies packets it has not applied yet to a store, oldest first.

    Call :meth:`poll` (or :meth:`start` a thread polling every ``interval`` seconds). A packet that
    cannot be read, or fails in any way, is logged with the reason, counted in ``rejected`` and not
    retried; the packets after it are applied as usual. An I/O error reading it is retried first
    (``read_failure``: up to ``READ_ATTEMPTS`` polls, later packets waiting). A packet is read and validated whole (every
    file, no sign twice in a dim) before any of its rows is written, so only an unexpected store
    failure can leave one partly applied (logged with the rows written). A missing
    ``incremental_dir`` (a typo, a volume mounted elsewhere) would leave the served embeddings
    frozen without a word: it is logged as an error when first seen missing (again only after it
    has appeared meanwhile) and ``dir_missing`` says so until it exists.
    """

    def __init__(self, store: "EmbeddingStore", incremental_dir: str | Path, replica_index: int, replica_size: int):
        if not 0 <= replica_index < replica_size:
            raise ValueError(f"replica_index {replica_index} is not in [0, replica_size={replica_size})")
        self.store = store
        self.directory = Path(incremental_dir)
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.applied: set[str] = set()  # of the packets still there (pending() prunes the rest)
        self.rejected: set[str] = set()
        self.read_attempts: dict[str, int] = {}  # packets whose read failed with an I/O error, retried
        self.packets_applied = self.packets_rejected = 0  # since start, deleted packets included
        self.rows_applied = 0
        self.last_delay_sec: float | None = None  # PERSIA's inc_update_delay_sec
        self.dir_missing = False  # as of the latest poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pending(self) -> list[Path]:
        """The complete packets not applied (nor rejected) yet. Packets deleted after their
        retention are forgotten, so the sets stay as small as the directory."""
        packets = complete_packets(self.directory)
        present = {str(p.relative_to(self.directory)) for p in packets}
        self.applied &= present
        self.rejected &= present
        self.read_attempts = {k: n for k, n in self.read_attempts.items() if k in present}
        seen = self.applied | self.rejected
        return [p for p in packets if str(p.relative_to(self.directory)) not in seen]

    def poll(self) -> int:
        """Apply every new complete packet; returns the number of rows written."""
        self._check_directory()
        written = 0
        for packet in self.pending():
            key = str(packet.relative_to(self.directory))
            try:
                # read and validated whole (every file, every dim) before any row is written
                created, by_dim = read_packet(packet, self.replica_index, self.replica_size)
            except Exception as exc:  # noqa: BLE001 - any failure rejects this packet, not the later ones
                attempts = self.read_attempts[key] = self.read_attempts.get(key, 0) + 1
                if read_failure(exc, attempts) == "retry":
                    log.warning("incremental packet %s could not be read (attempt %d of %d; read again at the next "
                                "poll, later packets wait for it): %s: %s", packet, attempts, READ_ATTEMPTS,
                                type(exc).__name__, exc)
                    break
                self.read_attempts.pop(key, None)
                log.error("incremental packet %s rejected (nothing applied): %s: %s", packet, type(exc).__name__, exc)
                self.rejected.add(key)
                self.packets_rejected += 1
                continue
            done = 0
            try:
                for dim, part in by_dim.items():
                    if part.signs.shape[0]:
                        done += self.store.upsert(part.signs, dim, part.weights, part.state, part.state_code)
            except Exception as exc:  # noqa: BLE001 - not retried: every later poll would fail on it
                written += done
                log.error("incremental packet %s rejected while applied (%d of its rows already written): %s: %s",
                          packet, done, type(exc).__name__, exc)
                self.rejected.add(key)
                self.packets_rejected += 1
                continue
            written += done
            self.read_attempts.pop(key, None)
            self.applied.add(key)
            self.packets_applied += 1
            if created:
                self.last_delay_sec = max(0.0, _dt.datetime.now(_dt.timezone.utc).timestamp() - created)
        self.rows_applied += written
        return written

    def _check_directory(self) -> None:
        """Log when ``incremental_dir`` goes missing or comes back: once per change, not per poll."""
        missing = not self.directory.is_dir()
        if missing and not self.dir_missing:
            log.error("incremental_dir %s does not exist (embedding_parameter_server_config.incremental_dir): "
                      "no incremental packets are applied and the served embeddings stay as they are until it "
                      "does; check the path and the volume mounted there (the training PS creates it with "
                      "its first packet)", self.directory)
        elif self.dir_missing and not missing:
            log.info("incremental_dir %s exists now: applying its packets", self.directory)
        self.dir_missing = missing

    def start(self, interval: float = DEFAULT_POLL_S) -> None:
        """Poll in a daemon thread every ``interval`` seconds until :meth:`stop`."""
        if not interval > 0:  # 0, negative or NaN: Event.wait returns at once and the loop spins
            raise ValueError(f"incremental poll interval must be a positive number of seconds, got {interval!r}")
        if self._thread is not None:
            return
        self._stop.clear()

        def loop():
            while not self._stop.is_set():
                try:
                    self.poll()
                except Exception:  # keep polling; the next round retries
                    log.exception("incremental apply failed")
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="ps-incremental-apply", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def apply_incremental_updates(
    store: "EmbeddingStore", incremental_dir: str | Path, replica_index: int, replica_size: int,
    applied: set[str] | None = None,
) -> set[str]:
    """One-shot form of :class:`IncrementalApplier`: apply packets not in ``applied``; returns the
    updated set of applied packet names."""
    applier = IncrementalApplier(store, incremental_dir, replica_index, replica_size)
    applier.applied = set(applied or ())
    applier.poll()
    return applier.applied
