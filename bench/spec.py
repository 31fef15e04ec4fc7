"""What one benchmark run is: the system, the data, the model and the knobs every system shares."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

System = Literal["torch", "torchrec", "persia-hybrid", "persia-sync"]
# The default hybrid setting: PERSIA's examples' bound, with the runtime's defaults (the NN worker
# replays its own missed updates, so no staleness ramp: persia.nn_worker.own_updates). The AUC-gap
# targets are measured on it; the benchmark profile's headline bound may be another.
DEFAULT_HYBRID_STALENESS = 10


def persia_label(system: str, staleness: int, num_ps: int = 1, num_embedding_workers: int = 1,
                 nn_threads: int | str | None = None, colocate_ps: bool = False, replay: bool = True,
                 cpu_placement: str = "auto", num_nn_workers: int = 1) -> str:
    """Name of one configuration of our system; the synchronous reference (staleness 1) has none."""
    bound = "" if system == "persia-sync" else f" st={staleness}"
    threads = f" nn-threads={nn_threads}" if nn_threads else ""
    colocated = " colocated" if colocate_ps else ""
    stale = "" if replay or system == "persia-sync" else " no-replay"
    placement = "" if cpu_placement == "auto" else f" placement={cpu_placement}"
    ranks = f" nn={num_nn_workers}" if num_nn_workers != 1 else ""
    return f"{system}{bound}{stale} ps={num_ps} ew={num_embedding_workers}{ranks}{colocated}{threads}{placement}"


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    system: System
    data_dir: str
    mlp: str = "mlp400"
    batch_size: int = Field(default=1024, ge=1, le=65535)
    seed: int = Field(default=0, ge=0)
    threads: int = Field(default=2, ge=1)
    train_rows: int | None = Field(default=None, ge=1)
    eval_points: int = Field(default=4, ge=1)
    test_rows: int | None = Field(default=None, ge=1)
    curve_eval_rows: int = Field(default=20000, ge=1)
    dense_optimizer: Literal["adam", "sgd"] = "adam"
    dense_lr: float | None = None
    embedding_lr: float = 1e-2
    # torch baseline only: torch's own optimizers (sparse torch.optim.Adagrad, Adam(fused=True))
    # instead of the PS's formula (the AUC reference; torch's Adagrad lacks the PS's weight clip)
    fused: bool = False
    # our system only
    staleness: int | None = Field(default=None, ge=1)
    # torch threads per NN worker, or "auto" (measured in training); None: the launcher's default (auto)
    nn_threads: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    # persia-hybrid: PERSIA_STALENESS_WARMUP_STEPS for the run (None: the runtime's default ramp)
    staleness_warmup_steps: int | None = Field(default=None, ge=0)
    num_ps: int = Field(default=1, ge=1)
    num_embedding_workers: int = Field(default=1, ge=1)
    # NN worker ranks (persia-launcher local --num-nn-workers; DDP over gloo on the CPU): each
    # trains batches of batch_size, so the global batch is num_nn_workers x batch_size
    num_nn_workers: int = Field(default=1, ge=1)
    # each embedding worker runs its PS replica in its own process (persia-launcher local --colocate-ps)
    colocate_ps: bool = False
    # the NN worker re-applies its own updates a lookup missed (PERSIA_REPLAY_OWN_UPDATES, the
    # runtime's default); False: stale reads, as PERSIA trains (and the staleness ramp they need)
    replay: bool = True
    # persia-launcher local --cpu-placement: auto (its default) gives the NN worker's training
    # thread a CPU of its own while it trains on one torch thread; off leaves it to the kernel
    cpu_placement: Literal["auto", "off"] = "auto"
    timeout_s: float = Field(default=600.0, gt=0)
    # where the dense model trains (our NN worker, or the whole torch baseline: its embedding table
    # too, as a torch user with a GPU would); bench/gpu_bench.py runs "cuda"
    device: Literal["cpu", "cuda"] = "cpu"
    mixed_precision: bool = False  # our system only: TrainCtx(mixed_precision=True), CUDA only

    @model_validator(mode="after")
    def _mixed_precision_where_supported(self) -> "RunSpec":
        if self.mixed_precision and (self.device != "cuda" or not self.system.startswith("persia")):
            raise ValueError(f"mixed_precision=True needs device='cuda' and our system, got device={self.device!r} "
                             f"system={self.system!r}")
        return self

    @property
    def effective_staleness(self) -> int | None:
        """persia-sync is the synchronous reference: staleness 1 (update before the next lookup)."""
        if self.system == "persia-sync":
            return 1
        if self.system == "persia-hybrid":
            return self.staleness or DEFAULT_HYBRID_STALENESS
        return None

    @property
    def label(self) -> str:
        """Short name of the configuration (what the median groups by: everything but the seed)."""
        where = (" cuda" if self.device == "cuda" else "") + (" amp" if self.mixed_precision else "")
        if self.system.startswith("persia"):
            return persia_label(self.system, self.effective_staleness, self.num_ps, self.num_embedding_workers,
                                self.nn_threads, self.colocate_ps, self.replay, self.cpu_placement,
                                self.num_nn_workers) + where
        fused = " fused" if self.fused else ""
        return f"{self.system}{fused} threads={self.threads}{where}"
