"""Decisions about periodic checkpoints and resume, as pure functions (tested without servers).

Layout (CONTRACTS.md)::

    <dir>/ckpt-<step, 12 digits>/     a published checkpoint; its COMPLETE marker is written last,
                                      inside the temporary directory, before the rename
    <dir>/.tmp-ckpt-<step>/           being written (or left by a killed writer: never read)

A resume picks the highest step whose marker is present; everything else is ignored.
"""

from __future__ import annotations

import math
import os
import re
from typing import Collection, Iterable, Mapping, Optional

from pydantic import BaseModel, ConfigDict

CHECKPOINT_PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-ckpt-"
COMPLETE = "COMPLETE"
LOCK = ".writer.lock"  # where a directory cannot be flock'ed itself (periodic.dir_lock)
PROGRESS = "progress.json"
FORMAT = "persia-k8s-checkpoint/2"
_NAME = re.compile(r"^ckpt-(\d{12})$")

ENV_DIR = "PERSIA_CHECKPOINT_DIR"
ENV_STEPS = "PERSIA_CHECKPOINT_INTERVAL_STEPS"
ENV_SECONDS = "PERSIA_CHECKPOINT_INTERVAL_SECONDS"
ENV_KEEP = "PERSIA_CHECKPOINT_KEEP"
ENV_RESUME = "PERSIA_RESUME"


class CheckpointSettings(BaseModel):
    """What the trainer does about periodic checkpoints and resume (config keys, then env)."""

    model_config = ConfigDict(frozen=True)

    checkpoint_dir: Optional[str] = None
    interval_steps: Optional[int] = None
    interval_seconds: Optional[float] = None
    keep: int = 3
    resume: str = "auto"
    resume_source: str = "the default"  # where ``resume`` came from, for the error of a path that is not one

    @property
    def periodic(self) -> bool:
        return self.checkpoint_dir is not None and (self.interval_steps is not None or self.interval_seconds is not None)


def _positive(name: str, raw: str, kind):
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a positive {kind.__name__}") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive {kind.__name__}")
    return value


def settings_from(config=None, env: Mapping[str, str] | None = None, **overrides) -> CheckpointSettings:
    """``checkpointing_config`` keys, overridden by ``PERSIA_CHECKPOINT_*``/``PERSIA_RESUME``, then by
    explicit ``overrides`` (TrainCtx arguments that are not None). An empty env value means unset
    (``PERSIA_CHECKPOINT_INTERVAL_STEPS=`` turns the config's interval off)."""
    env = os.environ if env is None else env
    values = {}
    source: dict[str, str] = {}  # where each key's value came from, for the errors below
    if config is not None:
        for key in CheckpointSettings.model_fields.keys() - {"resume_source"}:
            values[key] = getattr(config, key)
            source[key] = f"checkpointing_config.{key}"
    for name, key, kind in ((ENV_DIR, "checkpoint_dir", str), (ENV_STEPS, "interval_steps", int),
                            (ENV_SECONDS, "interval_seconds", float), (ENV_KEEP, "keep", int),
                            (ENV_RESUME, "resume", str)):
        if name not in env:
            continue
        raw = env[name].strip()
        source[key] = f"env {name}={env[name]!r}"
        if kind is str:
            values[key] = raw or (None if key == "checkpoint_dir" else "auto")
        elif not raw:
            values[key] = None if key != "keep" else 3
        else:
            values[key] = _positive(name, raw, kind)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
            source[key] = "the TrainCtx argument"
    intervals = [k for k in ("interval_steps", "interval_seconds") if values.get(k) is not None]
    if intervals and values.get("checkpoint_dir") is None:
        said = " and ".join(f"{k}={values[k]!r} (from {source.get(k, 'the arguments')})" for k in intervals)
        where = f" ({source['checkpoint_dir']})" if "checkpoint_dir" in source else ""
        raise ValueError(
            f"{said} asks for periodic checkpoints, but checkpoint_dir is unset{where}: set checkpoint_dir "
            f"(checkpointing_config, env {ENV_DIR} or TrainCtx(checkpoint_dir=...)), or unset the interval")
    for key in ("interval_steps", "keep"):
        if values.get(key) is not None and (isinstance(values[key], bool) or int(values[key]) <= 0):
            raise ValueError(f"{key} must be a positive integer, got {values[key]!r}")
    if values.get("interval_seconds") is not None and not float(values["interval_seconds"]) > 0:
        raise ValueError(f"interval_seconds must be positive, got {values['interval_seconds']!r}")
    if "://" in str(values.get("checkpoint_dir") or ""):
        raise ValueError(f"checkpoint_dir {values['checkpoint_dir']!r}: only local/mounted paths are supported")
    return CheckpointSettings(**values, resume_source=source.get("resume", "the TrainCtx argument"))


