"""Where a data loader's stream resumes after a restart from a checkpoint (pure; no I/O).

The checkpoint records, per data loader and NN rank, how many of the loader's batches that rank
trained (``{loader: {rank: n}}``). A rank trains one loader's batches in the order they were sent,
so the trained ones are the first ``n`` the loader sent to that rank. A restarted loader that
replays the same stream (same data, same order, same number of loaders and NN ranks) therefore
skips, for each rank, the first ``n`` batches it would send there: exactly the trained ones, and
nothing else, even when staleness left later batches untrained on one rank but not another.
"""

from __future__ import annotations

from typing import Mapping


class StreamPosition:
    """Batches still to skip, per NN rank; ``skip(rank)`` consumes one."""

    def __init__(self, trained_per_rank: Mapping[int, int], step: int | None = None, path: str | None = None):
        self.left = {int(r): int(n) for r, n in trained_per_rank.items() if int(n) > 0}
        self.total = sum(self.left.values())
        self.step, self.path = step, path

    def skip(self, rank: int) -> bool:
        n = self.left.get(rank, 0)
        if n <= 0:
            return False
        self.left[rank] = n - 1
        return True

    @property
    def remaining(self) -> int:
        return sum(self.left.values())


def position_from_info(resume: Mapping | None, loader_index: int, world_size: int) -> tuple[StreamPosition | None, str | None]:
    """The position of loader ``loader_index`` from the NN workers' ``nn.info`` answer, and a
    warning when the checkpoint cannot be mapped onto this job (world size changed)."""
    if not resume:
        return None, None
    saved_world = resume.get("world_size")
    loaders = resume.get("loaders") or {}
    mine = loaders.get(str(loader_index)) or {}
    if saved_world is not None and int(saved_world) != int(world_size) and mine:
        return None, (f"checkpoint {resume.get('path')} was written with {saved_world} NN ranks, this job has "
                      f"{world_size}: data loader {loader_index} starts its stream from the beginning")
    return StreamPosition({int(r): int(n) for r, n in mine.items()}, resume.get("step"), resume.get("path")), None
