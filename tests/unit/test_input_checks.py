"""Bad input refused where it is given, naming the field and the value: NaN/inf in dense data,
DataLoader/StreamingDataset arguments, embedding optimizer hyperparameters, a periodic checkpoint
interval without a directory, hash stack and slot names in the embedding config, and the NN
worker's RANK/WORLD_SIZE."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import persia.env as persia_env
from persia.config import ConfigError, load_embedding_config_from_dict
from persia.data import DataLoader, IterableDataset, StreamingDataset
from persia.embedding.data import Label, NonIDTypeFeature, PersiaDataError
from persia.embedding.optim import SGD, Adagrad, Adam
from persia.errors import PersiaValidationError
from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker.embedding_ctx import EmbeddingCtx, PreprocessMode
from persia.nn_worker import loader as loader_module


@pytest.fixture(autouse=True)
def _checks_on(monkeypatch):
    monkeypatch.delenv("PERSIA_SKIP_CHECK_DATA", raising=False)


class _Empty(IterableDataset):
    def __iter__(self):
        return iter(())


# --- 1. NaN and infinities in non-ID features and labels -----------------------------------------


@pytest.mark.parametrize("cls", [NonIDTypeFeature, Label])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_is_refused_naming_the_part_and_its_first_bad_sample(cls, dtype, bad):
    data = np.ones((5, 2, 3), dtype=dtype)
    data[3, 1, 2] = bad
    data[4, 0, 0] = np.nan
    with pytest.raises(PersiaDataError) as info:
        cls(data, name="price")
    message = str(info.value)
    assert message.startswith(f"{cls.__name__} 'price': sample 3 holds {float(bad)} "), message
    assert "(2 samples hold one)" in message and "PERSIA_SKIP_CHECK_DATA" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)


def test_finite_values_pass_also_when_their_sum_overflows_and_ints_are_not_checked():
    big = np.full((4, 3), 6e4, dtype=np.float16)  # finite; their float16 sum is inf
    assert NonIDTypeFeature(big, name="big").data is big
    assert Label(np.full(3, np.finfo(np.float64).max)).batch_size == 3
    assert NonIDTypeFeature(np.array([[1, 2]], dtype=np.int64), name="counts").batch_size == 1
    assert NonIDTypeFeature(np.zeros((0, 2), dtype=np.float32), name="empty").batch_size == 0


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_skipping_the_data_checks_lets_nan_through(monkeypatch, value):
    monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", value)
    assert np.isnan(Label(np.array([np.nan]), name="y").data[0])


def test_the_env_constant_and_the_data_checks_read_the_variable_alike(monkeypatch):
    for value, on in (("yes", True), ("TRUE", True), ("1", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", value)
        assert persia_env.PERSIA_SKIP_CHECK_DATA is on, value
        assert persia_env.skip_check_data() is on, value
    monkeypatch.setenv("PERSIA_SKIP_CHECK_DATA", "maybe")
    with pytest.raises(ValueError, match="PERSIA_SKIP_CHECK_DATA.*'maybe'"):
        Label(np.zeros(2), name="y")


# --- 2. DataLoader and StreamingDataset arguments ------------------------------------------------


@pytest.mark.parametrize("timeout_ms", [float("nan"), float("inf"), 1e30, threading.TIMEOUT_MAX * 1000.0, 0, -5])
def test_timeout_ms_must_be_finite_positive_and_within_what_a_wait_takes(timeout_ms):
    MAX_TIMEOUT_MS = loader_module.MAX_TIMEOUT_MS
    with pytest.raises(PersiaValidationError) as info:
        DataLoader(_Empty(), timeout_ms=timeout_ms)
    assert str(info.value) == (f"DataLoader: timeout_ms must be a finite number of milliseconds > 0 and <= "
                               f"{MAX_TIMEOUT_MS:.6g}, got {timeout_ms!r}")


def test_the_longest_timeout_is_one_a_queue_can_wait_for():
    MAX_TIMEOUT_MS = loader_module.MAX_TIMEOUT_MS
    assert MAX_TIMEOUT_MS / 1000 + 5 < threading.TIMEOUT_MAX  # the lookup wait adds 5 s
    assert DataLoader(_Empty(), timeout_ms=MAX_TIMEOUT_MS).timeout_s == MAX_TIMEOUT_MS / 1000
    assert DataLoader(_Empty(), timeout_ms=np.float32(1500)).timeout_s == 1.5
    with pytest.raises(PersiaValidationError, match="timeout_ms must be a number of milliseconds, got str '5'"):
        DataLoader(_Empty(), timeout_ms="5")
    with pytest.raises(PersiaValidationError, match="timeout_ms .* got bool True"):
        DataLoader(_Empty(), timeout_ms=True)


@pytest.mark.parametrize("name", ["forward_buffer_size", "num_workers", "embedding_staleness"])
@pytest.mark.parametrize("value, shown", [(2.5, "float 2.5"), (True, "bool True"), ("3", "str '3'")])
def test_count_arguments_must_be_integers(name, value, shown):
    with pytest.raises(PersiaValidationError, match=f"DataLoader: {name} must be an integer >= 1.*, got {shown}$"):
        DataLoader(_Empty(), **{name: value})


def test_valid_arguments_are_taken_numpy_ones_too():
    loader = DataLoader(_Empty(), forward_buffer_size=np.int64(3), num_workers=2, embedding_staleness=np.int32(4),
                        reproducible=np.bool_(True))
    assert (loader.forward_buffer_size, loader.num_workers, loader.embedding_staleness, loader.reproducible) == \
        (3, 2, 4, True)
    assert type(loader.forward_buffer_size) is int and type(loader.reproducible) is bool
    assert DataLoader(_Empty(), embedding_staleness=None).embedding_staleness is None


@pytest.mark.parametrize("value", ["no", 1, None])
def test_reproducible_must_be_a_bool(value):
    with pytest.raises(PersiaValidationError, match=f"reproducible must be a bool, got .*{value!r}"):
        DataLoader(_Empty(), reproducible=value)


@pytest.mark.parametrize("dataset", [[1, 2], iter(()), StreamingDataset])
def test_the_dataset_must_be_a_persia_dataset(dataset):
    with pytest.raises(PersiaValidationError, match="DataLoader: dataset must be a persia.data.IterableDatasetBase"):
        DataLoader(dataset)


@pytest.mark.parametrize("value, shown", [(2.5, "float 2.5"), (True, "bool True"), ("3", "str '3'")])
def test_streaming_dataset_buffer_size_must_be_an_integer(value, shown):
    with pytest.raises(PersiaValidationError, match=f"StreamingDataset: buffer_size must be an integer >= 1, got {shown}"):
        StreamingDataset(value)
    with pytest.raises(PersiaValidationError, match="buffer_size must be >= 1, got 0"):
        StreamingDataset(0)
    assert StreamingDataset(np.int64(3)).buffer_size == 3


# --- 3. embedding optimizers ---------------------------------------------------------------------


@pytest.mark.parametrize("betas, message", [
    (0.9, "Adam: betas must be a pair of numbers (beta1, beta2), got float 0.9"),
    ("ab", "Adam: betas must be a pair of numbers (beta1, beta2), got str 'ab'"),
    ((0.9, 0.99, 0.999), "Adam: betas must be a pair of numbers (beta1, beta2), got 3 values (0.9, 0.99, 0.999)"),
    ((True, 0.5), "Adam: betas[0] must be a number, got bool True"),
])
def test_adam_betas_errors_name_betas(betas, message):
    with pytest.raises(PersiaValidationError) as info:
        Adam(betas=betas)
    assert str(info.value) == message
    adam = Adam()
    with pytest.raises(PersiaValidationError):
        adam.betas = betas
    assert adam.betas == (0.9, 0.999)


def test_adam_betas_of_any_pair_are_stored_as_floats():
    adam = Adam(betas=[0.8, np.float64(0.9)])
    assert adam.betas == (0.8, 0.9) and adam.to_wire()["betas"] == [0.8, 0.9]


@pytest.mark.parametrize("make, name", [(lambda v: SGD(lr=v), "lr"), (lambda v: SGD(0.1, momentum=v), "momentum"),
                                        (lambda v: Adagrad(eps=v), "eps"), (lambda v: Adam(weight_decay=v), "weight_decay")])
@pytest.mark.parametrize("value, shown", [(True, "bool True"), ("0.1", "str '0.1'")])
def test_hyperparameters_must_be_numbers_not_bools_or_text(make, name, value, shown):
    with pytest.raises(PersiaValidationError, match=f": {name} must be a number, got {shown}$"):
        make(value)


def test_setting_a_hyperparameter_checks_its_type_and_keeps_the_old_value():
    sgd = SGD(lr=0.1)
    with pytest.raises(PersiaValidationError, match="SGD: lr must be a number, got bool True"):
        sgd.lr = True
    assert sgd.lr == 0.1
    sgd.lr = np.float32(0.5)
    assert sgd.lr == 0.5 and sgd.to_wire()["lr"] == 0.5
    with pytest.raises(PersiaValidationError, match="Adagrad: vectorwise_shared must be a bool, got int 1"):
        Adagrad(vectorwise_shared=1)


def test_an_attribute_that_is_not_a_hyperparameter_is_refused_listing_the_valid_ones():
    sgd = SGD(lr=0.1)
    with pytest.raises(AttributeError) as info:
        sgd.learning_rate = -5
    assert str(info.value) == "SGD has no hyperparameter 'learning_rate'; its hyperparameters are lr, momentum, weight_decay"
    assert "learning_rate" not in vars(sgd) and sgd.lr == 0.1
    with pytest.raises(AttributeError, match="Adam has no hyperparameter 'beta1'; its hyperparameters are lr, betas, weight_decay, eps"):
        Adam().beta1 = 0.5


# --- 4. periodic checkpoints need a directory ----------------------------------------------------


@pytest.mark.parametrize("env, overrides, said", [
    ({plan.ENV_STEPS: "10"}, {}, "interval_steps=10 (from env PERSIA_CHECKPOINT_INTERVAL_STEPS='10')"),
    ({}, {"interval_seconds": 5.0}, "interval_seconds=5.0 (from the TrainCtx argument)"),
    ({plan.ENV_DIR: "", plan.ENV_SECONDS: "3"}, {}, "interval_seconds=3.0 (from env PERSIA_CHECKPOINT_INTERVAL_SECONDS='3')"),
])
def test_an_interval_without_a_checkpoint_dir_is_refused_naming_both(env, overrides, said):
    with pytest.raises(ValueError) as info:
        plan.settings_from(None, env, **overrides)
    message = str(info.value)
    assert message.startswith(f"{said} asks for periodic checkpoints, but checkpoint_dir is unset"), message
    assert "PERSIA_CHECKPOINT_DIR" in message


def test_a_configured_interval_without_a_dir_is_refused_and_the_operator_setting_both_is_not():
    cfg = load_global_config(interval_steps=100)
    with pytest.raises(ValueError, match=r"interval_steps=100 \(from checkpointing_config.interval_steps\) .*checkpoint_dir is unset"):
        plan.settings_from(cfg, {})
    s = plan.settings_from(cfg, {plan.ENV_DIR: "/ckpt/job", plan.ENV_STEPS: "500", plan.ENV_SECONDS: "600.0"})
    assert (s.checkpoint_dir, s.interval_steps, s.interval_seconds, s.periodic) == ("/ckpt/job", 500, 600.0, True)
    assert plan.settings_from(cfg, {plan.ENV_STEPS: ""}).periodic is False  # the interval unset: nothing asked


def load_global_config(**keys):
    from persia.config import load_global_config_from_dict

    raw = {"common_config": {"checkpointing_config": keys}}
    return load_global_config_from_dict(raw).common_config.checkpointing_config


# --- 5. embedding config: hash stack and slot names ----------------------------------------------


def test_a_hash_stack_size_with_zero_rounds_is_refused_naming_both():
    with pytest.raises(ConfigError) as info:
        load_embedding_config_from_dict({"slots_config": {"a": {"dim": 2, "hash_stack_config": {
            "hash_stack_rounds": 0, "embedding_size": 10}}}})
    assert "slots_config.a.hash_stack_config: embedding_size is 10 but hash_stack_rounds is 0" in str(info.value)
    schema = load_embedding_config_from_dict({"slots_config": {"a": {"dim": 2, "hash_stack_config": {
        "hash_stack_rounds": 0, "embedding_size": 0}}}})  # PERSIA's default, written out
    assert not schema.slots_config["a"].hash_stack_config.enabled


def test_an_empty_slot_name_is_refused():
    with pytest.raises(ConfigError, match="slots_config: slot name '' is empty"):
        load_embedding_config_from_dict({"slots_config": {"a": {"dim": 2}, "": {"dim": 2}}})


# --- 6. the NN worker's RANK and WORLD_SIZE ------------------------------------------------------


@pytest.mark.parametrize("rank, world_size, message", [
    ("5", "2", "replica index 5 out of range for replica size 2"),
    ("0", "0", "replica size must be >= 1, got 0"),
    ("-1", "2", "replica index -1 out of range for replica size 2"),
    ("1", None, "replica index 1 out of range for replica size 1"),
])
def test_the_nn_worker_refuses_ranks_out_of_range(monkeypatch, rank, world_size, message):
    monkeypatch.setenv("RANK", rank)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(PersiaValidationError, match=rf"NN worker \(env RANK, WORLD_SIZE\): {message}"):
        EmbeddingCtx(PreprocessMode.EVAL)


def test_the_nn_worker_takes_ranks_in_range(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ctx = EmbeddingCtx(PreprocessMode.EVAL)
    assert (ctx.rank, ctx.world_size) == (1, 2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    ctx = EmbeddingCtx(PreprocessMode.EVAL)
    assert (ctx.rank, ctx.world_size) == (0, 1)
