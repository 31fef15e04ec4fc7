"""PERSIA's data API: the features, labels and batches a data loader builds and sends.

Same names and signatures as ``persia.embedding.data`` in PERSIA, but every check PERSIA meant to
do is actually done (its per-sample ID check was a generator expression that never ran), errors
name the feature, the sample and the expected and actual value, and checks are vectorized so a
large batch costs a few C-level passes rather than a Python loop per sample.

ID features travel as CSR (``values`` uint64, ``offsets`` int64): the receiving side builds an
:class:`IDTypeFeature` with :meth:`IDTypeFeature.from_csr` and never materializes per-sample lists.
Batches serialize with the pickle-free codec in :mod:`persia.wire.codec`.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from persia import env
from persia.errors import PersiaValidationError
from persia.wire import codec

__all__ = [
    "MAX_BATCH_SIZE",
    "SUPPORTED_NDARRAY_DTYPES",
    "PersiaDataError",
    "PersiaMissingLabelError",
    "PersiaDataTypeError",
    "IDTypeFeature",
    "IDTypeFeatureSparse",
    "IDTypeFeatureWithSingleID",
    "NdarrayDataBase",
    "NonIDTypeFeature",
    "Label",
    "PersiaBatch",
    "skip_check_data",
]

#: PERSIA stored sample indices as u16, so a batch holds at most this many samples.
MAX_BATCH_SIZE = 65535

#: dtypes accepted for non-ID features and labels: numpy types torch can take over without a cast.
#: PERSIA's list plus float16 (PERSIA lacked it). No object, string, unsigned >8-bit or datetime.
SUPPORTED_NDARRAY_DTYPES: Tuple[np.dtype, ...] = tuple(
    np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.float16, np.float32, np.float64,
    )
)
# Compare by (kind, itemsize) so equivalent aliases (np.longlong vs np.int64) are both accepted.
_SUPPORTED_KIND_SIZES = frozenset((d.kind, d.itemsize) for d in SUPPORTED_NDARRAY_DTYPES)
_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED_NDARRAY_DTYPES)

_ID_DTYPE = np.dtype(np.uint64)
_OFFSET_DTYPE = np.dtype(np.int64)
_WIRE_FORMAT = "persia_batch"
_WIRE_VERSION = 1

_GET_NDIM = operator.attrgetter("ndim")
_GET_DTYPE = operator.attrgetter("dtype")
_GET_SIZE = operator.attrgetter("size")


class PersiaDataError(PersiaValidationError):
    """A feature, label or batch that PERSIA cannot train on; the message says which and why.

    A ``ValueError``, and an ``AssertionError`` as PERSIA's ``assert`` checks were."""


class PersiaMissingLabelError(PersiaDataError, RuntimeError):
    """``requires_grad=True`` without labels (a ``RuntimeError`` in PERSIA)."""


class PersiaDataTypeError(PersiaDataError, TypeError):
    """An argument of the wrong Python type (also a :class:`TypeError`)."""


def skip_check_data() -> bool:
    """``PERSIA_SKIP_CHECK_DATA=1`` skips the checks of each feature's data (dtype, ndim, finite
    values), as in PERSIA (``persia.env.skip_check_data``: the same answer as
    ``persia.env.PERSIA_SKIP_CHECK_DATA``).

    Read at every construction (not at import) so a test or a launcher can flip it.
    """
    return env.skip_check_data()


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_name(cls_name: str, name: Any) -> str:
    if not isinstance(name, str):  # np.str_ (names read from an .npz) is a str subclass
        raise PersiaDataTypeError(f"{cls_name}: name must be a str, got {_type_name(name)} {name!r:.80}")
    if not name:
        raise PersiaDataError(f"{cls_name}: name must not be empty")
    return str(name)


def _check_swapped_id_args(cls_name: str, name: Any, data: Any) -> None:
    """Catch ``IDTypeFeature(data, "user_id")`` (one PERSIA tutorial shows this order)."""
    if isinstance(data, str) and not isinstance(name, str):
        raise PersiaDataTypeError(
            f"{cls_name}: arguments look swapped: got {_type_name(name)} as name and the string "
            f"{data!r} as data. The signature is {cls_name}(name, data); "
            f"call {cls_name}({data!r}, data)"
        )


def _count_more(n_bad: int) -> str:
    return "" if n_bad <= 1 else f" ({n_bad} samples are wrong)"