def checkpoint_name(step: int) -> str:
    if step < 0 or step >= 10**12:
        raise ValueError(f"checkpoint step must be in [0, 10**12), got {step}")
    return f"{CHECKPOINT_PREFIX}{step:012d}"


def tmp_name(step: int) -> str:
    return f"{TMP_PREFIX}{step:012d}"


def step_of(name: str) -> int | None:
    """The step of a published checkpoint's directory name, None for anything else."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def complete_checkpoints(entries: Iterable[tuple[str, bool]]) -> list[tuple[int, str]]:
    """``(step, name)`` of the published checkpoints, oldest first, from ``(name, has_marker)``
    pairs (a directory listing): temporary, foreign and marker-less directories are ignored."""
    out = [(s, name) for name, marked in entries if marked and (s := step_of(name)) is not None]
    return sorted(out)


def to_delete(complete: list[tuple[int, str]], keep: int, published: str | None = None) -> list[str]:
    """Names of the complete checkpoints beyond the newest ``keep`` (retention), never
    ``published`` (the checkpoint the cut just wrote): in a directory that already holds ``keep``
    checkpoints of higher steps (``resume: never`` or a resume from an older path into a used
    directory, a second job), "the newest ``keep``" left it out, and every checkpoint of the run
    was deleted the moment it was published: a restart then had none of its own to resume from."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    return [name for _, name in sorted(complete)[:-keep] if name != published]


ENV_RUN_ID = "PERSIA_RUN_ID"
"""One run of a job across its restarts (the operator: the PersiaJob's uid; local mode: one per
``persia-launcher local``), recorded in each checkpoint's progress as ``run_id``."""


def resume_choice(resume: str, complete: list[tuple[int, str]], own: Collection[str] = ()) -> tuple[str, str] | None:
    """What to resume from, as ``("dir", name)`` (a checkpoint in the checkpoint directory) or
    ``("path", path)``, or None (start fresh).

    ``own``: the complete checkpoints this run wrote. A restart resumes from the newest of them
    whatever ``resume`` says: ``never`` and a path say where the job starts, not where each of its
    restarts starts over (the restarted job lost everything since). Otherwise ``"never"`` -> None;
    ``"auto"`` -> the newest complete checkpoint (None when there is none); anything else is a
    path."""
    mine = [c for c in complete if c[1] in own]
    if mine:
        return ("dir", max(mine)[1])
    if resume == "never":
        return None
    if resume == "auto":
        return ("dir", max(complete)[1]) if complete else None
    return ("path", resume)


def is_due(settings: CheckpointSettings, step: int, last_step: int, seconds_since: float) -> bool:
    """Whether a periodic checkpoint is due after ``step`` (the last one was at ``last_step``).
    Step intervals are aligned to multiples of ``interval_steps`` (ckpt-150 is at step 150 with or
    without restarts in between, also after a final checkpoint at an odd step)."""
    if not settings.periodic or step <= last_step:
        return False
    n = settings.interval_steps
    if n is not None and step // n > last_step // n:
        return True
    return settings.interval_seconds is not None and seconds_since >= settings.interval_seconds


def merge_positions(per_rank: list[Mapping[int, int]]) -> dict[str, dict[str, int]]:
    """Loader positions of a cut: ``{loader: {rank: batches of that loader trained by that rank}}``
    (JSON keys). Under hybrid training a rank trains each loader's batches in the order they
    arrived, so the trained batches of loader i sent to rank r are exactly the first n of them."""
    out: dict[str, dict[str, int]] = {}
    for rank, counts in enumerate(per_rank):
        for loader, n in counts.items():
            if n:
                out.setdefault(str(int(loader)), {})[str(rank)] = int(n)
    return out


