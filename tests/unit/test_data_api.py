"""persia.embedding.data: every check PERSIA meant to do, CSR conversion, and the wire round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persia.embedding.data import (
    MAX_BATCH_SIZE,
    SUPPORTED_NDARRAY_DTYPES,
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    NdarrayDataBase,
    NonIDTypeFeature,
    PersiaBatch,
    PersiaDataError,
    PersiaDataTypeError,
)
from persia.wire import codec


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def lil_feature(name: str = "user_id", batch: int = 3) -> IDTypeFeature:
    return IDTypeFeature(name, [ids(i, i + 1) for i in range(batch)])


def train_batch(batch: int = 3, **kwargs) -> PersiaBatch:
    kwargs.setdefault("labels", [Label(np.zeros((batch, 1), dtype=np.float32))])
    return PersiaBatch([lil_feature(batch=batch)], **kwargs)


@pytest.fixture(autouse=True)
def _checks_on(monkeypatch):
    monkeypatch.delenv("PERSIA_SKIP_CHECK_DATA", raising=False)


# --- IDTypeFeature -------------------------------------------------------------------------------


def test_lil_to_csr_with_empty_samples():
    feature = IDTypeFeature("user_id", [ids(1000, 1001), ids(1000), ids(), ids(5, 6, 7), ids()])
    values, offsets = feature.to_csr()
    assert feature.batch_size == 5
    assert values.dtype == np.uint64 and offsets.dtype == np.int64
    assert values.tolist() == [1000, 1001, 1000, 5, 6, 7]
    assert offsets.tolist() == [0, 2, 3, 3, 6, 6]


def test_full_range_uint64_ids_survive():
    top = np.iinfo(np.uint64).max
    values, _ = IDTypeFeature("x", [ids(top, 0), ids(top - 1)]).to_csr()
    assert values.tolist() == [top, 0, top - 1]


def test_two_dimensional_array_is_accepted_as_equal_length_samples():
    # The customization guide builds five empty samples as np.array([[]] * 5, dtype=np.uint64).
    empty = IDTypeFeature("empty_sample", np.array([[]] * 5, dtype=np.uint64))
    values, offsets = empty.to_csr()
    assert empty.batch_size == 5 and values.size == 0 and offsets.tolist() == [0] * 6
    assert [s.size for s in empty.data] == [0] * 5

    dense = IDTypeFeature("pairs", np.array([[1, 2], [3, 4], [5, 6]], dtype=np.uint64))
    values, offsets = dense.to_csr()
    assert values.tolist() == [1, 2, 3, 4, 5, 6] and offsets.tolist() == [0, 2, 4, 6]


def test_swapped_arguments_are_a_clear_type_error():
    with pytest.raises(TypeError, match=r"arguments look swapped.*IDTypeFeature\(name, data\).*IDTypeFeature\('user_id', data\)"):
        IDTypeFeature([ids(1)], "user_id")
    with pytest.raises(TypeError, match=r"IDTypeFeatureWithSingleID\(name, data\)"):
        IDTypeFeatureWithSingleID(ids(1, 2), "user_id")


def test_wrong_sample_dtype_names_feature_sample_and_dtypes():
    with pytest.raises(PersiaDataError) as err:
        IDTypeFeature("photo_id", [ids(1), ids(2), np.array([3], dtype=np.int64), np.array([4], dtype=np.int32)])
    message = str(err.value)
    assert "'photo_id'" in message and "sample 2" in message
    assert "dtype int64" in message and "expected uint64" in message
    assert "2 samples are wrong" in message


def test_wrong_sample_ndim_names_sample_and_shape():
    with pytest.raises(PersiaDataError, match=r"'photo_id': sample 1 has ndim 2 \(shape \(1, 2\)\), expected ndim 1"):
        IDTypeFeature("photo_id", [ids(1), np.array([[1, 2]], dtype=np.uint64)])
    with pytest.raises(PersiaDataError, match=r"sample 0 has dtype int64, expected uint64 and ndim 0"):
        IDTypeFeature("photo_id", [np.array(3)])


def test_non_array_sample_is_a_type_error():
    with pytest.raises(PersiaDataTypeError, match=r"'user_id': sample 1 is a list, expected a 1-D np.ndarray of dtype uint64"):
        IDTypeFeature("user_id", [ids(1), [2, 3]])


def test_one_dimensional_array_points_to_single_id_feature():
    with pytest.raises(PersiaDataTypeError, match=r"1-D array of dtype uint64.*IDTypeFeatureWithSingleID"):
        IDTypeFeature("user_id", ids(1, 2, 3))


def test_data_and_name_types_are_checked():
    with pytest.raises(PersiaDataTypeError, match=r"'user_id': data must be a list of 1-D np.uint64 arrays.*got dict"):
        IDTypeFeature("user_id", {0: ids(1)})
    with pytest.raises(PersiaDataTypeError, match=r"name must be a str, got int"):
        IDTypeFeature(3, [ids(1)])
    with pytest.raises(PersiaDataError, match="name must not be empty"):
        IDTypeFeature("", [ids(1)])


def test_numpy_string_name_from_npz_is_accepted():
    names = np.array(["workclass"])  # PERSIA's example reads slot names from an .npz file
    feature = IDTypeFeature(names[0], [ids(1)])
    assert feature.name == "workclass" and type(feature.name) is str


def test_object_array_of_samples_is_accepted():
    samples = np.empty(2, dtype=object)
    samples[0], samples[1] = ids(1, 2), ids()
    assert IDTypeFeature("x", samples).to_csr()[1].tolist() == [0, 2, 2]


def test_from_csr_builds_lil_lazily_as_views():
    values, offsets = ids(1, 2, 3, 4), np.array([0, 2, 2, 4], dtype=np.int64)
    feature = IDTypeFeature.from_csr("user_id", values, offsets)
    assert feature.batch_size == 3
    got_values, got_offsets = feature.to_csr()
    assert got_values is values  # no copy on the receiving side
    assert feature._lil is None  # nothing per-sample built yet
    samples = feature.data
    assert [s.tolist() for s in samples] == [[1, 2], [], [3, 4]]
    assert all(np.shares_memory(s, values) for s in samples if s.size)


def test_from_csr_zero_samples():
    feature = IDTypeFeature.from_csr("x", ids(), np.array([0]))
    assert feature.batch_size == 0 and feature.data == []


@pytest.mark.parametrize(
    "values, offsets, message",
    [
        (np.array([1, 2], dtype=np.int64), np.array([0, 2]), r"values must be 1-D uint64, got ndim 1 dtype int64"),
        (ids(1, 2), np.array([[0, 2]]), r"offsets must be a non-empty 1-D integer array"),
        (ids(1, 2), np.array([], dtype=np.int64), r"offsets must be a non-empty 1-D integer array"),
        (ids(1, 2), np.array([0.0, 2.0]), r"offsets must be a non-empty 1-D integer array"),
        (ids(1, 2), np.array([1, 2]), r"start at 0 and end at len\(values\) = 2, got first 1"),
        (ids(1, 2), np.array([0, 3]), r"end at len\(values\) = 2, got first 0 and last 3"),
        (ids(1, 2, 3), np.array([0, 2, 1, 3]), r"non-decreasing, but offsets\[2\] = 1 < offsets\[1\] = 2"),
        ([1, 2], np.array([0, 2]), r"from_csr needs numpy arrays"),
    ],
)
def test_from_csr_rejects_inconsistent_arrays(values, offsets, message):
    with pytest.raises(PersiaDataError, match=message):
        IDTypeFeature.from_csr("user_id", values, offsets)


lil_strategy = st.lists(
    st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=6), min_size=0, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(lil_strategy)
def test_csr_round_trip_property(samples):
    feature = IDTypeFeature("f", [np.array(s, dtype=np.uint64) for s in samples])
    values, offsets = feature.to_csr()
    assert offsets[0] == 0 and offsets[-1] == values.size
    assert np.diff(offsets).tolist() == [len(s) for s in samples]
    assert values.tolist() == [v for s in samples for v in s]
    back = IDTypeFeature.from_csr("f", values, offsets)
    assert back.batch_size == len(samples)
    assert [s.tolist() for s in back.data] == samples


# --- IDTypeFeatureWithSingleID -------------------------------------------------------------------


def test_single_id_csr_is_trivial():
    feature = IDTypeFeatureWithSingleID("item", ids(7, 8, 9))
    values, offsets = feature.to_csr()
    assert feature.batch_size == 3
    assert values.tolist() == [7, 8, 9] and offsets.tolist() == [0, 1, 2, 3]
    assert offsets.dtype == np.int64


def test_the_wire_record_takes_single_id_values_as_they_are_and_offsets_only_of_the_others():
    from persia.data_loader.wire import id_features_to_wire
    from persia.wire import ids as packed

    by_slot = np.ascontiguousarray(np.arange(12, dtype=np.uint64).reshape(4, 3).T)  # rows of a transposed block
    batch = PersiaBatch([IDTypeFeatureWithSingleID("a", by_slot[0]), lil_feature("b", 4),
                         IDTypeFeatureWithSingleID("c", by_slot[2])], requires_grad=False)
    record = id_features_to_wire(batch)
    assert record["single"].tolist() == [True, False, True]
    assert record["offsets"].tolist() == [lil_feature("b", 4).to_csr()[1].tolist()]
    unpacked = packed.unpack(record, 4)
    assert unpacked.feature(0)[0].tolist() == [0, 3, 6, 9] and unpacked.feature(0)[1] is None
    assert unpacked.feature(2)[0].tolist() == [2, 5, 8, 11]
    assert unpacked.feature(1)[0].tolist() == lil_feature("b", 4).to_csr()[0].tolist()


@pytest.mark.parametrize(
    "data, error, message",
    [
        (np.array([1, 2], dtype=np.int64), PersiaDataError, r"'item': data has dtype int64, expected uint64"),
        (np.array([[1], [2]], dtype=np.uint64), PersiaDataError, r"'item': data has ndim 2 \(shape \(2, 1\)\), expected ndim 1"),
        ([1, 2], PersiaDataTypeError, r"'item': data must be a 1-D np.ndarray of dtype uint64, got list"),
    ],
)
def test_single_id_checks(data, error, message):
    with pytest.raises(error, match=message):
        IDTypeFeatureWithSingleID("item", data)


# --- NonIDTypeFeature / Label ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED_NDARRAY_DTYPES, ids=str)
def test_every_supported_dtype_and_any_shape(dtype):
    image = NonIDTypeFeature(np.zeros((4, 3, 2, 2), dtype=dtype), name="img")
    label = Label(np.zeros(4, dtype=dtype))
    assert image.batch_size == 4 and len(image) == 4 and label.batch_size == 4


def test_float16_is_supported():
    assert np.dtype(np.float16) in SUPPORTED_NDARRAY_DTYPES
    NonIDTypeFeature(np.ones((2, 2), dtype=np.float16))


@pytest.mark.parametrize(
    "array",
    [
        np.array([object(), object()], dtype=object),
        np.array(["a", "b"]),
        np.array([b"a", b"b"]),
        np.zeros(2, dtype=np.uint16),
        np.zeros(2, dtype=np.uint32),
        np.zeros(2, dtype=np.uint64),
        np.zeros(2, dtype=np.complex64),
        np.zeros(2, dtype="datetime64[s]"),
    ],
    ids=lambda a: str(a.dtype),
)
def test_unsupported_dtypes_are_rejected_with_the_supported_list(array):
    with pytest.raises(PersiaDataError) as err:
        NonIDTypeFeature(array, name="height")
    message = str(err.value)
    assert f"NonIDTypeFeature 'height': dtype {array.dtype} is not supported" in message
    assert "float16" in message and "float32" in message and "bool" in message


def test_dense_checks_name_the_part():
    with pytest.raises(PersiaDataError, match=r"Label 'ctr': data has ndim 0 \(a scalar\), expected ndim >= 1"):
        Label(np.array(1.0, dtype=np.float32), name="ctr")
    with pytest.raises(PersiaDataError, match=r"dtype >f4 has non-native byte order, expected <f4"):
        NonIDTypeFeature(np.ones(3, dtype=">f4"))
    with pytest.raises(PersiaDataTypeError, match=r"Label 'label_anonymous': data must be a np.ndarray, got list"):
        Label([1.0, 2.0])
    with pytest.raises(PersiaDataTypeError, match=r"arguments look swapped.*NonIDTypeFeature\(data, name='height'\)"):
        NonIDTypeFeature("height", np.ones(3, dtype=np.float32))


def test_default_names():
    assert NonIDTypeFeature(np.ones(2)).name == "non_id_type_feature_anonymous"
    assert Label(np.ones(2)).name == "label_anonymous"
    assert NdarrayDataBase(np.ones(2)).name == "ndarray_base"
    assert Label(np.ones(2), name="ctr").name == "ctr"


def test_skip_check_data_skips_dtype_and_ndim_checks(monkeypatch):
    monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", "1")
    assert NonIDTypeFeature(np.zeros(2, dtype=np.uint32)).data.dtype == np.uint32
    feature = IDTypeFeature("x", [np.array([1, -1], dtype=np.int64), ids(3)])
    values, _ = feature.to_csr()  # signed IDs reinterpreted, never collide
    assert values.dtype == np.uint64 and values.tolist() == [1, 2**64 - 1, 3]
    with pytest.raises(PersiaDataError, match="'x': IDs must be integers, got dtype float64"):
        IDTypeFeature("x", [np.array([1.5])]).to_csr()
    monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", "0")
    with pytest.raises(PersiaDataError):
        NonIDTypeFeature(np.zeros(2, dtype=np.uint32))


# --- PersiaBatch ---------------------------------------------------------------------------------


def test_valid_batch_attributes():
    batch = PersiaBatch(
        [lil_feature("user_id"), IDTypeFeatureWithSingleID("item", ids(1, 2, 3))],
        non_id_type_features=[NonIDTypeFeature(np.ones((3, 2), dtype=np.float32), name="dense")],
        labels=[Label(np.ones(3, dtype=bool), name="ctr")],
        meta=b"{}",
    )
    assert batch.batch_size == 3 and batch.requires_grad is True and batch.meta == b"{}"
    assert batch.batch_id is None
    assert [f.name for f in batch.id_type_features] == ["user_id", "item"]
    assert [f.name for f in batch.non_id_type_features] == ["dense"]
    assert [f.name for f in batch.labels] == ["ctr"]


def test_at_least_one_id_feature():
    with pytest.raises(PersiaDataError, match="id_type_features is empty; a batch needs at least one ID type feature"):
        PersiaBatch([], labels=[Label(np.ones(2))])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"non_id_type_features": [NonIDTypeFeature(np.ones(4), name="height")]},
            r"non_id_type_feature 'height' has batch_size 4, but id_type_feature 'user_id' has batch_size 3",
        ),
        (
            {"labels": [Label(np.ones(2), name="ctr")]},
            r"label 'ctr' has batch_size 2, but id_type_feature 'user_id' has batch_size 3",
        ),
        (
            {"batch_size": 5},
            r"id_type_feature 'user_id' has batch_size 3, but the batch_size argument has batch_size 5",
        ),
    ],
)
def test_batch_size_mismatch_names_part_and_both_sizes(kwargs, message):
    with pytest.raises(PersiaDataError, match=message):
        train_batch(3, **kwargs)


def test_id_features_must_agree_with_each_other():
    with pytest.raises(PersiaDataError, match=r"id_type_feature 'b' has batch_size 2, but id_type_feature 'a' has batch_size 3"):
        PersiaBatch([lil_feature("a", 3), lil_feature("b", 2)], requires_grad=False)


def test_batch_size_bounds():
    with pytest.raises(PersiaDataError, match="batch_size must be at least 1, got 0"):
        PersiaBatch([IDTypeFeature("a", [])], requires_grad=False)
    big = MAX_BATCH_SIZE + 1
    with pytest.raises(PersiaDataError, match=rf"batch_size {big} .* exceeds MAX_BATCH_SIZE {MAX_BATCH_SIZE}"):
        PersiaBatch([IDTypeFeatureWithSingleID("a", np.zeros(big, dtype=np.uint64))], requires_grad=False)
    at_max = PersiaBatch([IDTypeFeatureWithSingleID("a", np.zeros(MAX_BATCH_SIZE, dtype=np.uint64))], requires_grad=False)
    assert at_max.batch_size == MAX_BATCH_SIZE
    with pytest.raises(PersiaDataTypeError, match="batch_size must be an int, got bool"):
        train_batch(3, batch_size=True)


def test_requires_grad_needs_labels():
    with pytest.raises(PersiaDataError, match=r"requires_grad=True \(the default\) needs at least one Label"):
        PersiaBatch([lil_feature()])
    inference = PersiaBatch([lil_feature()], requires_grad=False)
    assert inference.labels == [] and inference.requires_grad is False
    with pytest.raises(PersiaDataTypeError, match="requires_grad must be a bool, got str"):
        PersiaBatch([lil_feature()], requires_grad="no")


def test_meta_is_bytes_and_text_is_encoded():
    assert train_batch(meta='{"ts": "é"}').meta == '{"ts": "é"}'.encode()  # PERSIA dropped a str
    with pytest.raises(PersiaDataTypeError, match="meta must be bytes or str, got dict"):
        train_batch(meta={"ts": 1})
    assert train_batch(meta=bytearray(b"ab")).meta == b"ab"


def test_names_unique_within_each_part():
    with pytest.raises(PersiaDataError, match=r"duplicate id_type_feature name 'user_id' \(positions 0 and 1\)"):
        PersiaBatch([lil_feature("user_id"), lil_feature("user_id")], requires_grad=False)
    with pytest.raises(PersiaDataError, match=r"duplicate non_id_type_feature name 'non_id_type_feature_anonymous'.*pass name="):
        train_batch(non_id_type_features=[NonIDTypeFeature(np.ones(3)), NonIDTypeFeature(np.ones(3))])
    with pytest.raises(PersiaDataError, match=r"duplicate label name 'ctr'"):
        train_batch(labels=[Label(np.ones(3), name="ctr"), Label(np.zeros(3), name="ctr")])
    # The same name in different parts is fine.
    batch = PersiaBatch(
        [lil_feature("x")], non_id_type_features=[NonIDTypeFeature(np.ones(3), name="x")],
        labels=[Label(np.ones(3), name="x")],
    )
    assert batch.batch_size == 3


def test_part_lists_are_type_checked():
    with pytest.raises(PersiaDataTypeError, match="id_type_features must be a list of .*got a single .*IDTypeFeature; wrap it in a list"):
        PersiaBatch(lil_feature(), requires_grad=False)
    with pytest.raises(PersiaDataTypeError, match=r"labels must be a list of Label, got a single .*Label"):
        train_batch(labels=Label(np.ones(3)))
    with pytest.raises(PersiaDataTypeError, match=r"non_id_type_features\[0\] is a numpy.ndarray, expected NonIDTypeFeature; wrap arrays"):
        train_batch(non_id_type_features=[np.ones(3)])
    with pytest.raises(PersiaDataTypeError, match=r"non_id_type_features\[0\] is a .*Label, expected NonIDTypeFeature"):
        train_batch(non_id_type_features=[Label(np.ones(3))])
    with pytest.raises(PersiaDataTypeError, match=r"id_type_features\[0\] is a .*NonIDTypeFeature"):
        PersiaBatch([NonIDTypeFeature(np.ones(3))], requires_grad=False)


def test_errors_are_value_or_type_errors():
    assert issubclass(PersiaDataError, ValueError)
    assert issubclass(PersiaDataTypeError, TypeError) and issubclass(PersiaDataTypeError, PersiaDataError)


# --- wire round trip ----------------------------------------------------------------------------


def assert_same_batch(a: PersiaBatch, b: PersiaBatch) -> None:
    assert (a.batch_size, a.requires_grad, a.meta, a.batch_id) == (b.batch_size, b.requires_grad, b.meta, b.batch_id)
    assert [type(f) for f in a.id_type_features] == [type(f) for f in b.id_type_features]
    for fa, fb in zip(a.id_type_features, b.id_type_features):
        assert fa.name == fb.name
        for xa, xb in zip(fa.to_csr(), fb.to_csr()):
            assert xa.dtype == xb.dtype and np.array_equal(xa, xb)
    for part_a, part_b in ((a.non_id_type_features, b.non_id_type_features), (a.labels, b.labels)):
        assert [(p.name, p.data.dtype, p.data.shape) for p in part_a] == [(p.name, p.data.dtype, p.data.shape) for p in part_b]
        for pa, pb in zip(part_a, part_b):
            assert type(pa) is type(pb) and np.array_equal(pa.data, pb.data)


def test_bytes_round_trip_keeps_every_part():
    batch = PersiaBatch(
        [IDTypeFeature("user_id", [ids(1, 2), ids(), ids(2**64 - 1)]), IDTypeFeatureWithSingleID("item", ids(4, 5, 6))],
        non_id_type_features=[
            NonIDTypeFeature(np.arange(6, dtype=np.float16).reshape(3, 2), name="half"),
            NonIDTypeFeature(np.zeros((3, 3, 2, 2), dtype=np.uint8), name="image"),
        ],
        labels=[Label(np.array([True, False, True]), name="ctr"), Label(np.ones((3, 1)), name="income")],
        meta=b"\x00meta",
    )
    batch.batch_id = 42
    payload = batch.to_bytes()
    assert isinstance(payload, bytes)
    back = PersiaBatch.from_bytes(payload)
    assert_same_batch(batch, back)
    assert back.id_type_features[0].data[2].tolist() == [2**64 - 1]


def test_inference_batch_round_trip_without_labels_or_meta():
    batch = PersiaBatch([lil_feature()], non_id_type_features=[NonIDTypeFeature(np.ones((3, 2)))], requires_grad=False)
    assert_same_batch(batch, PersiaBatch.from_bytes(batch.to_bytes()))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(lil_strategy.filter(bool), min_size=1, max_size=3).filter(lambda fs: len({len(f) for f in fs}) == 1),
    st.booleans(),
    st.one_of(st.none(), st.binary(max_size=20)),
)
def test_wire_round_trip_property(features, with_labels, meta):
    n = len(features[0])
    batch = PersiaBatch(
        [IDTypeFeature(f"f{i}", [np.array(s, dtype=np.uint64) for s in f]) for i, f in enumerate(features)],
        non_id_type_features=[NonIDTypeFeature(np.arange(n * 2, dtype=np.int32).reshape(n, 2))],
        labels=[Label(np.ones(n, dtype=np.float32))] if with_labels else None,
        requires_grad=with_labels,
        meta=meta,
    )
    assert_same_batch(batch, PersiaBatch.from_bytes(batch.to_bytes()))


def test_from_bytes_rejects_foreign_payloads():
    with pytest.raises(PersiaDataError, match="not a PersiaBatch payload"):
        PersiaBatch.from_bytes(b"not a payload at all")
    with pytest.raises(PersiaDataError, match="expected format 'persia_batch' version 1"):
        PersiaBatch.from_bytes(codec.encode({"hello": 1}))


def _tree() -> dict:
    return train_batch(3, non_id_type_features=[NonIDTypeFeature(np.ones((3, 2), dtype=np.float32))]).to_wire()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.pop("labels"), r"batch is missing 'labels'"),
        (lambda t: t.update(batch_size="3"), r"batch.batch_size must be int, got str"),
        (lambda t: t.update(requires_grad=1), r"batch.requires_grad must be bool, got int"),
        (lambda t: t.update(batch_size=True), r"batch.batch_size must be int, got bool"),
        (lambda t: t["id_type_features"][0].update(values=[1, 2]), r"id_type_features\[0\].values must be ndarray"),
        (lambda t: t["id_type_features"][0].update(offsets=np.array([0, 1, 2, 9])), r"end at len\(values\)"),
        (lambda t: t["labels"][0].update(data=np.zeros((3, 1), dtype=np.uint16)), r"Label 'label_anonymous': dtype uint16 is not supported"),
        (lambda t: t["labels"][0].update(data=np.zeros((4, 1), dtype=np.float32)), r"label 'label_anonymous' has batch_size 4"),
        (lambda t: t.update(meta="text"), r"batch.meta must be bytes, got str"),
        (lambda t: t["non_id_type_features"].append(5), r"non_id_type_features\[1\] must be a mapping"),
    ],
)
def test_from_wire_checks_every_field(mutate, message):
    tree = _tree()
    mutate(tree)
    with pytest.raises(PersiaDataError, match=message):
        PersiaBatch.from_bytes(codec.encode(tree))


def test_from_wire_checks_even_when_checks_are_skipped(monkeypatch):
    monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", "1")
    tree = _tree()
    tree["non_id_type_features"][0]["data"] = np.zeros((3, 2), dtype=np.uint32)
    with pytest.raises(PersiaDataError, match="dtype uint32 is not supported"):
        PersiaBatch.from_wire(tree)
