"""Embedding optimizers on the PS: configs, wire form, and several sparse steps through the store
compared with torch.optim on the same rows (each row its own torch Parameter, so rows without a
gradient in a step are left alone exactly as a sparse optimizer does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia.embedding_ps import EmbeddingStore, HyperParameters
from persia.embedding_ps.optimizers import (
    AdagradConfig,
    AdamConfig,
    SGDConfig,
    apply_step,
    optimizer_from_wire,
    optimizer_to_wire,
    state_width,
)

DIM = 5
SIGNS = np.array([3, 17, 2**63 + 5, 0, 99], dtype=np.uint64)
# which rows get a gradient in each step (some rows skip steps: lazy per-row state)
STEPS = [[0, 1, 2, 3, 4], [0, 2], [1, 2, 3], [0, 1, 2, 3, 4], [4], [0, 3, 4]]


def _store(cfg, weight_bound=0.0) -> EmbeddingStore:
    store = EmbeddingStore(100, 2)
    store.configure(HyperParameters(init_lower=-0.5, init_upper=0.5, weight_bound=weight_bound))
    store.register_optimizer(cfg)
    return store


def _run_both(cfg, torch_opt_factory, torch_step=None, weight_bound=0.0):
    """Run STEPS through the store and through torch; return (store rows, torch rows)."""
    store = _store(cfg, weight_bound)
    initial = store.lookup(SIGNS, DIM, train=True)
    params = [torch.nn.Parameter(torch.tensor(initial[i].copy())) for i in range(len(SIGNS))]
    opt = torch_opt_factory(params) if torch_opt_factory else None
    rng = np.random.default_rng(7)
    for rows in STEPS:
        grads = rng.standard_normal((len(rows), DIM)).astype(np.float32)
        assert store.update(SIGNS[rows], grads) == 0
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            for j, r in enumerate(rows):
                params[r].grad = torch.tensor(grads[j])
            opt.step()
        else:
            torch_step(params, rows, grads)
        if weight_bound > 0:
            with torch.no_grad():
                for p in params:
                    p.clamp_(-weight_bound, weight_bound)
    got = store.lookup(SIGNS, DIM, train=False)
    want = np.stack([p.detach().numpy() for p in params])
    return got, want


@pytest.mark.parametrize(
    "cfg, factory",
    [
        (SGDConfig(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
        (SGDConfig(lr=0.2, momentum=0.9, weight_decay=0.05),
         lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.05)),
        (AdagradConfig(lr=0.1, initial_accumulator_value=0.3, weight_decay=0.02, eps=1e-6),
         lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.3, weight_decay=0.02, eps=1e-6)),
        (AdamConfig(lr=0.05, betas=(0.8, 0.95), weight_decay=0.03, eps=1e-5),
         lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.95), weight_decay=0.03, eps=1e-5)),
        (AdamConfig(), lambda p: torch.optim.Adam(p)),
    ],
    ids=["sgd", "sgd-momentum-wd", "adagrad-wd", "adam-wd", "adam-defaults"],
)
def test_store_steps_match_torch(cfg, factory):
    got, want = _run_both(cfg, factory)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.allclose(got, _store(cfg).lookup(SIGNS, DIM, True), atol=1e-3)  # the rows did move


def _adagrad_reference(gsm, vectorwise, lr=0.1, init=0.2, wd=0.01, eps=1e-8):
    """PERSIA's Adagrad extensions written with torch tensor ops (torch.optim has neither)."""
    state = {}

    def step(params, rows, grads):
        with torch.no_grad():
            for j, r in enumerate(rows):
                p = params[r]
                g = torch.tensor(grads[j]) + wd * p
                sq = (g * g).mean(dim=0, keepdim=True) if vectorwise else g * g
                s = state.get(r, torch.full(sq.shape, init)) * gsm + sq
                state[r] = s
                p -= lr * g / (s.sqrt() + eps)

    return AdagradConfig(lr=lr, initial_accumulator_value=init, weight_decay=wd, eps=eps,
                         g_square_momentum=gsm, vectorwise_shared=vectorwise), step


@pytest.mark.parametrize("gsm, vectorwise", [(0.9, False), (1.0, True), (0.5, True)])
def test_adagrad_extensions_match_reference(gsm, vectorwise):
    cfg, step = _adagrad_reference(gsm, vectorwise)
    got, want = _run_both(cfg, None, torch_step=step)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_adagrad_g_square_momentum_one_is_torch():
    """The reference above agrees with torch.optim.Adagrad where both exist."""
    cfg, step = _adagrad_reference(1.0, False, eps=1e-10)
    _, via_ref = _run_both(cfg, None, torch_step=step)
    _, via_torch = _run_both(cfg, lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.2,
                                                                weight_decay=0.01, eps=1e-10))
    np.testing.assert_allclose(via_ref, via_torch, rtol=0, atol=1e-6)