# What became of a batch the training loop took from the stream, and whether its loader's position
# (how many of its batches to this rank a resumed loader skips) moves past it.
CONSUMED = frozenset({"trained", "non_finite_loss", "non_finite_dense_grad", "non_finite_embedding_grad",
                      "amp_overflow", "lost_id_features", "uneven_tail", "no_backward", "backward_failed"})


def advances_position(outcome: str) -> bool:
    """Whether a batch that ended in ``outcome`` on its rank counts in its loader's position.

    Positions are "the first n batches this loader sent to this rank", skipped by a resumed loader
    as a prefix, so every batch the training loop *consumed* must count, in arrival order, whether
    it trained or not: a skipped non-finite step, a batch whose ID features were lost (its
    loader released them, or they never came; that send will never be trained, and an undisturbed
    run does not train it either), and the uneven tail DDP ranks drop at the end of a stream so
    that they stay in step (an undisturbed run drops it too, and the next epoch's batches follow it
    in its loader's order), and a batch the loop skipped without a backward (``no_backward``). Leaving a consumed batch out shifts the prefix: the resumed loader
    skips one batch too few and sends an already-trained one again. Batches received but never
    reached (``abandoned`` when training stops early, an evaluation's) do not count."""
    return outcome in CONSUMED


def positions_for_rank(loaders: Mapping[str, Mapping[str, int]], rank: int) -> dict[int, int]:
    """A rank's own counters, restored from a checkpoint's positions."""
    return {int(loader): int(ranks.get(str(rank), 0)) for loader, ranks in loaders.items()}


def continue_positions(progress: Mapping, world_size: int, rank: int) -> tuple[list[dict], dict[int, int]]:
    """After resuming from a checkpoint's ``progress``: the earlier runs to record in the next
    checkpoints (``earlier``) and this rank's trained counts to continue from. With the world size
    the checkpoint was written with, its run goes on (its counts continue); with another, that run's
    batch-to-rank mapping no longer holds, so it joins the earlier runs (data loaders replay them,
    ``persia.data_loader.resume``) and this run counts from zero."""
    earlier = [dict(run) for run in progress.get("earlier") or ()]
    saved, loaders = progress.get("world_size"), progress.get("loaders") or {}
    if saved is None or int(saved) == int(world_size):
        return earlier, positions_for_rank(loaders, rank)
    if any(loaders.values()):
        earlier.append({"world_size": int(saved), "loaders": {k: dict(v) for k, v in loaders.items()}})
    return earlier, {}


def batch_ordinal(batch_id: int, loader: int, loader_size: int, world_size: int) -> int:
    """Which of loader ``loader``'s batches to NN rank ``batch_id % world_size`` this one is
    (1-based), in a run of ``world_size`` ranks that sends every batch (ids ``counter *
    loader_size + loader``; the rank of the ``c``-th one repeats with period ``world_size /
    gcd(loader_size, world_size)`` in ``c``, and this batch is the last of its residue)."""
    if loader_size < 1 or world_size < 1 or not 0 <= loader < loader_size or batch_id % loader_size != loader:
        raise ValueError(f"batch {batch_id} is not one of data loader {loader}/{loader_size}'s")
    period = world_size // math.gcd(loader_size, world_size)
    return (batch_id - loader) // loader_size // period + 1


def stream_gap(batch_id: int, loader: int, loader_size: int, world_size: int, position: int, delivered: int) -> int:
    """How many of this loader's batches to this rank lie between what the rank has of it
    (``position``: its resume point; ``delivered``: acknowledged since) and this batch, the first
    of a loader process the rank had not heard from: 0 when it is the next one, as for a loader that
    asked the rank where to start (``nn.position``); more when the process streamed on past a
    restart of this rank, whose predecessor took the batches in between (trained after the
    checkpoint, or acknowledged and not trained): gone with it. Negative: the loader resends
    batches the rank has (a restarted loader that asked while its predecessor's last send was
    on its way)."""
    return batch_ordinal(batch_id, loader, loader_size, world_size) - (position + delivered + 1)
