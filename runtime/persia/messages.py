"""Schemas of every message a role accepts, over NATS and gRPC.

A message is checked here before any handler reads it: a missing or wrong-typed field, an extra
field, an array of the wrong kind or rank, or a size over the limits below is answered with an
error naming the field and the value, and the role keeps serving (``persia.bus.NatsBus.serve``,
``persia.rpc.serve``). Handlers still check what needs the role's state (slot names, dims, CSR
offsets). Models are strict: no coercion, so the validated message is the message as sent, and a
new field is added here by whoever adds it to a sender (extra fields are refused, loudly).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator

from persia.env import int_in_range

MAX_BATCH_SIZE = int_in_range("PERSIA_MAX_BATCH_SIZE", os.environ.get("PERSIA_MAX_BATCH_SIZE") or "65535", 1, 1 << 31)
"""Samples per batch (the embedding worker already refused more on the NATS path)."""
MAX_ARRAY_ELEMENTS = int_in_range("PERSIA_MAX_ARRAY_ELEMENTS", os.environ.get("PERSIA_MAX_ARRAY_ELEMENTS") or str(1 << 28),
                                  1, 1 << 40)
"""Elements of one array in a request (2 GiB of uint64 IDs); also bounds rows x dim of a lookup."""
MAX_DIM = 1 << 16
MAX_ITEMS = 1 << 16
"""Entries of one list (slots, tables, refs)."""
MAX_NAME = 1024
MAX_CARRIED_UPDATES = 1024
"""Earlier batches' updates one lookup may carry (at most the NN worker's backward buffer)."""
MAX_GROUPED_LOOKUPS = 8
"""Batches one ``Step`` may look up together (``persia.nn_worker.lookup_group``)."""
MAX_SEND_GROUP = 16
"""Batches in one data-loader message (``persia.data_loader.grouping``)."""


class MessageError(ValueError):
    """A message that does not match its schema."""


def _array(kinds: str, ndim: int | None = None):
    def check(value: Any) -> np.ndarray:
        if not isinstance(value, np.ndarray):
            raise ValueError(f"expected an array, got {type(value).__name__}")
        if value.dtype.kind not in kinds:
            raise ValueError(f"expected an array of kind {kinds!r}, got dtype {value.dtype}")
        if ndim is not None and value.ndim != ndim:
            raise ValueError(f"expected a {ndim}-D array, got shape {value.shape}")
        if value.size > MAX_ARRAY_ELEMENTS:
            raise ValueError(f"array of {value.size} elements exceeds the limit {MAX_ARRAY_ELEMENTS}")
        return value

    return PlainValidator(check)


IdArray = Annotated[Any, _array("u", 1)]
IndexArray = Annotated[Any, _array("iu", 1)]
AnyArray = Annotated[Any, _array("biuf")]
FloatArray = Annotated[Any, _array("f")]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Index = Annotated[int, Field(ge=0, le=1 << 62)]
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]


class _Msg(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True)


class NoPayload(_Msg):
    """Discovery and status requests carry nothing (None, or an empty map)."""


# -- NATS: data loader -> embedding worker / NN worker ---------------------------------------------
class IdFeatures(_Msg):
    """A batch's ID features packed (``persia.wire.ids``): names, which have one ID per sample,
    every ID in one array, the others' CSR offsets in one ``(n, batch_size + 1)`` array."""

    names: Annotated[list[Name], Field(max_length=MAX_ITEMS)]
    single: Annotated[Any, _array("b", 1)]
    values: IdArray
    offsets: Annotated[Any, _array("iu", 2)]


class Forward(_Msg):
    """``ew.forward.<k>``: a batch's ID features."""

    loader: Index = 0
    session: str | None = Field(default=None, max_length=64)  # one per DataCtx; scopes batch_id
    batch_id: Index | None = None
    # chosen by the loader, which names it to the NN worker in the same breath (None: the worker's)
    ref: Index | None = None
    batch_size: BatchSize
    requires_grad: bool = True
    features: IdFeatures


class NamedArray(_Msg):
    name: str | None = Field(default=None, max_length=MAX_NAME)
    data: AnyArray


class Batch(_Msg):
    """``nn.batch.<rank>``: the dense part of a batch and where its ID features wait."""

    batch_id: Index
    loader: Index = 0
    loader_size: Annotated[int, Field(ge=1, le=1 << 20)] | None = None  # how many loaders (None: an older sender)
    # the NN world size the loader routes for (batch_id % world_size; None: an older sender)
    world_size: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    session: str | None = Field(default=None, max_length=64)  # the sending loader process's
    epoch: Index = 0
    ref: Index
    worker: Index
    requires_grad: bool = True
    non_id: Annotated[list[NamedArray], Field(max_length=MAX_ITEMS)] = []
    labels: Annotated[list[NamedArray], Field(max_length=MAX_ITEMS)] = []
    meta: bytes | None = None


