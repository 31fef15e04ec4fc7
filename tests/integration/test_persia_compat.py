"""PERSIA users' code, name by name, as PERSIA's docs and examples call it (issue 12).

Pure API checks run without servers; the rest use real nats-server, real gRPC PS and embedding
workers on loopback (``cluster``) and real torch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from persia.ctx import BaseCtx, EmbeddingCtx, InferCtx, PreprocessMode, TrainCtx, eval_ctx
from persia.data import DataLoader, StreamingDataset
from persia.embedding import EmbeddingConfig
from persia.embedding.data import IDTypeFeature, Label, PersiaBatch
from persia.embedding.optim import SGD, Adagrad, Adam

from .cluster import cluster
from .test_training_path import Model, eval_embeddings, make_batch, send_in_thread, train

# -- persia.env -------------------------------------------------------------------------------------


def test_set_env_writes_the_variables_the_getters_read(monkeypatch):
    from persia import env

    for var in env.ENV_NAMES.values():
        monkeypatch.setenv(var, "")  # recorded: teardown puts back what was there (delenv of an
        monkeypatch.delenv(var)      # unset variable records nothing, and set_env's values stayed)
    env.set_env(rank=1, world_size=2, local_rank=1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "1")
    assert (env.get_rank(), env.get_world_size(), env.get_local_rank()) == (1, 2, 1)
    env.set_env(rank=None)
    assert "RANK" not in os.environ
    with pytest.raises(ValueError, match=r"unknown name 'rnak'.*rank, world_size"):
        env.set_env(rnak=0)
    with pytest.raises(ValueError, match=r"world_size must be an integer, got 'two'"):
        env.set_env(world_size="two", rank=0)
    assert "RANK" not in os.environ  # nothing set when one value is refused


def test_replica_index_and_size_are_none_in_a_ranked_process_as_in_persia(monkeypatch):
    from persia.env import get_replica_index, get_replica_size

    for var in ("REPLICA_INDEX", "REPLICA_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert (get_replica_index(), get_replica_size()) == (0, 1)
    monkeypatch.setenv("RANK", "0")
    assert (get_replica_index(), get_replica_size()) == (None, None)
    monkeypatch.setenv("REPLICA_INDEX", "2")
    monkeypatch.setenv("REPLICA_SIZE", "3")
    assert (get_replica_index(), get_replica_size()) == (2, 3)


# -- persia.utils, persia.logger, persia.service -----------------------------------------------------


def test_find_free_port_scans_from_the_given_port_in_steps():
    from persia.utils import find_free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        got = find_free_port(port=taken, interval=3)
    assert got != taken and (got - taken) % 3 == 0
    assert 0 < find_free_port() <= 65535
    with pytest.raises(ValueError, match="interval >= 1"):
        find_free_port(port=10000, interval=0)


def test_unclaimed_ports_are_distinct_free_and_below_the_ephemeral_range():
    from persia.utils import ephemeral_port_floor, unclaimed_ports

    first = unclaimed_ports(8)
    assert len(set(first)) == 8 and all(p < ephemeral_port_floor() for p in first)
    for port in first:  # each can be bound (and none listens)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    again = unclaimed_ports(8, taken=first)
    assert not set(again) & set(first)


def test_yaml_helpers_and_run_command(tmp_path):
    from persia.utils import dump_yaml, load_yaml, run_command

    path = str(tmp_path / "c.yml")
    dump_yaml({"slots_config": {"age": {"dim": 8}}}, filepath=path)
    assert load_yaml(filepath=path) == {"slots_config": {"age": {"dim": 8}}}
    with pytest.raises(FileNotFoundError, match="nope.yml"):
        load_yaml(str(tmp_path / "nope.yml"))
    run_command([sys.executable, "-c", "open(__import__('sys').argv[1], 'w').write('ran')", tmp_path / "out"])
    assert (tmp_path / "out").read_text() == "ran"
    with pytest.raises(subprocess.CalledProcessError):
        run_command([sys.executable, "-c", "raise SystemExit(3)"])


def test_persia_logger_helpers(tmp_path):
    from persia import logger as plog

    log_file, err_file = tmp_path / "train.log", tmp_path / "error.log"
    lg = plog.get_default_logger("compat-test", log_level=logging.INFO, enable_file_logger=True,
                                 log_filename=str(log_file), enable_err_redirect=True,
                                 err_redirect_filepath=str(err_file), err_redirect_level=logging.WARNING)
    plog.setLogger("compat-test", enable_file_logger=True, log_filename=str(log_file))  # no second handler
    lg.info("hello")
    lg.error("boom")
    for h in lg.handlers:
        h.flush()
    assert log_file.read_text().count("hello") == 1
    assert "boom" in err_file.read_text() and "hello" not in err_file.read_text()
    assert plog.get_logger("compat-test") is lg
    assert plog.levelFilter(logging.INFO).filter(logging.makeLogRecord({"levelno": logging.WARNING}))


def test_get_embedding_worker_services(monkeypatch):
    from persia.service import get_embedding_worker_services

    monkeypatch.delenv("EMBEDDING_WORKER_SERVICE", raising=False)
    assert get_embedding_worker_services() == ["embedding_worker:8887"]
    monkeypatch.setenv("EMBEDDING_WORKER_SERVICE", "ew-0:9000")
    assert get_embedding_worker_services() == ["ew-0:9000"]
    monkeypatch.setenv("EMBEDDING_WORKER_SERVICE", "ew-0:9000, ew-1:9000")
    assert get_embedding_worker_services() == ["ew-0:9000", "ew-1:9000"]
    monkeypatch.setenv("EMBEDDING_WORKER_SERVICE", "ew-0")
    with pytest.raises(ValueError, match=r"EMBEDDING_WORKER_SERVICE: 'ew-0' is not host:port"):
        get_embedding_worker_services()


# -- errors, data API, optimizers, distributed --------------------------------------------------------


def test_validation_errors_stay_catchable_as_persias_exception_types():
    ids = IDTypeFeature("age", [np.array([1], dtype=np.uint64)])
    with pytest.raises(AssertionError, match="needs at least one Label"):
        PersiaBatch([ids])
    with pytest.raises(RuntimeError, match="needs at least one Label"):  # PERSIA's type for this one
        PersiaBatch([ids])
    with pytest.raises(AssertionError, match="id_type_features is empty"):
        PersiaBatch([], labels=[Label(np.zeros((1, 1), dtype=np.float32))])
    with pytest.raises(AssertionError):
        IDTypeFeature("age", [np.array([1.5])])
    with pytest.raises(AssertionError, match="TrainCtx needs model"):
        TrainCtx(embedding_optimizer=SGD(lr=0.1), dense_optimizer=None)
    with pytest.raises(AssertionError, match="iterate a persia DataLoader inside"):
        iter(DataLoader(StreamingDataset()))


def test_persia_batch_meta_str_is_encoded_not_dropped():
    meta = json.dumps({"ts": 1})  # what PERSIA's tutorials pass
    batch = PersiaBatch([IDTypeFeature("age", [np.array([1], dtype=np.uint64)])], requires_grad=False, meta=meta)
    assert batch.meta == meta.encode()
    assert PersiaBatch.from_bytes(batch.to_bytes()).meta == meta.encode()


def test_optimizer_hyperparameters_are_attributes():
    sgd = SGD(lr=0.1, momentum=0.9)
    assert (sgd.lr, sgd.momentum, sgd.weight_decay) == (0.1, 0.9, 0.0)
    adam = Adam(betas=(0.8, 0.99))
    assert (adam.lr, adam.betas, adam.eps) == (1e-3, (0.8, 0.99), 1e-8)
    ada = Adagrad(vectorwise_shared=True)
    assert (ada.initial_accumulator_value, ada.vectorwise_shared) == (1e-2, True)
    sgd.lr = 0.5  # reaches the PS at the next apply()
    assert sgd.to_wire()["lr"] == 0.5
    with pytest.raises(ValueError, match="lr"):
        sgd.lr = -1.0
    assert sgd.lr == 0.5
    with pytest.raises(AttributeError, match="no attribute 'betas'"):
        sgd.betas  # noqa: B018


def test_bagua_option_fails_naming_the_supported_options():
    from persia.distributed import BaguaDistributedOption

    with pytest.raises(NotImplementedError, match=r"Bagua is not available.*DDPOption\(backend='nccl'\).*'gloo'"):
        BaguaDistributedOption("gradient_allreduce")


def test_device_id_minus_one_means_cpu():
    ctx = BaseCtx(device_id=-1)
    assert ctx.device == torch.device("cpu") and ctx.device_id is None
    if not torch.cuda.is_available():
        with pytest.raises(AssertionError, match="device_id=0 but CUDA is not available"):
            BaseCtx(device_id=0)


def test_each_thread_has_its_own_context_stack():
    """A DataCtx in a sender thread and a TrainCtx in the trainer's (one process) interleave their
    enters and exits; neither may see or strand the other's context."""
    import threading

    from persia.ctx import cnt_ctx

    inner_entered, main_entered, inner_exit = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def other():
        with BaseCtx() as mine:
            inner_entered.set()
            main_entered.wait(10)
            seen["other"] = cnt_ctx() is mine
            inner_exit.wait(10)
        seen["other_after"] = cnt_ctx()

    t = threading.Thread(target=other)
    t.start()
    inner_entered.wait(10)
    with BaseCtx() as main_ctx:
        main_entered.set()
        assert cnt_ctx() is main_ctx
        inner_exit.set()
        t.join(10)  # the other thread's context exits while ours is still open
        assert cnt_ctx() is main_ctx
    assert cnt_ctx() is None
    assert seen == {"other": True, "other_after": None}


