"""Pure parts of serving, without servers: batching decisions, merging and splitting requests,
which model file to serve, error classes, flags to config, the inference global config."""

from __future__ import annotations

import argparse
from concurrent.futures import Future

import numpy as np
import pytest
from pydantic import ValidationError

from persia.data_loader.batch import IDTypeFeature, IDTypeFeatureWithSingleID, NonIDTypeFeature, PersiaBatch
from persia.errors import RemoteError
from persia.serving.batcher import QueueFull, take_batch
from persia.serving.cli import add_serve_parser, config_from_args
from persia.serving.config import ServeConfig
from persia.serving.local_stack import infer_global_config
from persia.serving.model import resolve_model_file
from persia.serving.predictor import ModelInputError, ModelNotLoaded
from persia.serving.request import RequestError, batch_from_json, merge, split
from persia.serving.answers import classify


def batch(n: int, start: int = 0, dense_width: int = 2, multi: bool = True) -> PersiaBatch:
    feats = [IDTypeFeatureWithSingleID("a", np.arange(start, start + n, dtype=np.uint64))]
    if multi:
        feats.append(IDTypeFeature("b", [np.arange(i % 3, dtype=np.uint64) + start for i in range(n)]))
    dense = np.arange(n * dense_width, dtype=np.float32).reshape(n, dense_width) + start
    return PersiaBatch(feats, non_id_type_features=[NonIDTypeFeature(dense, name="d")], requires_grad=False)


def test_merge_keeps_every_sample_in_order_and_split_undoes_it():
    parts = [batch(3, 0), batch(2, 100), batch(4, 200)]
    merged = merge(parts)
    assert merged.batch_size == 9
    a = merged.id_type_features[0].to_csr()[0]
    np.testing.assert_array_equal(a, np.concatenate([p.id_type_features[0].data for p in parts]))
    values, offsets = merged.id_type_features[1].to_csr()
    samples = [values[offsets[i]:offsets[i + 1]].tolist() for i in range(9)]
    want = [s.tolist() for p in parts for s in p.id_type_features[1].data]
    assert samples == want
    np.testing.assert_array_equal(merged.non_id_type_features[0].data,
                                  np.concatenate([p.non_id_type_features[0].data for p in parts]))
    out = np.arange(9, dtype=np.float32).reshape(9, 1)
    assert [s.ravel().tolist() for s in split(out, [3, 2, 4])] == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="8 rows for 9 samples"):
        split(out[:8], [3, 2, 4])


def test_take_batch_fills_up_to_the_limit_and_never_mixes_signatures():
    items = [(batch(3), Future()), (batch(3, dense_width=5), Future()), (batch(4), Future()), (batch(2), Future())]
    taken, rest = take_batch(items, max_batch_size=6)
    assert [b.batch_size for b, _ in taken] == [3, 2]  # 4 would exceed 6; the other signature waits
    assert [b for b, _ in rest] == [items[1][0], items[2][0]]
    taken, _ = take_batch([(batch(10), Future())], max_batch_size=4)
    assert len(taken) == 1  # one request over the limit still runs, alone
    assert take_batch([], 4) == ([], [])


def test_json_ids_as_numbers_or_strings_and_multi_id_samples():
    b = batch_from_json({"id_type_features": {"a": [1, "18446744073709551615"], "b": [[1, 2], []]},
                         "non_id_type_features": {"d": [1.5, 2.5]}})
    assert b.id_type_features[0].data.tolist() == [1, 2**64 - 1]
    assert [s.tolist() for s in b.id_type_features[1].data] == [[1, 2], []]
    assert b.non_id_type_features[0].data.shape == (2, 1)
    with pytest.raises(RequestError) as info:
        batch_from_json({"id_type_features": {"a": [2**64]}})
    assert info.value.field == "id_type_features.a[0]"
    with pytest.raises(RequestError) as info:
        batch_from_json({"id_type_features": {"a": [1]}, "non_id_type_features": {"d": [[float("nan")]]}})
    assert info.value.field == "non_id_type_features.d"
    with pytest.raises(RequestError) as info:
        batch_from_json({"id_type_features": {"a": []}})
    assert info.value.field == "id_type_features.a"


