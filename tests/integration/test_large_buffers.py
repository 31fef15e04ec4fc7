"""A CPU NN worker with a large model takes its large buffers from the heap while it trains, and
gives mmap back when it stops, also when entering fails; a small model leaves glibc alone
(persia.allocator.LargeBuffers; real nats-server, gRPC PS and embedding worker, torch). The
allocator's effect on page faults is tested in test_allocator."""

from __future__ import annotations

import pytest
import torch

from persia import allocator
from persia.ctx import TrainCtx
from persia.embedding.optim import SGD
from persia.errors import PersiaError

from .cluster import cluster
from .test_training_path import Model, train

pytestmark = pytest.mark.integration


class LargeModel(Model):
    """The test model with one parameter of 32 MiB, the size glibc maps (its gradient in a real model)."""

    def __init__(self):
        super().__init__()
        self.large = torch.nn.Parameter(torch.zeros(4096, 2048))


@pytest.fixture
def mallopt_calls(monkeypatch):
    calls: list[dict] = []  # the mmap switch's settings (a context's first tune_allocator goes through here too)

    def record(settings, why):
        if allocator.M_MMAP_MAX in settings:
            calls.append(dict(settings))
        return why

    monkeypatch.setattr(allocator, "_mallopt", record)
    if not allocator.LargeBuffers().settings:
        pytest.skip("not glibc: nothing to set")
    return calls


def test_training_a_large_model_on_the_cpu_turns_mmap_off_for_its_span(persia_env, mallopt_calls):
    with cluster():
        trained, _ = train(LargeModel(), 4, staleness=2)
        assert trained == 4
        assert mallopt_calls == [{allocator.M_MMAP_MAX: 0}, {allocator.M_MMAP_MAX: allocator.DEFAULT_MMAP_MAX}]
        trained, _ = train(Model(), 4, staleness=2, seed0=10)
    assert trained == 4 and len(mallopt_calls) == 2  # a small model: nothing to gain, glibc left alone


def test_a_failed_entry_gives_mmap_back(persia_env, mallopt_calls, monkeypatch):
    model = LargeModel()

    def refuse(self):
        raise PersiaError("no PS answered")

    monkeypatch.setattr(TrainCtx, "_enter", refuse)
    with pytest.raises(PersiaError, match="no PS answered"):
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)):
            pass
    assert mallopt_calls == [{allocator.M_MMAP_MAX: 0}, {allocator.M_MMAP_MAX: allocator.DEFAULT_MMAP_MAX}]