def test_weight_bound_clips_after_every_step():
    cfg = SGDConfig(lr=5.0)
    got, want = _run_both(cfg, lambda p: torch.optim.SGD(p, lr=5.0), weight_bound=0.7)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.abs(got).max() == pytest.approx(0.7)


def test_duplicate_signs_in_one_update_sum_their_gradients():
    cfg = AdamConfig(lr=0.1)
    a, b = _store(cfg), _store(cfg)
    signs = np.array([5, 6], dtype=np.uint64)
    a.lookup(signs, 3, True)
    b.lookup(signs, 3, True)
    g = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
    assert a.update(np.array([5, 6, 5], dtype=np.uint64), g) == 0
    b.update(signs, np.stack([g[0] + g[2], g[1]]))
    np.testing.assert_array_equal(a.lookup(signs, 3, False), b.lookup(signs, 3, False))
    assert a.stats()["duplicate_update_ids"] == 1


def test_apply_step_leaves_the_gradient_alone():
    w = np.ones((2, 3), np.float32)
    s = np.zeros((2, 3), np.float32)
    g = np.full((2, 3), 0.5, np.float32)
    apply_step(SGDConfig(lr=1.0, momentum=0.5, weight_decay=0.1), w, s, g)
    np.testing.assert_array_equal(g, 0.5)
    np.testing.assert_allclose(w, 1 - (0.5 + 0.1))


# -- configs and wire form -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [SGDConfig(lr=0.1, momentum=0.9, weight_decay=1e-4),
     AdagradConfig(lr=0.2, initial_accumulator_value=0.0, g_square_momentum=0.5, vectorwise_shared=True),
     AdamConfig(lr=0.01, betas=(0.5, 0.6), weight_decay=0.1, eps=1e-3)],
)
def test_wire_round_trip(cfg):
    wire = optimizer_to_wire(cfg)
    assert wire["type"] in ("SGD", "Adagrad", "Adam")
    import msgpack

    assert optimizer_from_wire(msgpack.unpackb(msgpack.packb(wire))) == cfg


@pytest.mark.parametrize(
    "wire, match",
    [
        ({"type": "SGD", "lr": 0}, r"lr"),
        ({"type": "SGD", "lr": 0.1, "momentum": -1}, r"momentum"),
        ({"type": "Adam", "betas": [0.9, 1.0]}, r"betas\[1\] must be in \[0, 1\), got 1.0"),
        ({"type": "Adam", "eps": 0}, r"eps"),
        ({"type": "Adagrad", "g_square_momentum": 2}, r"g_square_momentum"),
        ({"type": "Adagrad", "lr": float("nan")}, r"lr"),
        ({"type": "Adagrad", "learning_rate": 0.1}, r"learning_rate"),
        ({"type": "RMSprop", "lr": 0.1}, r"'type': unknown optimizer 'RMSprop'"),
        ({"lr": 0.1}, r"no 'type' key"),
        ([1, 2], r"must be a dict"),
    ],
)
def test_bad_wire_names_field_and_value(wire, match):
    with pytest.raises(ValueError, match=match):
        optimizer_from_wire(wire)


def test_state_widths():
    assert state_width(SGDConfig(lr=1), 8) == 0
    assert state_width(SGDConfig(lr=1, momentum=0.5), 8) == 8
    assert state_width(AdagradConfig(), 8) == 8
    assert state_width(AdagradConfig(vectorwise_shared=True), 8) == 1
    assert state_width(AdamConfig(), 8) == 17


def test_reregistering_keeps_state_and_changing_optimizer_resets_it():
    store = _store(AdamConfig(lr=0.1))
    signs = np.array([1, 2], dtype=np.uint64)
    store.lookup(signs, 4, True)
    store.update(signs, np.ones((2, 4), np.float32))
    before = store.read_rows(signs, 4)[2].copy()
    store.register_optimizer(AdamConfig(lr=0.05))  # same kind of state: kept
    np.testing.assert_array_equal(store.read_rows(signs, 4)[2], before)
    weights = store.lookup(signs, 4, False)
    store.register_optimizer(AdagradConfig(initial_accumulator_value=0.25))
    _, w, state, _ = store.read_rows(signs, 4)
    np.testing.assert_array_equal(w, weights)  # weights kept
    np.testing.assert_array_equal(state, 0.25)  # new state from the new optimizer's initial value


def test_update_without_optimizer_is_refused():
    store = EmbeddingStore(10)
    store.lookup(np.array([1], np.uint64), 2, True)
    with pytest.raises(RuntimeError, match="register_optimizer"):
        store.update(np.array([1], np.uint64), np.ones((1, 2), np.float32))