def _validate_lil(name: str, samples: Sequence[Any]) -> None:
    """Every sample is a 1-D ``np.uint64`` ndarray; vectorized over samples (no bytecode per sample)."""
    n = len(samples)
    if n == 0:
        return
    # Fast path: three C-level passes that build tiny sets; the indexed pass below only runs to
    # name the first bad sample.
    if set(map(type, samples)) == {np.ndarray}:
        dtypes = set(map(_GET_DTYPE, samples))
        if len(dtypes) == 1 and dtypes.pop() == _ID_DTYPE and set(map(_GET_NDIM, samples)) == {1}:
            return
    is_array = np.fromiter(map(isinstance, samples, repeat(np.ndarray, n)), dtype=bool, count=n)
    if not is_array.all():
        bad = np.flatnonzero(~is_array)
        i = int(bad[0])
        raise PersiaDataTypeError(
            f"IDTypeFeature {name!r}: sample {i} is a {_type_name(samples[i])}, expected a 1-D "
            f"np.ndarray of dtype uint64{_count_more(bad.size)}; "
            f"convert with np.asarray(sample, dtype=np.uint64)"
        )
    ndim_ok = np.fromiter(map(_GET_NDIM, samples), dtype=np.int64, count=n) == 1
    dtype_ok = np.fromiter(
        map(operator.eq, map(_GET_DTYPE, samples), repeat(_ID_DTYPE, n)), dtype=bool, count=n
    )
    bad = np.flatnonzero(~(ndim_ok & dtype_ok))
    if bad.size:
        i = int(bad[0])
        sample = samples[i]
        problems = []
        if not dtype_ok[i]:
            problems.append(f"dtype {sample.dtype}, expected uint64")
        if not ndim_ok[i]:
            problems.append(f"ndim {sample.ndim} (shape {sample.shape}), expected ndim 1")
        raise PersiaDataError(
            f"IDTypeFeature {name!r}: sample {i} has {' and '.join(problems)}{_count_more(bad.size)}; "
            f"each sample must be a 1-D array, e.g. np.asarray(ids, dtype=np.uint64)"
        )


def _validate_id_array(cls_name: str, name: str, data: np.ndarray, ndim: int) -> None:
    if data.ndim != ndim:
        raise PersiaDataError(
            f"{cls_name} {name!r}: data has ndim {data.ndim} (shape {data.shape}), expected ndim {ndim}"
        )
    if data.dtype != _ID_DTYPE:
        raise PersiaDataError(
            f"{cls_name} {name!r}: data has dtype {data.dtype}, expected uint64; "
            f"convert with np.asarray(data, dtype=np.uint64)"
        )


def _integer_ids(name: str, dtypes: Any) -> None:
    bad = sorted(str(d) for d in dtypes if d.kind not in "iu")
    if bad:
        raise PersiaDataError(f"feature {name!r}: IDs must be integers, got dtype {', '.join(bad)}")


def _concat_ids(name: str, samples: Sequence[np.ndarray]) -> np.ndarray:
    """Samples -> one uint64 array. Checked input is already uint64 (no cast); with
    ``PERSIA_SKIP_CHECK_DATA=1`` signed IDs are reinterpreted as two's complement (a bijection, so
    no two IDs collide) and float IDs are refused rather than truncated."""
    if not samples:
        return np.zeros(0, dtype=_ID_DTYPE)
    try:
        return np.concatenate(samples, dtype=_ID_DTYPE, casting="same_kind")
    except TypeError:
        _integer_ids(name, set(map(_GET_DTYPE, samples)))
        return np.concatenate(samples, dtype=_ID_DTYPE, casting="unsafe")


def _as_ids(name: str, array: np.ndarray) -> np.ndarray:
    if array.dtype != _ID_DTYPE:
        _integer_ids(name, [array.dtype])
    return array.astype(_ID_DTYPE, copy=False)


