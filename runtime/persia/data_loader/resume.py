"""Where a data loader's stream resumes after a restart from a checkpoint (pure; no I/O).

The checkpoint records, per data loader and NN rank, how many of the loader's batches that rank
trained (``{loader: {rank: n}}``). A rank trains one loader's batches in the order they were sent,
so the trained ones are the first ``n`` the loader sent to that rank. A restarted loader that
replays the same stream (same data, same order, same number of loaders) therefore skips, for each
rank, the first ``n`` batches it sent there: exactly the trained ones, and nothing else, even when
staleness left later batches untrained on one rank but not another.

The NN rank count may change between runs (the operator's replica change). A batch's rank is its
batch id modulo the world size *of the run that sent it*, so the positions are kept per run:
``earlier`` holds, oldest first, the positions of runs with other world sizes, and each run's
loader sent only the batches no earlier run had trained. Replaying the runs in order over each
batch id decides, batch by batch, whether some run trained it; the untrained ones go to the
ranks of the current world size.
"""

from __future__ import annotations

from typing import Mapping, Sequence


class StreamPosition:
    """Which of a loader's batches were trained before the restart; ``skip(batch_id)``, called for
    every batch id in send order, says whether to skip that one."""

    def __init__(self, runs: Sequence[tuple[int, Mapping[int, int]]], step: int | None = None,
                 path: str | None = None):
        # per run: its world size, trained batches per rank, and how many that run sent per rank so far
        self._runs = [(int(world), {int(r): int(n) for r, n in trained.items() if int(n) > 0}, {})
                      for world, trained in runs]
        for world, _, _ in self._runs:
            if world < 1:
                raise ValueError(f"world_size {world} in a checkpoint's positions: expected >= 1")
        self.total = sum(sum(trained.values()) for _, trained, _ in self._runs)
        self.skipped = 0
        self.step, self.path = step, path

    def skip(self, batch_id: int) -> bool:
        if self.skipped >= self.total:  # every trained batch skipped: no later one was trained
            return False
        for world, trained, sent in self._runs:
            rank = batch_id % world
            nth = sent.get(rank, 0)  # this batch was that run's nth for this rank
            sent[rank] = nth + 1
            if nth < trained.get(rank, 0):
                self.skipped += 1
                return True
        return False

    @property
    def remaining(self) -> int:
        return self.total - self.skipped


def loader_count_error(resume: Mapping | None, loader_size: int) -> str | None:
    """Why a job with ``loader_size`` data loaders cannot resume the checkpoint ``resume`` names
    (the NN workers' ``nn.info`` answer or a ``progress.json`` with its ``path``), or None.

    Batch ids (``counter * loaders + index``) and the user's sharding (PERSIA's scripts read shard
    ``index`` of ``loaders``) both depend on the number of loaders, so with another number a
    loader's stream is other batches under other ids: no skip can name the trained ones, and going
    on would train some twice and never train others, in silence. The only exact case is a
    checkpoint in which nothing was trained (no positions): every loader starts from the beginning.
    A checkpoint written before the count was recorded is checked as far as its positions allow
    (a position for loader ``k`` needs more than ``k`` loaders)."""
    if not resume:
        return None
    runs = [resume, *(resume.get("earlier") or ())]
    with_positions = sorted({int(loader) for run in runs for loader, ranks in (run.get("loaders") or {}).items()
                             if any(int(n) > 0 for n in ranks.values())})
    if not with_positions:
        return None
    saved = resume.get("loader_size")
    if saved is None and with_positions[-1] < loader_size:
        return None
    if saved is not None and int(saved) == int(loader_size):
        return None
    written, run = ((f"was written with {saved} data loaders", f"{saved} data loaders") if saved is not None else
                    (f"has positions for data loader {with_positions[-1]}", "the data loaders it was written with"))
    return (f"checkpoint {resume.get('path')} {written}, this job has {loader_size}: batch ids and the data "
            f"loaders' sharding depend on that number, so the batches trained before cannot be skipped exactly "
            f"(some would be trained twice, others never). Run {run} to resume it, or start afresh "
            f"(PERSIA_RESUME=never or another checkpoint directory; ctx.load_checkpoint(path) then loads "
            f"the model alone)")


def live_resume(resume: Mapping | None, answers: Sequence[Mapping], world_size: int) -> dict | None:
    """Where a data loader starting *now* resumes: the checkpoint the job resumed (``resume``, from
    ``nn.info``, or None) with this run's positions replaced by what each NN rank says it has spent
    of every loader's batches (``nn.position.<rank>`` answers, one per rank: the checkpoint's count
    plus what it acknowledged since; ``TrainCtx._live_position`` says why that is exact). On a
    job's first start that is the checkpoint's positions; for a loader restarted in place, also
    what its killed process delivered. Combined per loader and rank as checkpoints combine them."""
    loaders: dict[str, dict[str, int]] = {}
    earlier = (resume or {}).get("earlier") or []
    for answer in answers:
        rank = int(answer["rank"])
        if not 0 <= rank < world_size or int(answer["world_size"]) != world_size:
            raise ValueError(f"nn.position answer of rank {rank} (world size {answer['world_size']}) "
                             f"in a job of {world_size} NN ranks")
        earlier = answer.get("earlier") or earlier  # the same on every rank
        for loader, n in (answer.get("loaders") or {}).items():
            if int(n) > 0:
                loaders.setdefault(str(int(loader)), {})[str(rank)] = int(n)
    if resume is None and not loaders:
        return None
    return {**(resume or {}), "world_size": world_size, "loaders": loaders, "earlier": list(earlier)}


def position_from_info(resume: Mapping | None, loader_index: int, world_size: int) -> tuple[StreamPosition | None, str | None]:
    """The position of loader ``loader_index`` from the NN workers' ``nn.info`` answer, and a note
    when the checkpoint was written with another NN world size (its positions are mapped)."""
    if not resume:
        return None, None
    saved_world = resume.get("world_size")
    runs = [(int(run["world_size"]), (run.get("loaders") or {}).get(str(loader_index)) or {})
            for run in resume.get("earlier") or ()]
    runs.append((int(saved_world or world_size), (resume.get("loaders") or {}).get(str(loader_index)) or {}))
    position = StreamPosition(runs, resume.get("step"), resume.get("path"))
    note = None
    if saved_world is not None and int(saved_world) != int(world_size) and position.total:
        note = (f"checkpoint {resume.get('path')} was written with {saved_world} NN ranks, this job has "
                f"{world_size}: data loader {loader_index} skips the {position.total} batches trained there "
                f"and sends the others to the ranks of {world_size}")
    return position, note
