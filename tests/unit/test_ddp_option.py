"""``DDPOption`` (PERSIA's ``persia.distributed.DDPOption``): its options are parsed as PERSIA's
were, each one used or refused, and the DDP it builds tolerates unused parameters as PERSIA's did."""

from __future__ import annotations

import gc

import pytest
import torch

from persia.distributed import DDPOption
from persia.errors import PersiaValidationError
from persia.nn_worker.distributed import ddp_constructor_options, ddp_kwargs, split_options


def test_init_method_is_persias_older_name_for_initialization_method():
    option = DDPOption(init_method="file", backend="gloo", sync_file="/tmp/persia-ddp-sync")
    assert option.initialization_method == "file" and option.init_method == "file"
    assert option.init_with_env_file()
    assert option.options == {"sync_file": "/tmp/persia-ddp-sync"}
    assert DDPOption("file", "gloo", sync_file="/tmp/s").initialization_method == "file"  # positional, as PERSIA
    assert DDPOption(backend="gloo").initialization_method == "tcp"


def test_both_names_given_and_different_is_refused_naming_both():
    with pytest.raises(PersiaValidationError, match=r"initialization_method='tcp' and init_method='file'"):
        DDPOption(initialization_method="tcp", init_method="file", backend="gloo", sync_file="/tmp/s")
    assert DDPOption(initialization_method="tcp", init_method="tcp", backend="gloo").initialization_method == "tcp"


def test_bad_values_are_refused_with_their_value():
    with pytest.raises(PersiaValidationError, match=r"initialization_method .*got 'env'"):
        DDPOption(init_method="env", backend="gloo")
    with pytest.raises(AssertionError, match=r"backend .*got 'mpi'"):  # PERSIA asserted
        DDPOption(backend="mpi")
    with pytest.raises(PersiaValidationError, match=r"needs a sync_file option, got None"):
        DDPOption(init_method="file", backend="gloo")
    with pytest.raises(PersiaValidationError, match=r"sync_file='/tmp/s' is only used with initialization_method='file'"):
        DDPOption(backend="gloo", sync_file="/tmp/s")
    with pytest.raises(PersiaValidationError, match=r"master_port must be a port number, got 'http'"):
        DDPOption(backend="gloo", master_port="http")


def test_persia_options_are_used():
    option = DDPOption(backend="gloo", master_addr="10.0.0.7", master_port="23333")
    assert (option.master_addr, option.master_port) == ("10.0.0.7", 23333)
    assert option.init_url(None) == "tcp://10.0.0.7:23333"
    assert option.options == {} and option.ddp_options == {}
    assert DDPOption("file", "gloo", sync_file="/tmp/s").init_url(None) == "file:///tmp/s"


def test_ddp_constructor_options_reach_ddp():
    option = DDPOption(backend="gloo", bucket_cap_mb=1, gradient_as_bucket_view=True, static_graph=False,
                       broadcast_buffers=False)
    assert option.ddp_options == {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": False,
                                  "broadcast_buffers": False}
    assert ddp_kwargs(option.ddp_options, None) == {"find_unused_parameters": True, **option.ddp_options}


def test_unknown_option_is_refused_naming_it_and_what_is_accepted():
    with pytest.raises(PersiaValidationError, match=r"option bucket_cap=1 is not accepted \(unknown option\)"
                                                     r".*sync_file.*bucket_cap_mb.*find_unused_parameters"):
        DDPOption(backend="gloo", bucket_cap=1)
    with pytest.raises(PersiaValidationError, match=r"device_ids=\[3\] is not accepted \(the NN worker sets it"):
        DDPOption(backend="gloo", device_ids=[3])


def test_ddp_options_follow_torchs_signature_less_what_the_worker_sets():
    names = ddp_constructor_options()
    assert {"bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
            "broadcast_buffers"} <= names
    assert not names & {"module", "device_ids", "output_device", "process_group", "self"}
    persia, ddp = split_options({"sync_file": "/s", "bucket_cap_mb": 4}, "file", names)
    assert (persia, ddp) == ({"sync_file": "/s"}, {"bucket_cap_mb": 4})


def test_find_unused_parameters_defaults_to_persias_true_unless_set():
    assert ddp_kwargs({}, None) == {"find_unused_parameters": True}
    assert ddp_kwargs({"find_unused_parameters": False}, 0) == {
        "find_unused_parameters": False, "device_ids": [0], "output_device": 0}
    assert DDPOption(backend="gloo", find_unused_parameters=False).ddp_options == {"find_unused_parameters": False}


class _Branchy(torch.nn.Module):
    """A model with a parameter its forward never uses (PERSIA models with optional towers)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.used(x)


def test_a_model_with_an_unused_parameter_trains_under_the_default_option(tmp_path):
    """Real DDP on a gloo world of 1: two steps (DDP checks the previous step's reduction at the
    next forward, "Expected to have finished reduction" when unused parameters are not looked for)."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    option = DDPOption(init_method="file", backend="gloo", sync_file=str(tmp_path / "sync"), bucket_cap_mb=1)
    torch.manual_seed(0)
    model = _Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = None
    try:
        ddp, optimizer = option.convert2distributed_model(model, 1, 0, None, None, optimizer)
        assert ddp.find_unused_parameters
        before = model.used.weight.detach().clone()
        for _ in range(2):
            optimizer.zero_grad()
            ddp(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        assert not torch.equal(model.used.weight, before)
        assert model.unused.weight.grad is None
    finally:
        # DDP's reducer goes before the group: freed after it (at the function's return), the
        # group's destructor joined gloo threads that never ended, once in a while (a CI hang)
        ddp = None
        gc.collect()
        torch.distributed.destroy_process_group()


def test_a_joined_group_is_reused_only_when_it_is_the_one_the_context_would_make():
    from persia.nn_worker.distributed import check_joined_group

    check_joined_group(2, 1, "gloo", 2, 1, "gloo")
    for group, mismatch in [((4, 1, "gloo"), "world size 4"), ((2, 0, "gloo"), "as rank 0"),
                            ((2, 1, "nccl"), "on nccl")]:
        with pytest.raises(PersiaValidationError, match=mismatch) as info:
            check_joined_group(*group, 2, 1, "gloo")
        assert "rank 1 of 2 on gloo" in str(info.value) and "destroy_process_group" in str(info.value)


def test_a_ddp_free_port_setting_that_is_not_a_switch_is_refused_when_the_context_is_made(monkeypatch):
    """``PERSIA_DDP_FREE_PORT=2`` was taken as off (only "1" meant on), silently."""
    from persia.ctx import TrainCtx
    from persia.embedding.optim import Adagrad

    model = torch.nn.Linear(2, 1)
    monkeypatch.setenv("PERSIA_DDP_FREE_PORT", "2")
    with pytest.raises(ValueError, match="environment variable PERSIA_DDP_FREE_PORT must be 1/on or 0/off, got '2'"):
        TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1), dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for ok, on in (("0", False), ("on", True), ("", True)):
        monkeypatch.setenv("PERSIA_DDP_FREE_PORT", ok)
        ctx = TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                       dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert ctx._ddp_free_port is on


def test_a_train_ctx_made_and_never_entered_starts_no_thread():
    """Its update outbox's flusher started in the constructor and lived on, one per context made."""
    import threading

    from persia.ctx import TrainCtx
    from persia.embedding.optim import Adagrad

    def flushers() -> int:
        return sum(t.name == "persia-update-flusher" and t.is_alive() for t in threading.enumerate())

    before = flushers()
    model = torch.nn.Linear(2, 1)
    made = [TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                     dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) for _ in range(3)]
    assert len(made) == 3 and flushers() == before