# -- contexts against real servers --------------------------------------------------------------------

@pytest.mark.integration
def test_eval_ctx_consumes_a_stream_without_creating_rows(persia_env):
    with cluster(num_ps=1, num_workers=1):
        # requires_grad batches too: an eval context looks them up without creating rows
        errors: list = []
        loader = send_in_thread([make_batch(i, requires_grad=(i % 2 == 0)) for i in range(5)], errors)
        with eval_ctx() as ctx:
            got = [b.batch_id for b in DataLoader(StreamingDataset(4), timeout_ms=30_000)]
            assert ctx.get_embedding_size() == [0]
        loader.join(30)
        assert not errors, errors
    assert sorted(got) == [0, 1, 2, 3, 4]


@pytest.mark.integration
def test_infer_ctx_consumes_a_stream(persia_env):
    model = Model()
    with cluster(num_ps=1, num_workers=2) as servers:
        train(model, 3, staleness=1)
        workers = [s for s in servers if hasattr(s, "forward_buffer")]
        errors: list = []
        loader = send_in_thread([make_batch(100 + i, requires_grad=False) for i in range(4)], errors)
        outputs = 0
        # the address list is given in reverse: streamed refs must still reach the worker holding them
        with InferCtx([w.address for w in reversed(workers)], model=model) as ctx:
            ctx.wait_servers_ready()
            with torch.no_grad():
                for batch in DataLoader(StreamingDataset(4), timeout_ms=30_000):
                    out, _ = ctx.forward(batch)
                    assert out.shape == (16, 1)
                    outputs += 1
        loader.join(30)
        assert not errors, errors
    assert outputs == 4


