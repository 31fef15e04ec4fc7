"""Embedding checkpoint files: a versioned, checksummed binary format and the directory layout.

::

    D/embedding_dump_done                          written by the trainer once every replica is done
    D/s<i>/embedding_dump_done                     replica i's manifest (JSON), written last
    D/s<i>/replica_<i>_shard_<k>_dim_<d>.emb       rows of internal shard k with dim d

A ``.emb`` (and an incremental ``.inc``) file is a 64-byte little-endian header followed by three
raw arrays: signs (uint64), weights (float32, rows x dim), optimizer state (float32, rows x
state_width). docs/ps-storage.md has the byte table. Every reader checks magic, version, header
checksum, size and payload checksum, and the manifest's copy of the header fields, so a foreign,
truncated or corrupt file is refused with its path and the reason.
"""

from __future__ import annotations

import datetime as _dt
import json
import mmap
import os
import re
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from persia.hashing import PS_SHARD_SALT, shard_of


class ShardedRows(Protocol):
    """What dumping needs from the store (``EmbeddingStore``), named here so this module does not
    import the store that imports it."""

    num_shards: int

    def _snapshot_shard(self, k: int) -> list[tuple[Any, tuple]]: ...


MAGIC = b"PERSIAEM"
FORMAT_VERSION = 1
KIND_CHECKPOINT = 1
KIND_INCREMENTAL = 2
DONE_MARKER = "embedding_dump_done"  # PERSIA's name, per replica dir and at the top
MANIFEST_FORMAT = "persia-embedding-ps/1"