def test_model_file_is_the_file_or_the_newest_complete_checkpoint(tmp_path):
    assert resolve_model_file(tmp_path / "none") is None
    assert resolve_model_file(tmp_path) is None
    for step, complete in [(5, True), (12, True), (20, False)]:
        d = tmp_path / f"ckpt-{step:012d}"
        d.mkdir()
        (d / "jit_dense.pt").write_bytes(b"x")
        if complete:
            (d / "COMPLETE").write_text("{}")
    assert resolve_model_file(tmp_path) == tmp_path / "ckpt-000000000012" / "jit_dense.pt"
    (tmp_path / "jit_dense.pt").write_bytes(b"y")
    assert resolve_model_file(tmp_path) == tmp_path / "jit_dense.pt"
    assert resolve_model_file(tmp_path / "jit_dense.pt") == tmp_path / "jit_dense.pt"


@pytest.mark.parametrize("exc, status, kind", [
    (RequestError("x", "bad"), 400, "bad_request"),
    (QueueFull("full"), 503, "overloaded"),
    (ModelNotLoaded("none"), 503, "unavailable"),
    (RemoteError("ew", "down", "UNAVAILABLE"), 503, "unavailable"),
    (RemoteError("ew", "late", "DEADLINE_EXCEEDED"), 504, "timeout"),  # the lookup ran out of the request's time
    (ModelInputError("the model does not take ..."), 400, "bad_request"),
    (TimeoutError(), 504, "timeout"),
    (ZeroDivisionError("boom"), 500, "internal"),
])
def test_every_failure_has_one_answer(exc, status, kind):
    err = classify(exc)
    assert (err.status, err.kind) == (status, kind)


def test_flags_and_env_to_config():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="role"))
    args = parser.parse_args(["serve", "--model", "m.pt", "--embedding-worker", "a:1,b:2",
                              "--embedding-worker", "c:3", "--grpc-port", "-1"])
    cfg = config_from_args(args, env={"PERSIA_BIND_ADDRESS": "10.0.0.7"})
    assert cfg.embedding_workers == ["a:1", "b:2", "c:3"] and cfg.grpc_port is None and cfg.host == "10.0.0.7"
    args = parser.parse_args(["serve", "--model", "m.pt"])
    cfg = config_from_args(args, env={"PERSIA_SERVE_EMBEDDING_WORKERS": "x:9"})
    assert cfg.embedding_workers == ["x:9"]
    with pytest.raises(ValidationError, match=r"embedding_workers\[0\] must be host:port"):
        ServeConfig(embedding_workers=["nohost"], model="m")
    cfg = config_from_args(args, env={"EMBEDDING_WORKER_SERVICE": "ew-0:8887,ew-1:8887"})  # PERSIA's variable
    assert cfg.embedding_workers == ["ew-0:8887", "ew-1:8887"]
    with pytest.raises(ValidationError, match="embedding_workers"):
        config_from_args(args, env={})
    assert cfg.max_connections == 256
    args = parser.parse_args(["serve", "--model", "m.pt", "--max-connections", "8"])
    assert config_from_args(args, env={"PERSIA_SERVE_EMBEDDING_WORKERS": "x:9"}).max_connections == 8
    with pytest.raises(ValidationError, match="max_connections"):
        ServeConfig(embedding_workers=["x:9"], model="m", max_connections=0)