@pytest.mark.integration
def test_embedding_ctx_methods_persia_calls(persia_env, tmp_path):
    model = Model()
    with cluster(num_ps=2, num_workers=1):
        sender = send_in_thread([make_batch(i) for i in range(2)], [])
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device_id=-1) as ctx:
            ctx.wait_servers_ready()
            # the method form; a constant initial value shows it reached every PS
            ctx.configure_embedding_parameter_servers(EmbeddingConfig(emb_initialization=(0.25, 0.25)))
            first = True
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1):
                non_id, emb, labels = ctx.prepare_features(persia_training_batch=batch)
                if first:  # rows created after the reconfiguration, not yet trained
                    assert torch.all(emb[0] == 0.25)
                    first = False
                loss = torch.nn.functional.binary_cross_entropy(model(non_id, emb), labels[0])
                ctx.backward(loss)
            ctx.wait_for_pending_updates()

            ctx.dump_torch_state_dict(model, str(tmp_path), "dense.pt")
            ctx.dump_torch_state_dict(torch.nn.Linear(2, 1), str(tmp_path), "jit.pt", is_jit=True)
            fresh = Model()
            ctx.load_torch_state_dict(fresh, str(tmp_path / "dense.pt"))
            for p, q in zip(model.parameters(), fresh.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=0)
            assert isinstance(torch.jit.load(str(tmp_path / "jit.pt")), torch.jit.ScriptModule)
        sender.join(30)
    assert isinstance(EmbeddingCtx(PreprocessMode.EVAL), EmbeddingCtx)


@pytest.mark.integration
def test_a_second_epoch_with_a_new_data_ctx_trains_every_batch(persia_env):
    """Batch ids restart at 0 in each DataCtx; the workers must not mistake them for retries."""
    model = Model()
    with cluster(num_ps=1, num_workers=2):
        assert train(model, 3, staleness=1)[0] == 3
        assert train(model, 3, staleness=1, seed0=10)[0] == 3