# magic, version, header_len, kind, optimizer code, dim, state width, rows, payload bytes,
# payload crc32, reserved, created (unix ms), reserved, header crc32
_HEADER = struct.Struct("<8sHHHHIIQQIIQII")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64
_REPLICA_DIR = re.compile(r"^s(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint (or incremental packet) that cannot be loaded; the message names the path."""


@dataclass
class RowsPart:
    """Rows of one dim read from checkpoint files."""

    dim: int
    state_code: int
    signs: np.ndarray
    weights: np.ndarray
    state: np.ndarray


@dataclass(frozen=True)
class FileHeader:
    kind: int
    state_code: int
    dim: int
    state_width: int
    rows: int
    payload_bytes: int
    payload_crc32: int
    created_ms: int


def payload_size(rows: int, dim: int, width: int) -> int:
    return rows * (8 + 4 * dim + 4 * width)


def encode_header(kind: int, state_code: int, dim: int, width: int, rows: int, crc: int, created_ms: int) -> bytes:
    fields = (MAGIC, FORMAT_VERSION, HEADER_SIZE, kind, state_code, dim, width, rows,
              payload_size(rows, dim, width), crc, 0, created_ms, 0)
    body = _HEADER.pack(*fields, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(raw: bytes, path: Path) -> FileHeader:
    if len(raw) < 8 or raw[:8] != MAGIC:
        raise CheckpointError(f"{path}: not a PERSIA embedding file (starts with {raw[:8]!r}, expected {MAGIC!r})")
    if len(raw) < HEADER_SIZE:
        raise CheckpointError(f"{path}: truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    (_, version, header_len, kind, code, dim, width, rows, payload, crc, _r1, created, _r2, hcrc) = _HEADER.unpack(raw)
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: written in format version {version}; this PS reads up to {FORMAT_VERSION}")
    if zlib.crc32(raw[:-4]) != hcrc:
        raise CheckpointError(f"{path}: header checksum mismatch (corrupt file)")
    if header_len != HEADER_SIZE or kind not in (KIND_CHECKPOINT, KIND_INCREMENTAL) or dim == 0:
        raise CheckpointError(f"{path}: malformed header (header_len {header_len}, kind {kind}, dim {dim})")
    if payload != payload_size(rows, dim, width):
        raise CheckpointError(f"{path}: header payload size {payload} does not match {rows} rows of dim {dim} + state {width}")
    return FileHeader(kind, code, dim, width, rows, payload, crc, created)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rows_file(
    path: Path, signs: np.ndarray, weights: np.ndarray, state: np.ndarray, state_code: int,
    *, kind: int = KIND_CHECKPOINT, fsync: bool = True,
) -> dict:
    """Write one file atomically (temp name, then rename); returns its manifest entry."""
    signs = np.ascontiguousarray(signs, dtype="<u8")
    weights = np.ascontiguousarray(weights, dtype="<f4")
    state = np.ascontiguousarray(state, dtype="<f4")
    rows, dim = weights.shape
    width = state.shape[1]
    if signs.shape != (rows,) or state.shape[0] != rows:
        raise ValueError(f"{path}: signs {signs.shape}, weights {weights.shape}, state {state.shape} disagree")
    crc = 0
    for arr in (signs, weights, state):
        crc = zlib.crc32(arr, crc)
    header = encode_header(kind, state_code, dim, width, rows, crc, int(time.time() * 1000))
    tmp = path.with_name(path.name + ".tmp")

    def write(f) -> None:
        f.write(header)
        for arr in (signs, weights, state):
            if arr.size:
                f.write(memoryview(arr).cast("B"))

    _write_replace(tmp, path, "wb", write, fsync)
    return {"file": path.name, "dim": dim, "state_width": width, "state_code": state_code,
            "rows": rows, "payload_crc32": crc}


class MappedRows:
    """A fully validated rows file, memory-mapped: ``signs``, ``weights`` and ``state`` are
    read-only views of the page cache (no copy until they are placed in a table).

    ``expect`` is the file's manifest entry: its fields must agree with the header.
    """

    def __init__(self, path: Path, expect: dict | None = None):
        self.path = path
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{path}: listed in the manifest but missing") from None
        with f:
            header = decode_header(f.read(HEADER_SIZE), path)
            size = os.fstat(f.fileno()).st_size
            if size != HEADER_SIZE + header.payload_bytes:
                what = "truncated" if size < HEADER_SIZE + header.payload_bytes else "has trailing bytes"
                raise CheckpointError(f"{path}: {what}: {size} bytes, header says {HEADER_SIZE + header.payload_bytes}")
            if expect is not None:
                for key, value in (("dim", header.dim), ("state_width", header.state_width),
                                   ("state_code", header.state_code), ("rows", header.rows),
                                   ("payload_crc32", header.payload_crc32)):
                    if key in expect and int(expect[key]) != value:
                        raise CheckpointError(f"{path}: header {key}={value} but the manifest says {expect[key]}")
            self._mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        self.header = header
        payload = memoryview(self._mm)[HEADER_SIZE:]
        try:
            crc = zlib.crc32(payload)
        finally:
            payload.release()
        if crc != header.payload_crc32:
            self.close()
            raise CheckpointError(f"{path}: payload checksum mismatch (corrupt file)")
        n, dim, width = header.rows, header.dim, header.state_width
        self.signs = np.frombuffer(self._mm, dtype="<u8", count=n, offset=HEADER_SIZE)
        self.weights = np.frombuffer(self._mm, dtype="<f4", count=n * dim, offset=HEADER_SIZE + 8 * n).reshape(n, dim)
        self.state = np.frombuffer(self._mm, dtype="<f4", count=n * width,
                                   offset=HEADER_SIZE + (8 + 4 * dim) * n).reshape(n, width)
        self.keep: np.ndarray | None = None  # rows of this replica, when re-sharding

    @property
    def rows(self) -> int:
        return self.header.rows if self.keep is None else int(np.count_nonzero(self.keep))

    def part(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(signs, weights, state) of the kept rows."""
        if self.keep is None:
            return self.signs, self.weights, self.state
        return self.signs[self.keep], self.weights[self.keep], self.state[self.keep]

    def close(self) -> None:
        self.signs = self.weights = self.state = None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view: the map closes when it is collected
            pass


def read_rows_file(path: Path, expect: dict | None = None) -> tuple[FileHeader, RowsPart]:
    """Read and fully validate one file into memory (small files: incremental packets, tests)."""
    mapped = MappedRows(path, expect)
    try:
        part = RowsPart(mapped.header.dim, mapped.header.state_code, mapped.signs.astype(np.uint64),
                        mapped.weights.astype(np.float32), mapped.state.astype(np.float32))
        return mapped.header, part
    finally:
        mapped.close()


def write_json_atomic(path: Path, payload: dict, fsync: bool = True) -> None:
    _write_replace(path.with_name(path.name + ".tmp"), path, "w", lambda f: json.dump(payload, f, indent=1), fsync)
    if fsync:
        _fsync_dir(path.parent)


def storage_error(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` (same type and errno): a ``write`` or ``fsync`` that fails (ENOSPC,
    EIO, EDQUOT) raises an OSError without a file name, and "[Errno 28] No space left on device"
    reached the trainer's log without saying which disk."""
    if exc.filename is not None or exc.errno is None:
        return exc
    out = type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))
    out.__cause__ = exc
    return out


def _write_replace(tmp: Path, path: Path, mode: str, write, fsync: bool) -> None:
    """``write(f)`` into ``tmp`` (fsynced), renamed onto ``path``. On failure the partial ``tmp``
    is removed (a full disk kept every failed attempt's partial file, which no later dump matched
    or removed) and an OSError names the file."""
    try:
        with open(tmp, mode) as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise storage_error(exc, tmp) from exc
        raise


def read_manifest(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path.parent}: incomplete: no {path.name} marker (dump unfinished or failed)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable done marker: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: done marker is not a JSON object")
    return data


# -- dump ------------------------------------------------------------------------------------------
def _dump_shard(store: ShardedRows, k: int, rdir: Path, replica_index: int, fsync: bool) -> list[dict]:
    entries = []
    for table, snap in store._snapshot_shard(k):  # the shard lock is held only inside this call
        signs, weights, state = table.compact_snapshot(snap)
        del snap
        if signs.shape[0] == 0:
            continue
        name = f"replica_{replica_index}_shard_{k}_dim_{table.dim}.emb"
        entries.append(write_rows_file(rdir / name, signs, weights, state, table.state_code, fsync=fsync))
    return entries


def dump_store(store: ShardedRows, directory: Path, replica_index: int, num_workers: int,
               replica_size: int | None, fsync: bool) -> int:
    """Write every internal shard of ``store`` under ``directory/s<replica_index>``; returns rows."""
    if replica_index < 0:
        raise ValueError(f"replica_index must be >= 0, got {replica_index}")
    rdir = directory / f"s{replica_index}"
    rdir.mkdir(parents=True, exist_ok=True)
    marker = rdir / DONE_MARKER
    marker.unlink(missing_ok=True)  # the directory is incomplete from now until the new marker
    with ThreadPoolExecutor(max_workers=max(1, num_workers), thread_name_prefix="ps-dump") as pool:
        futures = [pool.submit(_dump_shard, store, k, rdir, replica_index, fsync) for k in range(store.num_shards)]
        entries = [e for fut in futures for e in fut.result()]
    written = {e["file"] for e in entries}
    for stale in rdir.glob("*.emb"):
        if stale.name not in written:
            stale.unlink()
    rows = sum(e["rows"] for e in entries)
    if fsync:
        _fsync_dir(rdir)
    write_json_atomic(marker, {
        "format": MANIFEST_FORMAT,
        "replica_index": replica_index,
        "replica_size": replica_size,
        "num_internal_shards": store.num_shards,
        "rows": rows,
        "files": entries,
        "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }, fsync=fsync)
    return rows


def mark_checkpoint_complete(directory: Path, replica_size: int, embedding_layout: dict | None = None) -> None:
    """Top-level done marker, once every replica's own marker exists (the trainer's last step);
    with the :func:`embedding_layout` of the config the rows were trained with, when given."""
    for j in range(replica_size):
        read_manifest(Path(directory) / f"s{j}" / DONE_MARKER)
    marker = {"format": MANIFEST_FORMAT, "num_shards": replica_size,
              "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    if embedding_layout is not None:
        marker[LAYOUT_KEY] = embedding_layout
    write_json_atomic(Path(directory) / DONE_MARKER, marker)


# -- the embedding layout a checkpoint was trained with ---------------------------------------------
# A row's sign is its ID with the slot's index prefix in the top feature_index_prefix_bit bits
# (after hash stacking, when the slot has it), and its table is the slot's dim. The prefix follows
# from feature_groups, the order of slots_config and feature_index_prefix_bit: an embedding config
# that differs in any of them looks every ID up under other signs, and every lookup misses (zeros).
# The trainer records this per slot in the top-level done marker; whoever loads the checkpoint with
# an embedding config compares it with its own (layout_differences) and refuses a difference.
LAYOUT_KEY = "embedding_layout"
LAYOUT_VERSION = 1
LAYOUT_FIELDS = ("index_prefix", "dim", "hash_stack_rounds", "hash_stack_embedding_size")


def embedding_layout(schema: Any) -> dict:
    """What decides where each slot's rows live and their shape, from a parsed
    ``embedding_config.yml`` (``persia.config.EmbeddingSchema``): plain JSON data."""
    return {
        "version": LAYOUT_VERSION,
        "feature_index_prefix_bit": int(schema.feature_index_prefix_bit),
        "feature_groups": {g: list(members) for g, members in schema.feature_groups.items()},
        "slots": {
            name: {"index_prefix": int(slot.index_prefix), "dim": int(slot.dim), "group": slot.group,
                   "hash_stack_rounds": int(slot.hash_stack_rounds),
                   "hash_stack_embedding_size": int(slot.hash_stack_embedding_size)}
            for name, slot in schema.slots.items()
        },
    }


def checkpoint_layout(directory: Path) -> dict | None:
    """The embedding layout recorded in a checkpoint's top-level done marker; None for a
    checkpoint written before it was recorded (or without a top-level marker)."""
    top = Path(directory) / DONE_MARKER
    if not top.exists():
        return None
    return check_layout(read_manifest(top).get(LAYOUT_KEY), top)


def check_layout(layout: Any, where: Any) -> dict | None:
    """``layout`` if it is a well-formed layout record (None stays None); else a CheckpointError."""
    if layout is None:
        return None
    slots = layout.get("slots") if isinstance(layout, dict) else None
    if not isinstance(slots, dict) or not slots or not all(
            isinstance(v, dict) and all(isinstance(v.get(f), int) for f in ("index_prefix", "dim"))
            for v in slots.values()):
        raise CheckpointError(f"{where}: malformed {LAYOUT_KEY} record (per slot an index_prefix and a dim)")
    return layout


def _shown(field: str, value: Any) -> str:
    if field == "index_prefix" and isinstance(value, int):
        return f"{value:#018x}"
    return "absent" if value is None else repr(value)


def layout_differences(recorded: dict, current: dict) -> tuple[str | None, list[str]]:
    """(why ``current`` cannot use rows laid out as ``recorded``, or None; notes). Every slot in
    both must have the same index prefix, dim and hash stacking; the first that does not is named
    with both values. A slot on one side only is a note (a slot added to the config starts with
    no rows, as in training from scratch), unless no slot is on both sides."""
    rs, cs = recorded["slots"], current["slots"]
    common = [name for name in rs if name in cs]
    notes = [f"slot {n!r} is in the embedding config but not in the checkpoint: it has no rows there"
             for n in cs if n not in rs]
    notes += [f"slot {n!r} is in the checkpoint but not in the embedding config" for n in rs if n not in cs]
    if not common:
        return (f"the checkpoint's slots {list(rs)} and the embedding config's {list(cs)} have none in common",
                notes)
    for name in common:
        for field in LAYOUT_FIELDS:
            a, b = rs[name].get(field), cs[name].get(field)
            if field not in rs[name] and field not in ("index_prefix", "dim"):
                continue  # a record without the field (none yet): nothing to compare
            if a != b:
                why = (f"slot {name!r}: {field} {_shown(field, a)} in the checkpoint, {_shown(field, b)} in "
                       f"the embedding config")
                if field == "index_prefix":
                    why += "; " + _prefix_hint(recorded, current)
                return why, notes
    return None, notes


def _prefix_hint(recorded: dict, current: dict) -> str:
    """Which setting moved the prefixes: the prefix bit, the groups, or the order of the slots."""
    bits = (recorded.get("feature_index_prefix_bit"), current.get("feature_index_prefix_bit"))
    if bits[0] != bits[1]:
        return f"feature_index_prefix_bit is {bits[0]} in the checkpoint, {bits[1]} in the embedding config"
    groups = (recorded.get("feature_groups"), current.get("feature_groups"))
    if groups[0] != groups[1]:
        return f"feature_groups are {groups[0]} in the checkpoint, {groups[1]} in the embedding config"
    return (f"slots_config lists the slots as {list(recorded['slots'])} in the checkpoint, "
            f"{list(current['slots'])} in the embedding config (an ungrouped slot's prefix is its position)")


# -- load ------------------------------------------------------------------------------------------
def checkpoint_replicas(directory: Path) -> int:
    """How many PS replicas wrote the checkpoint; every one of them must have finished."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    found = sorted(int(m.group(1)) for p in directory.iterdir() if p.is_dir() and (m := _REPLICA_DIR.match(p.name)))
    count = None
    top = directory / DONE_MARKER
    if top.exists():
        info = read_manifest(top)
        n = info.get("num_shards", info.get("replica_size"))
        if not isinstance(n, int) or n <= 0:
            raise CheckpointError(f"{top}: no valid replica count (num_shards), got {n!r}")
        count = n
    if not found:
        raise CheckpointError(f"{directory}: no replica directories (s0, s1, ...): not an embedding checkpoint")
    manifests = {j: read_manifest(directory / f"s{j}" / DONE_MARKER) for j in found}
    if count is None:
        sizes = {m.get("replica_size") for m in manifests.values()} - {None}
        if len(sizes) > 1:
            raise CheckpointError(f"{directory}: replicas disagree on replica_size: {sorted(sizes)}")
        count = sizes.pop() if sizes else max(found) + 1
    missing = [j for j in range(count) if j not in manifests]
    if missing:
        raise CheckpointError(f"{directory}: incomplete: replica directories {['s%d' % j for j in missing]} missing "
                              f"of {count}")
    return count


def open_checkpoint(directory: Path, replica_index: int, replica_size: int, num_workers: int) -> list[MappedRows]:
    """Every file of the checkpoint that can hold rows of replica ``replica_index`` of
    ``replica_size``, validated and memory-mapped (``keep`` masks set when re-sharding). Any
    problem raises :class:`CheckpointError` before a row is used."""
    directory = Path(directory)
    writers = checkpoint_replicas(directory)
    sources = [replica_index] if writers == replica_size else list(range(writers))
    jobs: list[tuple[Path, dict]] = []
    for j in sources:
        manifest = read_manifest(directory / f"s{j}" / DONE_MARKER)
        files = manifest.get("files")
        if not isinstance(files, list):
            raise CheckpointError(f"{directory / f's{j}' / DONE_MARKER}: no 'files' list (not written by this PS)")
        for entry in files:
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "/" in entry["file"]:
                raise CheckpointError(f"{directory / f's{j}'}: malformed file entry {entry!r}")
            jobs.append((directory / f"s{j}" / entry["file"], entry))

    def open_one(job) -> MappedRows:
        path, entry = job
        mapped = MappedRows(path, entry)
        if mapped.header.kind != KIND_CHECKPOINT:
            mapped.close()
            raise CheckpointError(f"{path}: an incremental packet, not a checkpoint file")
        if replica_size > 1:  # keep only this replica's rows, whoever wrote them
            mine = shard_of(mapped.signs, replica_size, PS_SHARD_SALT) == replica_index
            if not mine.all():
                mapped.keep = mine
        return mapped

    opened: list[MappedRows] = []
    with ThreadPoolExecutor(max_workers=max(1, num_workers), thread_name_prefix="ps-load") as pool:
        futures = [pool.submit(open_one, job) for job in jobs]
        error = None
        for fut in futures:
            try:
                opened.append(fut.result())
            except Exception as exc:  # keep the first error, close whatever did open
                error = error or exc
    if error is not None:
        for mapped in opened:
            mapped.close()
        raise error
    kinds: dict[int, set] = {}
    for mapped in opened:
        kinds.setdefault(mapped.header.dim, set()).add((mapped.header.state_code, mapped.header.state_width))
    for dim, found in kinds.items():
        if len(found) > 1:
            for mapped in opened:
                mapped.close()
            raise CheckpointError(f"{directory}: rows of dim {dim} carry different optimizer states {sorted(found)}")
    return opened


def merge_parts(parts: list[tuple[Path, RowsPart]]) -> dict[int, RowsPart]:
    """Concatenate parts per dim; all parts of a dim must carry the same kind of state."""
    by_dim: dict[int, list[tuple[Path, RowsPart]]] = {}
    for path, part in parts:
        by_dim.setdefault(part.dim, []).append((path, part))
    out = {}
    for dim, items in by_dim.items():
        kinds = {(p.state_code, p.state.shape[1]) for _, p in items}
        if len(kinds) > 1:
            raise CheckpointError(f"rows of dim {dim} carry different optimizer states {sorted(kinds)} "
                                  f"(files {[str(p) for p, _ in items]})")
        ps = [p for _, p in items]
        out[dim] = RowsPart(
            dim, ps[0].state_code,
            np.concatenate([p.signs for p in ps]) if len(ps) > 1 else ps[0].signs,
            np.concatenate([p.weights for p in ps]) if len(ps) > 1 else ps[0].weights,
            np.concatenate([p.state for p in ps]) if len(ps) > 1 else ps[0].state,
        )
    return out