class ForwardGroup(_Msg):
    """``ew.forward_group.<k>``: several batches' ID features from one data loader
    (``PERSIA_DATA_GROUP``), each buffered as a lone ``ew.forward`` would be."""

    batches: Annotated[list[Forward], Field(min_length=1, max_length=MAX_SEND_GROUP)]


class BatchGroup(_Msg):
    """``nn.batch_group.<rank>``: several batches' dense parts from one data loader, each queued
    as a lone ``nn.batch`` would be, in order."""

    batches: Annotated[list[Batch], Field(min_length=1, max_length=MAX_SEND_GROUP)]


class EndOfStream(_Msg):
    """``nn.eos.<rank>``: a data loader ended an epoch (it sent ``sent`` batches of it to this rank)
    or, with ``final``, its whole stream; ``failed`` says it broke off, ``failed_sends`` counts its
    sends that were never acknowledged, by reason."""

    loader: Index
    loader_size: Annotated[int, Field(ge=1, le=1 << 20)]
    session: str | None = Field(default=None, max_length=64)  # the loader process's, as on its batches
    sent: Index
    epoch: Index = 0
    final: bool = True
    failed: str | None = Field(default=None, max_length=4096)
    failed_sends: Annotated[dict[Annotated[str, Field(max_length=64)], Index], Field(max_length=64)] = {}


class TrainerDone(_Msg):
    """``nn.done`` events: an NN rank's outermost streaming context (a TrainCtx, an eval_ctx) ended
    without a failure (loaders stop waiting to tell it things; it may come back)."""

    rank: Index


class Progress(_Msg):
    """``nn.progress`` events."""

    rank: Index
    trained: Index
    loss: float | None = None  # mean training loss since the previous event
    auc: float | None = Field(default=None, ge=0.0, le=1.0)  # training AUC so far (binned)
    staleness: Index | None = None  # embedding updates in flight (batches read, not yet applied)


# -- NATS: PS control --------------------------------------------------------------------------------
class CheckpointDir(_Msg):
    """``ps.dump.<i>`` / ``ps.load.<i>``; the PS checks the path lies under the checkpoint root."""

    dir: Annotated[str, Field(min_length=1, max_length=4096)]


class StartOperation(_Msg):
    """``ps.start.<i>``: a dump or a stage run on the PS's own thread, polled by its ``id`` with
    ``ps.status.<i>`` (``StatusQuery``); the PS checks the path as for ``ps.dump``."""

    op: Literal["dump", "stage"]
    dir: Annotated[str, Field(min_length=1, max_length=4096)]
    id: Annotated[str, Field(min_length=1, max_length=64)]


class StatusQuery(_Msg):
    """``ps.status.<i>``: the PS's state, and with ``id`` that operation's outcome."""

    id: Optional[Annotated[str, Field(min_length=1, max_length=64)]] = None


class Configure(_Msg):
    """``ps.configure.<i>``: ranges are checked by ``persia.embedding_ps.store.HyperParameters``."""

    init_lower: float = -0.01
    init_upper: float = 0.01
    admit_probability: float = 1.0
    weight_bound: float = 10.0
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] = 0


class RegisterOptimizer(BaseModel):
    """``ps.register_optimizer.<i>``: a ``type`` and that optimizer's fields, which
    ``optimizer_from_wire`` validates with the optimizer's own (strict, extra-forbidding) model."""

    model_config = ConfigDict(extra="allow")
    type: str


class RendezvousClaim(_Msg):
    role: Name
    member: Name
    size: Annotated[int, Field(ge=1, le=1 << 20)]


class RendezvousRenew(_Msg):
    role: Name
    member: Name
    index: Optional[Annotated[int, Field(ge=0, lt=1 << 16)]] = None  # taken back if the table forgot it


class RendezvousRelease(_Msg):
    """``rdzv.release``: a member that exits gives its index back (else it is free after the TTL)."""

    role: Name
    member: Name
    index: Annotated[int, Field(ge=0, lt=1 << 16)]


# -- gRPC -------------------------------------------------------------------------------------------
class PsTable(_Msg):
    dim: Dim
    signs: IdArray