class IDTypeFeature:
    """A batch of variable-length categorical IDs: one 1-D ``np.uint64`` array per sample (LIL).

    Empty samples are allowed. ``data`` may also be a 2-D uint64 array (every sample has the same
    number of IDs, e.g. ``np.array([[]] * 5, dtype=np.uint64)`` for five empty samples). The feature
    is treated as immutable once built: its CSR form is computed once and cached.
    """

    def __init__(self, name: str, data: Union[List[np.ndarray], np.ndarray]):
        _check_swapped_id_args("IDTypeFeature", name, data)
        self.name = _check_name("IDTypeFeature", name)
        self._lil: Optional[List[np.ndarray]] = None
        self._values: Optional[np.ndarray] = None
        self._offsets: Optional[np.ndarray] = None
        check = not skip_check_data()

        if isinstance(data, np.ndarray) and data.dtype != object:
            if data.ndim == 2:
                if check:
                    _validate_id_array("IDTypeFeature", self.name, data, 2)
                rows, cols = data.shape
                self._values = np.ascontiguousarray(_as_ids(self.name, data)).reshape(-1)
                self._offsets = np.arange(rows + 1, dtype=_OFFSET_DTYPE) * cols
                return
            raise PersiaDataTypeError(
                f"IDTypeFeature {self.name!r}: data is a {data.ndim}-D array of dtype {data.dtype}; "
                f"pass a list with one 1-D np.uint64 array per sample (or a 2-D uint64 array), or use "
                f"IDTypeFeatureWithSingleID(name, ids) for exactly one ID per sample"
            )
        if isinstance(data, np.ndarray):  # 1-D object array of per-sample arrays (e.g. from pandas)
            data = list(data.reshape(-1)) if data.ndim == 1 else data
        if not isinstance(data, (list, tuple)):
            raise PersiaDataTypeError(
                f"IDTypeFeature {self.name!r}: data must be a list of 1-D np.uint64 arrays "
                f"(one per sample), got {_type_name(data)}"
            )
        samples = list(data)
        if check:
            _validate_lil(self.name, samples)
        self._lil = samples

    @classmethod
    def from_csr(cls, name: str, values: np.ndarray, offsets: np.ndarray) -> "IDTypeFeature":
        """Build from CSR arrays (how a feature arrives off the wire) without per-sample lists.

        Always validated, whatever ``PERSIA_SKIP_CHECK_DATA`` says: the arrays come from outside.
        """
        self = cls.__new__(cls)
        self.name = _check_name("IDTypeFeature", name)
        if not isinstance(values, np.ndarray) or not isinstance(offsets, np.ndarray):
            raise PersiaDataTypeError(
                f"IDTypeFeature {self.name!r}: from_csr needs numpy arrays, got values "
                f"{_type_name(values)} and offsets {_type_name(offsets)}"
            )
        if values.ndim != 1 or values.dtype != _ID_DTYPE:
            raise PersiaDataError(
                f"IDTypeFeature {self.name!r}: CSR values must be 1-D uint64, got ndim {values.ndim} "
                f"dtype {values.dtype}"
            )
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or offsets.size < 1:
            raise PersiaDataError(
                f"IDTypeFeature {self.name!r}: CSR offsets must be a non-empty 1-D integer array, "
                f"got ndim {offsets.ndim} dtype {offsets.dtype} size {offsets.size}"
            )
        if offsets.dtype.kind == "u" and offsets.size and int(offsets.max()) > np.iinfo(np.int64).max:
            raise PersiaDataError(f"IDTypeFeature {self.name!r}: CSR offsets overflow int64")
        offsets = offsets.astype(_OFFSET_DTYPE, copy=False)
        if offsets[0] != 0 or offsets[-1] != values.size:
            raise PersiaDataError(
                f"IDTypeFeature {self.name!r}: CSR offsets must start at 0 and end at len(values) "
                f"= {values.size}, got first {int(offsets[0])} and last {int(offsets[-1])}"
            )
        steps = np.diff(offsets)
        if steps.size and steps.min() < 0:
            i = int(np.flatnonzero(steps < 0)[0])
            raise PersiaDataError(
                f"IDTypeFeature {self.name!r}: CSR offsets must be non-decreasing, but offsets[{i + 1}] "
                f"= {int(offsets[i + 1])} < offsets[{i}] = {int(offsets[i])}"
            )
        self._lil = None
        self._values = values
        self._offsets = offsets
        return self

    @property
    def data(self) -> List[np.ndarray]:
        """The per-sample list (LIL). Built lazily, as views, for a feature made from CSR."""
        if self._lil is None:
            assert self._values is not None and self._offsets is not None
            n = self._offsets.size - 1
            self._lil = [] if n == 0 else np.split(self._values, self._offsets[1:-1])
        return self._lil

    @property
    def batch_size(self) -> int:
        if self._lil is not None:
            return len(self._lil)
        assert self._offsets is not None
        return int(self._offsets.size - 1)

    def to_csr(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(values uint64[nnz], offsets int64[batch_size + 1])``; sample i is values[o[i]:o[i+1]]."""
        if self._values is None:
            samples = self._lil
            assert samples is not None
            n = len(samples)
            offsets = np.zeros(n + 1, dtype=_OFFSET_DTYPE)
            if n:
                np.cumsum(np.fromiter(map(_GET_SIZE, samples), dtype=np.int64, count=n), out=offsets[1:])
            self._values = _concat_ids(self.name, samples)
            self._offsets = offsets
        assert self._offsets is not None
        return self._values, self._offsets

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, batch_size={self.batch_size})"


#: Name used by some PERSIA releases' examples for the same class.
IDTypeFeatureSparse = IDTypeFeature


class IDTypeFeatureWithSingleID:
    """Exactly one uint64 ID per sample, as a 1-D ``np.uint64`` array (no empty samples)."""

    def __init__(self, name: str, data: np.ndarray):
        _check_swapped_id_args("IDTypeFeatureWithSingleID", name, data)
        self.name = _check_name("IDTypeFeatureWithSingleID", name)
        if not isinstance(data, np.ndarray):
            raise PersiaDataTypeError(
                f"IDTypeFeatureWithSingleID {self.name!r}: data must be a 1-D np.ndarray of dtype "
                f"uint64, got {_type_name(data)}; convert with np.asarray(data, dtype=np.uint64)"
            )
        self.data = data
        if not skip_check_data():
            self.validate()

    def validate(self) -> None:
        """Check dtype and ndim (always run for batches decoded off the wire)."""
        _validate_id_array("IDTypeFeatureWithSingleID", self.name, self.data, 1)

    @property
    def batch_size(self) -> int:
        if self.data.ndim == 0:
            raise PersiaDataError(f"IDTypeFeatureWithSingleID {self.name!r}: a 0-d array has no batch size")
        return int(self.data.shape[0])

    def id_values(self) -> np.ndarray:
        """The IDs as one 1-D uint64 array (no offsets: one per sample)."""
        return _as_ids(self.name, self.data).reshape(-1)

    def to_csr(self) -> Tuple[np.ndarray, np.ndarray]:
        values = self.id_values()
        return values, np.arange(values.size + 1, dtype=_OFFSET_DTYPE)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, batch_size={self.batch_size})"


class NdarrayDataBase:
    """A dense array of any shape with the batch on axis 0 (non-ID features, labels).

    Signature is ``(data, name=None)`` (data first, unlike the ID features), as in PERSIA.
    """

    DEFAULT_NAME = "ndarray_base"

    def __init__(self, data: np.ndarray, name: Optional[str] = None):
        cls_name = type(self).__name__
        if isinstance(data, str) and isinstance(name, np.ndarray):
            raise PersiaDataTypeError(
                f"{cls_name}: arguments look swapped: got the string {data!r} as data and an array as "
                f"name. The signature is {cls_name}(data, name=None); call {cls_name}(data, name={data!r})"
            )
        if name is not None:
            name = _check_name(cls_name, name)
        self._name = name
        if not isinstance(data, np.ndarray):
            raise PersiaDataTypeError(
                f"{cls_name} {self.name!r}: data must be a np.ndarray, got {_type_name(data)}; "
                f"convert with np.asarray(data, dtype=...)"
            )
        self.data = data
        if not skip_check_data():
            self.validate()
            self.check_finite()

    def check_finite(self) -> None:
        """Refuse NaN and infinities in a float array, naming the first sample (row) holding one.
        Run where the data is built (a data loader's ``NonIDTypeFeature``/``Label``), unless
        ``PERSIA_SKIP_CHECK_DATA`` is on; not for batches decoded off the wire (their sender
        checked, or chose not to)."""
        data = self.data
        if data.dtype.kind != "f" or data.size == 0:
            return
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.add.reduce(data, axis=None)  # one pass, no copy: finite unless some value is not
        if np.isfinite(total):
            return
        bad_rows = ~np.isfinite(data).reshape(data.shape[0], -1).all(axis=1)
        if not bad_rows.any():  # the sum overflowed; every value is finite
            return
        rows = np.flatnonzero(bad_rows)
        row = int(rows[0])
        values = data[row].reshape(-1)
        value = values[~np.isfinite(values)][0]
        more = f" ({rows.size} samples hold one)" if rows.size > 1 else ""
        raise PersiaDataError(
            f"{type(self).__name__} {self.name!r}: sample {row} holds {float(value)} (NaN and infinities "
            f"are not allowed in float data){more}; clean or impute the data, or set "
            f"PERSIA_SKIP_CHECK_DATA=1 to skip the data checks"
        )

    def validate(self) -> None:
        """Check dtype and ndim (always run for batches decoded off the wire)."""
        cls_name, dtype = type(self).__name__, self.data.dtype
        if (dtype.kind, dtype.itemsize) not in _SUPPORTED_KIND_SIZES:
            raise PersiaDataError(
                f"{cls_name} {self.name!r}: dtype {dtype} is not supported; supported dtypes: "
                f"{_SUPPORTED_NAMES}"
            )
        if not dtype.isnative:
            raise PersiaDataError(
                f"{cls_name} {self.name!r}: dtype {dtype.str} has non-native byte order, expected "
                f"{dtype.newbyteorder('=').str}; convert with data.astype(data.dtype.newbyteorder('='))"
            )
        if self.data.ndim < 1:
            raise PersiaDataError(
                f"{cls_name} {self.name!r}: data has ndim 0 (a scalar), expected ndim >= 1 with the "
                f"batch on axis 0"
            )

    @property
    def name(self) -> str:
        return self._name or self.DEFAULT_NAME

    @property
    def batch_size(self) -> int:
        if self.data.ndim == 0:
            raise PersiaDataError(f"{type(self).__name__} {self.name!r}: a 0-d array has no batch size")
        return int(self.data.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, shape={self.data.shape}, "
            f"dtype={self.data.dtype})"
        )


class NonIDTypeFeature(NdarrayDataBase):
    """Dense input features (any supported dtype and shape, e.g. images ``(bs, 3, 224, 224)``)."""

    DEFAULT_NAME = "non_id_type_feature_anonymous"


class Label(NdarrayDataBase):
    """Training targets (any supported dtype and shape)."""

    DEFAULT_NAME = "label_anonymous"


_IDFeature = Union[IDTypeFeature, IDTypeFeatureWithSingleID]


def _as_parts(
    arg: Any, arg_name: str, expected: tuple, expected_name: str, wrap_hint: str, reject: tuple = ()
) -> list:
    if arg is None:
        return []
    if isinstance(arg, (*expected, np.ndarray)):
        raise PersiaDataTypeError(
            f"PersiaBatch: {arg_name} must be a list of {expected_name}, got a single "
            f"{_type_name(arg)}; wrap it in a list"
        )
    if not isinstance(arg, (list, tuple)):
        raise PersiaDataTypeError(
            f"PersiaBatch: {arg_name} must be a list of {expected_name}, got {_type_name(arg)}"
        )
    for i, part in enumerate(arg):
        if not isinstance(part, expected) or isinstance(part, reject):
            hint = f"; wrap arrays, e.g. {wrap_hint}" if isinstance(part, (np.ndarray, list)) else ""
            raise PersiaDataTypeError(
                f"PersiaBatch: {arg_name}[{i}] is a {_type_name(part)}, expected {expected_name}{hint}"
            )
    return list(arg)


def _check_unique_names(kind: str, parts: Sequence[Any], default_name: Optional[str] = None) -> None:
    seen: dict = {}
    for i, part in enumerate(parts):
        if part.name in seen:
            hint = ""
            if default_name is not None and part.name == default_name:
                hint = f" (unnamed ones all get {default_name!r}: pass name=...)"
            raise PersiaDataError(
                f"PersiaBatch: duplicate {kind} name {part.name!r} (positions {seen[part.name]} and {i}); "
                f"each {kind} needs its own name{hint}"
            )
        seen[part.name] = i


class PersiaBatch:
    """One batch: ID features, non-ID features, labels and optional ``meta`` bytes.

    Checked on construction: at least one ID feature; one batch size across every part (and equal
    to ``batch_size`` if given), within ``1..MAX_BATCH_SIZE``; labels present when
    ``requires_grad``; ``meta`` is bytes (a ``str`` is stored UTF-8 encoded: PERSIA warned and
    dropped it, yet its tutorials pass ``json.dumps(...)``); names unique among ID features, among non-ID features,
    and among labels. ``batch_id`` stays ``None`` until a ``DataCtx`` assigns it.
    """

    def __init__(
        self,
        id_type_features: List[_IDFeature],
        non_id_type_features: Optional[List[NonIDTypeFeature]] = None,
        labels: Optional[List[Label]] = None,
        batch_size: Optional[int] = None,
        requires_grad: bool = True,
        meta: Optional[bytes] = None,
    ):
        id_parts = _as_parts(
            id_type_features, "id_type_features", (IDTypeFeature, IDTypeFeatureWithSingleID),
            "IDTypeFeature or IDTypeFeatureWithSingleID", "IDTypeFeature(name, [ids_per_sample, ...])",
        )
        if not id_parts:
            raise PersiaDataError("PersiaBatch: id_type_features is empty; a batch needs at least one ID type feature")
        non_id_parts = _as_parts(
            non_id_type_features, "non_id_type_features", (NdarrayDataBase,), "NonIDTypeFeature",
            "NonIDTypeFeature(array, name=...)", (Label,),
        )
        label_parts = _as_parts(
            labels, "labels", (NdarrayDataBase,), "Label", "Label(array, name=...)", (NonIDTypeFeature,)
        )

        if not isinstance(requires_grad, (bool, np.bool_)):
            raise PersiaDataTypeError(
                f"PersiaBatch: requires_grad must be a bool, got {_type_name(requires_grad)} {requires_grad!r:.40}"
            )
        requires_grad = bool(requires_grad)

        if batch_size is not None:
            if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)):
                raise PersiaDataTypeError(
                    f"PersiaBatch: batch_size must be an int, got {_type_name(batch_size)} {batch_size!r:.40}"
                )
            ref_size, ref_what = int(batch_size), "the batch_size argument"
        else:
            ref_size, ref_what = id_parts[0].batch_size, f"id_type_feature {id_parts[0].name!r}"
        if ref_size < 1:
            raise PersiaDataError(f"PersiaBatch: batch_size must be at least 1, got {ref_size} (from {ref_what})")
        if ref_size > MAX_BATCH_SIZE:
            raise PersiaDataError(
                f"PersiaBatch: batch_size {ref_size} (from {ref_what}) exceeds MAX_BATCH_SIZE "
                f"{MAX_BATCH_SIZE}; split the batch"
            )
        for kind, parts in (
            ("id_type_feature", id_parts), ("non_id_type_feature", non_id_parts), ("label", label_parts)
        ):
            for part in parts:
                if part.batch_size != ref_size:
                    raise PersiaDataError(
                        f"PersiaBatch: {kind} {part.name!r} has batch_size {part.batch_size}, but "
                        f"{ref_what} has batch_size {ref_size}; every part of a batch needs the same "
                        f"number of samples"
                    )

        _check_unique_names("id_type_feature", id_parts)
        _check_unique_names("non_id_type_feature", non_id_parts, NonIDTypeFeature.DEFAULT_NAME)
        _check_unique_names("label", label_parts, Label.DEFAULT_NAME)

        if requires_grad and not label_parts:
            raise PersiaMissingLabelError(
                "PersiaBatch: requires_grad=True (the default) needs at least one Label, but labels is "
                "empty; pass labels=[Label(...)] for training, or requires_grad=False for inference"
            )

        if meta is not None:
            if isinstance(meta, (bytearray, memoryview)):
                meta = bytes(meta)
            elif isinstance(meta, str):  # PERSIA's tutorials pass json.dumps(...); PERSIA dropped it
                meta = meta.encode("utf-8")
            elif not isinstance(meta, bytes):
                raise PersiaDataTypeError(f"PersiaBatch: meta must be bytes or str, got {_type_name(meta)}")

        self.id_type_features: List[_IDFeature] = id_parts
        self.non_id_type_features: List[NdarrayDataBase] = non_id_parts
        self.labels: List[NdarrayDataBase] = label_parts
        self.batch_size: int = ref_size
        self.requires_grad: bool = requires_grad
        self.meta: Optional[bytes] = meta
        self.batch_id: Optional[int] = None

    # --- serialization -------------------------------------------------------------------------

    def to_wire(self) -> dict:
        """A plain tree (dicts, lists, scalars, bytes, ndarrays) for :func:`persia.wire.codec.encode`."""
        id_features = []
        for feature in self.id_type_features:
            values, offsets = feature.to_csr()
            single = isinstance(feature, IDTypeFeatureWithSingleID)
            id_features.append(
                {"name": feature.name, "single_id": single, "values": values, "offsets": None if single else offsets}
            )
        return {
            "format": _WIRE_FORMAT,
            "version": _WIRE_VERSION,
            "batch_size": self.batch_size,
            "requires_grad": self.requires_grad,
            "meta": self.meta,
            "batch_id": self.batch_id,
            "id_type_features": id_features,
            "non_id_type_features": [{"name": p.name, "data": p.data} for p in self.non_id_type_features],
            "labels": [{"name": p.name, "data": p.data} for p in self.labels],
        }

    @classmethod
    def from_wire(cls, tree: Any) -> "PersiaBatch":
        """Inverse of :meth:`to_wire`; every field is checked (the tree came from outside)."""
        where = "PersiaBatch payload"
        if not isinstance(tree, dict):
            raise PersiaDataError(f"{where}: expected a mapping, got {_type_name(tree)}")
        if tree.get("format") != _WIRE_FORMAT or tree.get("version") != _WIRE_VERSION:
            raise PersiaDataError(
                f"{where}: expected format {_WIRE_FORMAT!r} version {_WIRE_VERSION}, got "
                f"{tree.get('format')!r:.40} version {tree.get('version')!r:.40}"
            )

        def field(d: dict, key: str, types: tuple, what: str, optional: bool = False) -> Any:
            if key not in d:
                raise PersiaDataError(f"{where}: {what} is missing {key!r}")
            value = d[key]
            if value is None and optional:
                return None
            if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
                raise PersiaDataError(
                    f"{where}: {what}.{key} must be {' or '.join(t.__name__ for t in types)}, "
                    f"got {_type_name(value)}"
                )
            return value

        def entries(key: str) -> list:
            return field(tree, key, (list,), "batch")

        id_features: List[_IDFeature] = []
        for i, entry in enumerate(entries("id_type_features")):
            what = f"id_type_features[{i}]"
            if not isinstance(entry, dict):
                raise PersiaDataError(f"{where}: {what} must be a mapping, got {_type_name(entry)}")
            name = field(entry, "name", (str,), what)
            values = field(entry, "values", (np.ndarray,), what)
            if field(entry, "single_id", (bool,), what):
                feature = IDTypeFeatureWithSingleID.__new__(IDTypeFeatureWithSingleID)
                feature.name, feature.data = name, values
                feature.validate()
            else:
                feature = IDTypeFeature.from_csr(name, values, field(entry, "offsets", (np.ndarray,), what))
            id_features.append(feature)

        def dense(key: str, part_cls: type) -> list:
            parts = []
            for i, entry in enumerate(entries(key)):
                what = f"{key}[{i}]"
                if not isinstance(entry, dict):
                    raise PersiaDataError(f"{where}: {what} must be a mapping, got {_type_name(entry)}")
                part = part_cls.__new__(part_cls)
                part._name = _check_name(part_cls.__name__, field(entry, "name", (str,), what))
                part.data = field(entry, "data", (np.ndarray,), what)
                part.validate()
                parts.append(part)
            return parts

        batch = cls(
            id_features,
            non_id_type_features=dense("non_id_type_features", NonIDTypeFeature),
            labels=dense("labels", Label),
            batch_size=field(tree, "batch_size", (int,), "batch"),
            requires_grad=field(tree, "requires_grad", (bool,), "batch"),
            meta=field(tree, "meta", (bytes,), "batch", optional=True),
        )
        batch.batch_id = field(tree, "batch_id", (int,), "batch", optional=True)
        return batch

    def to_bytes(self) -> bytes:
        """Serialize with the pickle-free wire codec (PERSIA used this as the inference payload)."""
        return codec.encode(self.to_wire())

    @classmethod
    def from_bytes(cls, buf: Union[bytes, bytearray, memoryview]) -> "PersiaBatch":
        """Inverse of :meth:`to_bytes`. Arrays are read-only views into ``buf`` (copy to mutate)."""
        try:
            tree = codec.decode(buf)
        except codec.WireError as exc:
            raise PersiaDataError(f"not a PersiaBatch payload: {exc}") from exc
        return cls.from_wire(tree)

    def __repr__(self) -> str:
        return (
            f"PersiaBatch(batch_size={self.batch_size}, batch_id={self.batch_id}, "
            f"id_type_features={[f.name for f in self.id_type_features]}, "
            f"non_id_type_features={[f.name for f in self.non_id_type_features]}, "
            f"labels={[f.name for f in self.labels]}, requires_grad={self.requires_grad}, "
            f"meta={'None' if self.meta is None else f'<{len(self.meta)} bytes>'})"
        )
