"""FedDyn's term, client state and server update (all in wafl.common.algorithms.feddyn) checked by hand and
against slow re-computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.tensors import flat_np, random_like_params, tiny_model
from wafl.common.algorithms.feddyn import feddyn_client_state_update, feddyn_server_update, feddyn_term


def test_feddyn_term_value_and_gradient():
    model = tiny_model()
    anchor = random_like_params(model, 1)
    state = random_like_params(model, 2)
    alpha = 0.1
    loss = feddyn_term(model, anchor, state, alpha)

    w, a, g = flat_np(model.parameters()), flat_np(anchor), flat_np(state)
    lin = sum(wi * gi for wi, gi in zip(w.tolist(), g.tolist()))
    quad = sum((wi - ai) ** 2 for wi, ai in zip(w.tolist(), a.tolist()))
    assert loss.item() == pytest.approx(-lin + alpha / 2 * quad, rel=1e-12)

    grads = torch.autograd.grad(loss, list(model.parameters()))
    np.testing.assert_allclose(flat_np(grads), -g + alpha * (w - a), rtol=1e-12, atol=1e-14)


def test_feddyn_two_rounds_by_hand():
    # alpha = 0.5, m = 3 clients; all numbers below are computed by hand.
    alpha, m = 0.5, 3
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    w_g = t(1.0, 2.0)
    h = t(0.0, 0.0)
    g = {0: [t(0.0, 0.0)], 1: [t(0.0, 0.0)], 2: [t(0.0, 0.0)]}

    # round 1: clients 0 and 1
    local = {0: t(2.0, 2.0), 1: t(0.0, 4.0)}
    for k, w in local.items():
        g[k] = feddyn_client_state_update(g[k], [w], [w_g], alpha)
    torch.testing.assert_close(g[0][0], t(-0.5, 0.0))
    torch.testing.assert_close(g[1][0], t(0.5, -1.0))
    w_g, h = feddyn_server_update(w_g, local[0] + local[1], 2, h, alpha, m)
    torch.testing.assert_close(h, t(0.0, -1 / 3))
    torch.testing.assert_close(w_g, t(1.0, 11 / 3))

    # round 2: clients 1 and 2
    local = {1: t(1.0, 3.0), 2: t(3.0, 5.0)}
    for k, w in local.items():
        g[k] = feddyn_client_state_update(g[k], [w], [w_g], alpha)
    torch.testing.assert_close(g[0][0], t(-0.5, 0.0))  # untouched
    torch.testing.assert_close(g[1][0], t(0.5, -2 / 3))
    torch.testing.assert_close(g[2][0], t(-1.0, -2 / 3))
    w_g, h = feddyn_server_update(w_g, local[1] + local[2], 2, h, alpha, m)
    torch.testing.assert_close(h, t(-1 / 3, -4 / 9))
    torch.testing.assert_close(w_g, t(8 / 3, 44 / 9))


def test_feddyn_server_update_random_against_numpy():
    rng = np.random.default_rng(0)
    w_g, h = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    locals_ = [rng.normal(size=(3, 2)) for _ in range(4)]
    alpha, m = 0.01, 10
    new_g, new_h = feddyn_server_update(
        torch.from_numpy(w_g), torch.from_numpy(sum(locals_)), 4, torch.from_numpy(h), alpha, m
    )
    exp_h = h.copy()
    for wk in locals_:
        exp_h -= alpha / m * (wk - w_g)
    exp_g = np.mean(locals_, axis=0) - exp_h / alpha
    np.testing.assert_allclose(new_h.numpy(), exp_h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(new_g.numpy(), exp_g, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError):
        feddyn_server_update(torch.from_numpy(w_g), torch.from_numpy(w_g), 0, torch.from_numpy(h), alpha, m)


def test_feddyn_client_state_does_not_mutate():
    g = [torch.ones(2)]
    out = feddyn_client_state_update(g, [torch.full((2,), 3.0)], [torch.full((2,), 1.0)], 0.25)
    torch.testing.assert_close(out[0], torch.full((2,), 0.5))
    torch.testing.assert_close(g[0], torch.ones(2))


def test_feddyn_h_divides_by_the_training_clients_not_the_held_out_ones():
    """With ``new_clients = K`` only ``N - K`` clients train: the paper's ``m`` is those, so ``h`` moves by
    ``alpha / (N - K)`` per unit of drift (not ``alpha / N``). The algorithm is built as the engine builds it."""
    from wafl.common.algorithms import registry
    from wafl.common.config import load_config

    cfg = load_config(None, {"algorithm": "feddyn", "num_clients": 10, "new_clients": 3})
    algo = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    alpha, m = cfg.training.params["alpha"], 10 - 3
    rng = np.random.default_rng(1)
    w_g = rng.normal(size=(3, 2))
    locals_ = [rng.normal(size=(3, 2)) for _ in range(4)]
    prev = {"w": torch.from_numpy(w_g)}
    out = algo.server.finalize(prev, {"w": torch.from_numpy(np.mean(locals_, axis=0))}, participants=4)
    exp_h = np.zeros_like(w_g)
    for wk in locals_:  # h <- h - alpha (1/m) sum_S (w_k - w_g), m = the training clients
        exp_h -= alpha / m * (wk - w_g)
    np.testing.assert_allclose(algo.server.h["w"].numpy(), exp_h, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out["w"].numpy(), np.mean(locals_, axis=0) - exp_h / alpha, rtol=1e-9, atol=1e-9)


def test_feddyn_scores_the_participants_mean_when_asked() -> None:
    """``scored_model = "participants"``: the server evaluates the round's uniform mean of the uploads, the model
    FedDyn's and ASD's code score; the broadcast model is the corrected one either way, and the run trains the
    same: only the GM's accuracy and loss differ from the default's."""
    from wafl.cli.sim.simulate import simulate
    from wafl.common.algorithms.registry import resolve
    from wafl.common.config import load_config

    server = resolve("feddyn", {"scored_model": "participants"}, {"num_clients": 4}).server
    prev = {"w": torch.ones(3, dtype=torch.float64), "bn.num_batches_tracked": torch.tensor(2)}
    mean = {"w": torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64), "bn.num_batches_tracked": torch.tensor(5)}
    assert server.scored(prev) is prev  # nothing aggregated yet: the global model
    out = server.finalize(prev, mean, 2)
    assert not torch.equal(out["w"], mean["w"]) and torch.equal(server.scored(out)["w"], mean["w"])
    assert server.scored(out)["bn.num_batches_tracked"] is out["bn.num_batches_tracked"]
    plain = resolve("feddyn", {}, {"num_clients": 4}).server
    corrected = plain.finalize(prev, mean, 2)
    assert plain.scored(corrected) is corrected and torch.equal(corrected["w"], out["w"])

    base = {"algorithm": "feddyn", "num_clients": 4, "fraction": 0.5, "rounds": 3, "lr": 0.1, "checkpoint": False}
    rows = {s: simulate(load_config(None, {**base, "params": {"scored_model": s}})) for s in ("global", "participants")}
    drop = ("gm_accuracy", "gm_loss", "run_id", "wall_s", "round_s", "timestamp")
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows["global"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in rows["participants"]
    ]
    assert [r["gm_loss"] for r in rows["global"]] != [r["gm_loss"] for r in rows["participants"]]