class PsAppliedQuery(_Msg):
    """Which of ``source``'s tagged updates with seq >= ``since`` the looked-up rows reflect
    (own-update replay, docs/ps-storage.md)."""

    source: Index
    since: Index


def check_elements(tables: Any, field: str, what: str) -> int:
    """``sum(len(signs) * dim)`` over ``tables`` (validated PsTable/PsGradTable models); ValueError
    naming ``field`` and the total when it exceeds ``MAX_ARRAY_ELEMENTS``. This is what a PS
    allocates and computes for a request, whatever its payload's size: a table's ``signs`` may
    reference the same bytes as another's, so 2.9 MB asked for 64 TiB of rows before. The limit
    is what one gRPC message carries anyway (2^28 float32 rows are ``rpc.MAX_MESSAGE_BYTES``)."""
    total = 0
    for t in tables:
        total += int(t.signs.shape[0]) * int(t.dim)
    if total > MAX_ARRAY_ELEMENTS:
        raise ValueError(f"field {field!r} {what} {total} elements (sum of len(signs) x dim over {len(tables)} "
                         f"tables), more than the limit {MAX_ARRAY_ELEMENTS} (PERSIA_MAX_ARRAY_ELEMENTS)")
    return total


class PsLookup(_Msg):
    """The rows of ``tables``, ``sum(len(signs) * dim)`` at most ``MAX_ARRAY_ELEMENTS``."""

    train: bool
    nonce: Index | None = None  # the batch id: admission draws independent of the sharding
    tables: Annotated[list[PsTable], Field(max_length=MAX_ITEMS)]
    state: bool = False  # also the rows' optimizer state and which positions have no row
    applied: PsAppliedQuery | None = None

    @model_validator(mode="after")
    def _bounded(self) -> "PsLookup":
        check_elements(self.tables, "tables", "asks for")
        return self


def check_grad_table(dim: Any, signs: Any, grads: Any) -> None:
    """A PS gradient table is ``(len(signs), dim)`` gradients: ValueError naming the field and
    the values otherwise. The PS applies a table to the rows of its declared ``dim``; a gradient
    of another width would update (and count as missing) rows of another table. Checked in the
    schema (every request, gRPC or in-process) and by the PS before it applies any table."""
    shape, n = tuple(np.shape(grads)), len(signs)
    if len(shape) != 2:
        raise ValueError(f"field 'grads' must be 2-D (len(signs)={n}, dim={dim!r}), got shape {shape}")
    if shape[1] != dim:
        raise ValueError(f"field 'dim' is {dim!r} but field 'grads' has {shape[1]} columns (shape {shape})")
    if shape[0] != n:
        raise ValueError(f"field 'grads' has {shape[0]} rows (shape {shape}) for the {n} IDs of field 'signs'")


class PsGradTable(_Msg):
    dim: Dim
    signs: IdArray
    grads: Annotated[Any, _array("f", 2)]

    @model_validator(mode="after")
    def _shape_matches(self) -> "PsGradTable":
        check_grad_table(self.dim, self.signs, self.grads)
        return self


class PsUpdate(_Msg):
    """``source``/``seqs``: a tagged update (own-update replay), applied as one critical section
    and recorded as applied for ``source``; seqs without a source are refused. The gradients of
    all ``tables`` together are at most ``MAX_ARRAY_ELEMENTS`` (they may alias each other's bytes);
    the PS refuses non-finite ones (``persia.embedding_ps.service``)."""

    tables: Annotated[list[PsGradTable], Field(max_length=MAX_ITEMS)]
    source: Index | None = None
    seqs: Annotated[list[Index], Field(max_length=MAX_CARRIED_UPDATES)] = []

    @model_validator(mode="after")
    def _seqs_need_a_source(self) -> "PsUpdate":
        if self.seqs and self.source is None:
            raise ValueError(f"field 'seqs' ({self.seqs[:8]}) needs field 'source', which is None")
        check_elements(self.tables, "tables", "carries gradients of")
        return self


class PsStep(_Msg):
    """Update first, then lookup (either may be absent for a replica that owns none of its IDs).
    ``lookups``: several batches' lookups instead of ``lookup``, answered in one list (None: a
    batch with none of its IDs on this replica)."""

    update: PsUpdate | None = None
    lookup: PsLookup | None = None
    lookups: Annotated[list[PsLookup | None], Field(max_length=MAX_GROUPED_LOOKUPS)] = []

    @model_validator(mode="after")
    def _one_form(self) -> "PsStep":
        if self.lookup is not None and self.lookups:
            raise ValueError("fields 'lookup' and 'lookups' are exclusive: send one batch's lookup or a list")
        # the reply holds every lookup's rows: bounded together, as one lookup's
        check_elements([t for q in self.lookups if q is not None for t in q.tables], "lookups", "asks for")
        return self


