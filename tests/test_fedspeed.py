"""FedSpeed: merged perturbed gradient, prox correction and dual variable, by hand (Algorithm 1), and the
server's two means of the duals (``dual_mean``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload
from wafl.common.algorithms import registry
from wafl.common.algorithms.fedspeed import STATE_KEY
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.mark.parametrize("dual_mean", ["participants", "all"])
def test_fedspeed_round_by_hand(digits, tmp_path, dual_mean: str) -> None:
    """The client's steps and dual are Algorithm 1's either way; it uploads ``x_K - lambda * g_hat`` for the
    participants' mean of the duals and ``x_K`` when the server keeps every client's."""
    lam, alpha, rho, lr = 2.0, 0.3, 0.1, 0.05
    given = {"lambda": lam, "alpha": alpha, "rho": rho, "dual_mean": dual_mean}
    t = client(digits, "fedspeed", given, state_dir=tmp_path)
    gen = torch.Generator().manual_seed(0)
    dual = [0.01 * torch.randn(p.shape, generator=gen) for p in t.gm.parameters()]
    t.client_state[STATE_KEY] = [d.clone() for d in dual]
    t.begin_round(1, global_payload(t))
    slow = copy.deepcopy(t.gm)
    ps = list(slow.parameters())
    x0 = [p.detach().clone() for p in ps]
    (batches,) = future_batches(t, 1)
    for xb, yb in batches:
        g1 = torch.autograd.grad(F.cross_entropy(slow(xb), yb), ps)
        norm = torch.sqrt(sum((g**2).sum() for g in g1))
        w = [p.detach().clone() for p in ps]
        with torch.no_grad():
            for p, g in zip(ps, g1):
                p.add_(rho * g / norm)
        g2 = torch.autograd.grad(F.cross_entropy(slow(xb), yb), ps)
        with torch.no_grad():
            for p, wi, a, b, d, x in zip(ps, w, g1, g2, dual, x0):
                p.copy_(wi - lr * ((1 - alpha) * a + alpha * b - d + (wi - x) / lam))
    new_dual = [d - (p.detach() - x) / lam for d, p, x in zip(dual, ps, x0)]
    upload = [p.detach() - lam * d if dual_mean == "participants" else p.detach() for p, d in zip(ps, new_dual)]
    t.train_gm()
    assert close(list(t.gm.parameters()), upload, atol=1e-4)
    assert close(t.client_state[STATE_KEY], new_dual, atol=1e-5)
    again = client(digits, "fedspeed", given, state_dir=tmp_path)
    assert close(again.client_state[STATE_KEY], t.client_state[STATE_KEY], atol=0)


def test_fedspeed_server_keeps_the_mean_of_every_clients_dual() -> None:
    """``dual_mean = "all"``: after rounds with different participants the global model is
    ``mean_S(x_K) - lambda * (1/m) sum_i g_hat_i`` over all ``m`` training clients, the duals updated as the
    clients update theirs; ``"participants"`` is FedAvg's mean of the uploads ``x_K - lambda * g_hat_i``."""
    lam, m = 4.0, 5
    run = {"num_clients": m + 1, "new_clients": 1}
    server = registry.resolve("fedspeed", {"lambda": lam, "dual_mean": "all"}, run).server
    assert type(server).__name__ == "FedDynUpdate" and server.weight(120) == 1.0
    assert type(registry.resolve("fedspeed", {}, run).server).__name__ == "ServerUpdate"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    duals = [torch.zeros_like(x) for _ in range(m)]
    for participants in ([0, 1], [1, 2, 4], [4]):
        local = {i: x + 0.1 * torch.randn(x.shape, generator=gen, dtype=torch.float64) for i in participants}
        for i in participants:
            duals[i] = duals[i] - (local[i] - x) / lam
        mean = {"w": sum(local.values()) / len(participants)}
        x_new = server.finalize({"w": x}, mean, len(participants))["w"]
        by_hand = sum(local.values()) / len(participants) - lam * sum(duals) / m
        assert torch.allclose(x_new, by_hand, atol=1e-12)
        x = x_new


def test_fedspeed_with_every_clients_dual_trains_a_partial_federation() -> None:
    """``dual_mean = "all"`` through the engine, half the clients a round: the global model learns (chance 0.1)."""
    from wafl.cli.sim.simulate import simulate
    from wafl.common.config import load_config

    cfg = {"algorithm": "fedspeed", "params": {"dual_mean": "all"}, "num_clients": 4, "fraction": 0.5, "rounds": 5}
    rows = simulate(load_config(None, {**cfg, "lr": 0.1, "local_epochs": 2, "checkpoint": False}))
    assert [r["clients"] for r in rows] == [2] * 5
    assert rows[-1]["gm_accuracy"] > 0.5