# -- seeding ------------------------------------------------------------------------------------------


def _seeded_run(num_ps: int, embedding_config: EmbeddingConfig):
    """Synchronous reference training (staleness 1, reproducible order), then eval lookups."""
    torch.manual_seed(0)
    model = Model()
    with cluster(num_ps=num_ps, num_workers=1):
        errors: list = []
        sender = send_in_thread([make_batch(i) for i in range(8)], errors)
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1), embedding_config=embedding_config,
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
            ctx.wait_for_pending_updates()
            emb = eval_embeddings(model, [make_batch(77, requires_grad=False)])[0]
            rows = sum(ctx.get_embedding_size())
        sender.join(30)
        assert not errors, errors
    return [p.detach().clone() for p in model.parameters()], emb, rows


@pytest.mark.integration
def test_same_seed_same_result_whatever_the_ps_count(persia_env, monkeypatch):
    import persia.utils

    monkeypatch.setattr(persia.utils, "_embedding_seed", None)
    # admission below 1 too: which new IDs get a row must not depend on the sharding either
    params_a, emb_a, rows_a = _seeded_run(1, EmbeddingConfig(admit_probability=0.6, seed=7))
    persia.utils.setup_seed(7)  # PERSIA's setup_seed now reaches the embeddings as well
    params_b, emb_b, rows_b = _seeded_run(2, EmbeddingConfig(admit_probability=0.6))
    assert rows_a == rows_b
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for x, y in zip(emb_a, emb_b):
        np.testing.assert_array_equal(x, y)
    _, emb_c, _ = _seeded_run(1, EmbeddingConfig(admit_probability=0.6, seed=8))
    assert any(not np.array_equal(x, y) for x, y in zip(emb_a, emb_c))


def test_seeded_init_and_admission_are_pure_functions_of_id_and_seed():
    from persia.embedding_ps import EmbeddingStore, HyperParameters
    from persia.hashing import uniform_from_signs, unit_from_signs

    signs = np.arange(1, 20001, dtype=np.uint64)
    base = uniform_from_signs(signs, 4, -0.5, 0.5)
    np.testing.assert_array_equal(uniform_from_signs(signs, 4, -0.5, 0.5, seed=0), base)  # old checkpoints' values
    other = uniform_from_signs(signs, 4, -0.5, 0.5, seed=7)
    assert not np.array_equal(other, base) and -0.5 <= other.min() and other.max() < 0.5
    draws = unit_from_signs(signs, 7, nonce=3)
    np.testing.assert_array_equal(draws, unit_from_signs(signs, 7, nonce=3))
    assert not np.array_equal(draws, unit_from_signs(signs, 7, nonce=4))
    assert abs(draws.mean() - 0.5) < 0.02 and draws.min() >= 0 and draws.max() < 1

    # the store's own replica seed and internal sharding no longer decide which IDs are admitted
    admitted = []
    for replica_seed, shards in ((0, 1), (5, 4)):
        store = EmbeddingStore(100_000, shards, seed=replica_seed)
        store.configure(HyperParameters(admit_probability=0.5, seed=7))
        rows = store.lookup(signs[:1000], 4, train=True, nonce=11)
        admitted.append(np.flatnonzero(rows.any(axis=1)))
    np.testing.assert_array_equal(admitted[0], admitted[1])
    assert 400 < admitted[0].size < 600

    # every insert path (one pass across internal shards when all are admitted, too) uses the seed
    for shards in (1, 4):
        store = EmbeddingStore(100_000, shards)
        store.configure(HyperParameters(init_lower=-0.5, init_upper=0.5, seed=7))
        np.testing.assert_array_equal(store.lookup(signs[:500], 4, train=True, nonce=1), other[:500])


def test_embedding_config_seed_is_validated():
    assert EmbeddingConfig(seed=3).seed == 3 and EmbeddingConfig().seed is None
    assert EmbeddingConfig.from_dict(EmbeddingConfig(seed=3).to_dict()).seed == 3
    with pytest.raises(TypeError, match="EmbeddingConfig.seed must be an integer or None, got str"):
        EmbeddingConfig(seed="3")
    with pytest.raises(ValueError, match=r"EmbeddingConfig.seed must be in \[0, 2\*\*63\), got -1"):
        EmbeddingConfig(seed=-1)