class WorkerLookup(_Msg):
    ref: Index
    train: bool = True  # False from eval/infer contexts: no rows created, no gradients awaited
    # the NN worker re-applies its own updates this read misses (persia.nn_worker.own_updates):
    # the reply then carries the rows' signs, optimizer state and which of its updates were applied
    replay: PsAppliedQuery | None = None


class WorkerLookupDirect(_Msg):
    batch_size: BatchSize
    features: IdFeatures


class WorkerUpdate(_Msg):
    """Gradients of a looked-up batch: ``grads[i]`` is ``(n_distinct, dim)`` for the i-th entry of
    the Lookup reply's ``tables`` (None: no gradient); the worker checks the shapes against the
    batch. ``unused_slots``: positions of the slots whose tensor got no gradient."""

    ref: Index
    grads: Annotated[list[Annotated[Any, _array("f", 2)] | None], Field(max_length=MAX_ITEMS)]
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    unused_slots: Annotated[list[Annotated[int, Field(ge=0, lt=MAX_ITEMS)]], Field(max_length=MAX_ITEMS)] = []
    source: Index | None = None  # the NN worker's numbering of its updates (persia.nn_worker.own_updates)
    seq: Index | None = None

    @model_validator(mode="after")
    def _seq_needs_a_source(self) -> "WorkerUpdate":
        if self.seq is not None and self.source is None:
            raise ValueError(f"field 'seq' ({self.seq}) needs field 'source', which is None")
        return self


class WorkerStep(_Msg):
    """Lookup of ``ref`` carrying earlier batches' gradients, applied before the lookup; or, with
    ``lookups`` instead of ``ref``, the lookups of several batches in one call per PS replica,
    answered one by one (a batch that cannot be looked up does not fail the others)."""

    ref: Index | None = None
    train: bool = True
    updates: Annotated[list[WorkerUpdate], Field(max_length=MAX_CARRIED_UPDATES)] = []
    replay: PsAppliedQuery | None = None  # as in WorkerLookup
    lookups: Annotated[list[WorkerLookup], Field(max_length=MAX_GROUPED_LOOKUPS)] = []

    @model_validator(mode="after")
    def _one_form(self) -> "WorkerStep":
        if (self.ref is None) == (not self.lookups):
            raise ValueError(f"give field 'ref' or field 'lookups', not both and not neither "
                             f"(ref={self.ref!r}, {len(self.lookups)} lookups)")
        if self.lookups and self.replay is not None:
            raise ValueError("field 'replay' goes with 'ref'; with 'lookups' each lookup has its own")
        return self


MAX_RELEASE_REFS = 4096
"""Refs one release may name: a data loader releases one send group (at most MAX_SEND_GROUP), an
NN worker the batches it handed out and did not train (its buffers); a million took the embedding
worker seconds, all the while holding up what it serves."""


class WorkerRelease(_Msg):
    """``ew.release.<k>`` (signed) and the embedding worker's gRPC ``Release``: batches nobody
    will train on."""

    refs: Annotated[list[Index], Field(max_length=MAX_RELEASE_REFS)] = []


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "message"
        if err["type"] == "missing":
            parts.append(f"field {loc!r} is missing")
            continue
        value = err.get("input")
        if isinstance(value, dict):  # a whole table: the message names the values that matter
            parts.append(f"field {loc!r}: {err['msg']}")
            continue
        shown = f"array{getattr(value, 'shape', '')}" if isinstance(value, np.ndarray) else repr(value)
        parts.append(f"field {loc!r}: {err['msg']} (got {shown[:80]})")
    return "; ".join(parts)


def validate(schema: type[BaseModel] | None, obj: Any, where: str = "message") -> Any:
    """``obj`` itself if it matches ``schema`` (None: no check); MessageError naming the field
    otherwise. Size limits are checked too (a lookup of 10^12 samples is refused here)."""
    if schema is None:
        return obj
    if obj is None and schema in (NoPayload, StatusQuery):  # a status asked without an operation id
        return obj
    if not isinstance(obj, dict):
        raise MessageError(f"{where}: expected a map of fields, got {type(obj).__name__}")
    try:
        schema.model_validate(obj)
    except ValidationError as exc:
        raise MessageError(f"{where}: {_describe(exc)}") from None
    return obj
