"""Checks a data loader does where its user made the mistake, against a real nats-server and a real
embedding worker: a batch with an ID feature that is not a slot is refused by ``send_data`` itself
(named, before it takes a batch id, nothing sent), and an NN world size below 1 is refused when the
``DataCtx`` is built, not later as a division by zero."""

from __future__ import annotations

import pytest

from persia.bus import NatsBus, subject
from persia.config import UnknownSlotError
from persia.ctx import DataCtx
from persia.errors import PersiaError
from persia.messages import NoPayload
from persia.nn_worker.accounting import ACCOUNT

from .cluster import cluster
from .test_data_groups import train_grouped
from .test_training_path import make_batch

pytestmark = pytest.mark.integration


def test_send_data_refuses_an_unknown_slot_before_the_batch_takes_an_id(persia_env, monkeypatch):
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")  # a bad batch held for a partner used to fail on a later send
    outcome: dict = {}

    def refused_then_good(ctx, batches, errors, _trained):
        bad, good = batches
        try:
            ctx.send_data(bad)
        except Exception as exc:  # noqa: BLE001 - what send_data raised, for the asserts below
            errors.append(exc)
        outcome["bad_id"] = bad.batch_id
        ctx.send_data(good)  # raises nothing: the refused batch left nothing behind

    seen, errors, messages = train_grouped(monkeypatch, [make_batch(0, unknown_slot=True), make_batch(1)],
                                           send=refused_then_good)
    assert len(errors) == 1 and isinstance(errors[0], UnknownSlotError), errors
    assert str(errors[0]).startswith("unknown slot 'not_a_slot': not in embedding_config.yml slots_config; "
                                     "known slots: 'user', 'item', 'tags'"), errors[0]
    assert outcome["bad_id"] is None  # it took no batch id: the good batch is batch 0
    assert seen == [0]
    # the refused batch reached no role: only the good one went, alone at the close
    assert messages == {"forward": [(0,)], "batch": [(0,)]}
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 1 and result["batches_trained"] == 1 and result["batches_failed"] == {}


def test_a_data_loader_refuses_an_nn_world_size_below_one(persia_env):
    nn = NatsBus(name="nn-world-size-0")
    try:
        with cluster():
            nn.serve(subject("nn", "info"), lambda _req: {"world_size": 0}, queue="nn", blocking=False,
                     schema=NoPayload)
            nn.flush()
            with pytest.raises(PersiaError, match=r"the NN workers report world_size 0 .*it must be >= 1"):
                DataCtx(discovery_deadline_s=20)
    finally:
        nn.close()