def test_infer_global_config_keeps_training_settings():
    train = {"common_config": {"job_type": "Train"},
             "embedding_parameter_server_config": {"enable_incremental_update": True, "incremental_dir": "/inc"}}
    gc = infer_global_config(train, ["h:1", "h:2"], "/ckpt")
    assert gc["common_config"] == {"job_type": "Infer", "infer_config": {"servers": ["h:1", "h:2"],
                                                                         "embedding_checkpoint": "/ckpt"}}
    assert gc["embedding_parameter_server_config"]["incremental_dir"] == "/inc"
    assert train["common_config"]["job_type"] == "Train"


def test_a_model_file_that_does_not_load_is_tried_again_only_once_it_changes(tmp_path):
    """A broken model file was loaded (all of it) and warned about every poll, for ever; its
    failure counted each time. Now once, and again when the file changes (a copy completing)."""
    import os

    import torch

    from persia.serving.model import DenseModel

    path = tmp_path / "jit_dense.pt"
    path.write_bytes(b"not a torchscript file")
    loads: list[bool] = []
    model = DenseModel(path, on_load=loads.append)
    for _ in range(3):
        assert model.poll() is False
    assert loads == [False] and "jit_dense.pt" in model.last_error
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 1)), str(tmp_path / "new.pt"))
    os.replace(tmp_path / "new.pt", path)  # the good file arrives: a new version
    assert model.poll() is True and loads == [False, True] and model.current() is not None


def test_json_nested_too_deep_is_found_before_it_is_parsed():
    """json.loads recursed to the interpreter's limit on "[[[[...": the 400 came, but nothing else
    on that thread had stack left (a garbage collection's finalizers failed there)."""
    import json

    from persia.serving.request import MAX_JSON_DEPTH, json_depth_over

    request = json.dumps({"id_type_features": {f"s{i}": [[j, j + 1] for j in range(512)] for i in range(26)}})
    assert not json_depth_over(request.encode())
    assert json_depth_over(b"[" * 100_000 + b"]" * 100_000)
    assert json_depth_over(b'{"a":' * 70 + b"1" + b"}" * 70)
    deep, ok = MAX_JSON_DEPTH + 1, MAX_JSON_DEPTH
    assert json_depth_over(b"[" * deep + b"]" * deep) and not json_depth_over(b"[" * ok + b"]" * ok)
    # brackets inside strings, escaped quotes included, do not count
    assert not json_depth_over(b'{"a": "' + b"[" * 100 + b'"}')
    assert not json_depth_over(b'{"a": "\\"[[[["}' + b"[1]" * 100)


def test_a_key_given_twice_in_a_json_object_is_refused_naming_it():
    """The last of two equal keys won silently: a request whose "user" slot was sent twice was
    served with the second list as if the first had not been sent."""
    from persia.serving.request import RequestError, parse_json

    assert parse_json(b'{"id_type_features": {"user": [1], "item": [2]}}') == {
        "id_type_features": {"user": [1], "item": [2]}}
    for body, key in ((b'{"id_type_features": {"user": [1], "user": [2]}}', "user"),
                      (b'{"id_type_features": {"user": [1]}, "id_type_features": {"user": [2]}}', "id_type_features")):
        with pytest.raises(RequestError, match="given twice") as err:
            parse_json(body)
        assert err.value.field == key
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json(b'{"a": ')
    with pytest.raises(RequestError, match="nested more than"):
        parse_json(b"[" * 100 + b"]" * 100)


def test_a_byte_budget_waits_for_room_and_refuses_what_never_fits():
    import threading

    from persia.serving.budget import ByteBudget

    budget = ByteBudget(100)
    assert budget.reserve(60, 0.0) and not budget.reserve(50, 0.01)  # 110 > 100: not within the wait
    assert not budget.reserve(101, 10.0)  # over the capacity: refused at once, not after 10 s
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.reserve(50, 10.0)))
    waiter.start()
    budget.release(60)  # room for the waiter
    waiter.join(10)
    assert got == [True] and budget.held == 50
    with pytest.raises(ValueError, match="released 60 bytes"):
        budget.release(60)
