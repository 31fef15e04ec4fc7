"""A checkpoint served or loaded with another embedding config than the one it was trained with
(the same slots listed in another order, another feature_index_prefix_bit or feature_groups) put
every ID under other signs: every lookup missed and the model server answered 200 with zero
embeddings while /ready said ready. The trainer records the embedding layout in the checkpoint's
done marker; the inference embedding worker refuses a PS that loaded another (not ready, lookups
FAILED_PRECONDITION) and a training job's load_checkpoint raises, both naming the slot and values.
A checkpoint written before the record is loaded as before, with a warning."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

import pytest
import torch
from persia.ctx import InferCtx, TrainCtx
from persia.embedding.optim import Adagrad
from persia.embedding_ps.checkpoint import DONE_MARKER, LAYOUT_KEY
from persia.errors import EmbeddingLayoutMismatch
from persia.nn_worker.checkpoint import CheckpointLoadError

from tests.integration.cluster import EMBEDDING_CONFIG, cluster
from tests.integration.test_training_path import make_batch
from tests.serving.helpers import ServedModel, dump, serving, train_batches

pytestmark = pytest.mark.integration

SLOTS = EMBEDDING_CONFIG["slots_config"]  # user, item, tags
REORDERED = dict(EMBEDDING_CONFIG, slots_config=dict(sorted(SLOTS.items())))  # item, tags, user
USER_MOVED = "slot 'user': index_prefix 0x0100000000000000 in the checkpoint, 0x0300000000000000 in the embedding config"


def get(url: str, data: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/x-persia-batch"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def trained(persia_env, tmp_path):
    model = ServedModel()
    with cluster():
        train_batches(model, range(4))
        dump(model, tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def _forget_layout(ckpt) -> None:
    """The checkpoint as written before the layout was recorded."""
    marker = json.loads((ckpt / DONE_MARKER).read_text())
    del marker[LAYOUT_KEY]
    (ckpt / DONE_MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("config, why", [
    (REORDERED, USER_MOVED),
    (dict(EMBEDDING_CONFIG, feature_index_prefix_bit=6), "feature_index_prefix_bit is 8 in the checkpoint, 6"),
    (dict(EMBEDDING_CONFIG, feature_groups={"ui": ["user", "item"]}), "slot 'item': index_prefix 0x02"),
])
def test_a_checkpoint_served_with_another_embedding_layout_is_not_ready(trained, config, why):
    ckpt, _ = trained
    probe = make_batch(5000, requires_grad=False).to_bytes()
    with serving(ckpt, ckpt / "jit_dense.pt", embedding_config=config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        status, body = get(base + "/ready")
        assert status == 503 and "trained with another embedding layout" in body and why in body, body
        status, body = get(base + "/v1/predict", probe)  # was 200 with every embedding zero
        assert status == 503 and why in body, body
        started = time.monotonic()
        with InferCtx(server.config.embedding_workers) as ctx, \
                pytest.raises(EmbeddingLayoutMismatch, match="trained with another embedding layout"):
            ctx.wait_for_serving(deadline_s=60)
        assert time.monotonic() - started < 30  # at once: waiting does not heal it
    with serving(ckpt, ckpt / "jit_dense.pt") as server:  # the training config: served
        base = f"http://127.0.0.1:{server.http_port}"
        assert get(base + "/ready")[0] == 200
        assert get(base + "/v1/predict", probe)[0] == 200


def test_a_checkpoint_without_the_record_is_served_with_a_warning(trained, caplog):
    ckpt, _ = trained
    _forget_layout(ckpt)
    with caplog.at_level(logging.WARNING), serving(ckpt, ckpt / "jit_dense.pt", embedding_config=REORDERED) as server:
        assert get(f"http://127.0.0.1:{server.http_port}/ready")[0] == 200  # nothing to check against
    assert "records no embedding layout" in caplog.text


def test_load_checkpoint_refuses_another_embedding_layout_and_loads_an_old_checkpoint(trained, caplog):
    ckpt, model = trained
    with cluster(embedding_config=REORDERED), TrainCtx(
            model=model, embedding_optimizer=Adagrad(lr=0.1),
            dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        with pytest.raises(CheckpointLoadError, match="trained with another embedding layout.*" + USER_MOVED):
            ctx.load_checkpoint(str(ckpt))
        with pytest.raises(CheckpointLoadError, match=USER_MOVED):
            ctx.load_embedding(str(ckpt))
        assert ctx.get_embedding_size() == [0]  # nothing was loaded
        _forget_layout(ckpt)
        with caplog.at_level(logging.WARNING):
            ctx.load_checkpoint(str(ckpt))  # as before the record: loaded, with a warning
        assert ctx.get_embedding_size()[0] > 0 and "records no embedding layout" in caplog.text
