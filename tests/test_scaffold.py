"""SCAFFOLD (option II): corrected local steps, the control-variate update and the server's, by hand."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload, with_variates
from wafl.common.algorithms.base import extra_name
from wafl.common.algorithms.scaffold import STATE_KEY
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_scaffold_client_round_by_hand(digits, tmp_path) -> None:
    lr = 0.05
    t = client(digits, "scaffold", state_dir=tmp_path)
    g, c, c_i = with_variates(t, 0.01)
    names = [n for n, _ in t.gm.named_parameters()]
    t.begin_round(1, g)
    slow = copy.deepcopy(t.gm)
    x0 = {n: p.detach().clone() for n, p in slow.named_parameters()}
    (batches,) = future_batches(t, 1)
    for xb, yb in batches:
        grads = torch.autograd.grad(F.cross_entropy(slow(xb), yb), list(slow.parameters()))
        with torch.no_grad():
            for (n, p), gr in zip(slow.named_parameters(), grads):
                p.sub_(lr * (gr - c_i[n] + c[n]))
    t.train_gm()
    assert close(t.gm, slow)
    k = len(batches)
    up = t.gm_upload_state()
    for n, p in slow.named_parameters():
        c_new = c_i[n] - c[n] + (x0[n] - p.detach()) / (k * lr)
        assert torch.allclose(up[extra_name("c." + n)], c_new - c_i[n], atol=1e-5)
        assert torch.allclose(t.client_state[STATE_KEY][n], c_new, atol=1e-5)
        assert torch.equal(up[n], t.gm.state_dict()[n])
    again = client(digits, "scaffold", state_dir=tmp_path)  # c_i survives a restart
    assert all(torch.equal(again.client_state[STATE_KEY][n], t.client_state[STATE_KEY][n]) for n in names)


def test_scaffold_variates_under_adam_are_the_mean_gradient(digits) -> None:
    """With Adam, c_i+ is the mean of the uncorrected mini-batch gradients, not (x - y) / (K eta)."""
    t = client(digits, "scaffold", optimizer="adam", lr=0.003)
    g = global_payload(t)
    t.begin_round(1, g)
    slow = copy.deepcopy(t.gm)
    opt = torch.optim.Adam(slow.parameters(), lr=0.003)
    (batches,) = future_batches(t, 1)
    total = {n: torch.zeros_like(p) for n, p in slow.named_parameters()}
    for xb, yb in batches:  # c = c_i = 0 in the first round: the plain Adam trajectory
        opt.zero_grad()
        F.cross_entropy(slow(xb), yb).backward()
        for n, p in slow.named_parameters():
            total[n] += p.grad
        opt.step()
    t.train_gm()
    assert close(t.gm, slow)
    for n, _ in slow.named_parameters():
        want = total[n] / len(batches)
        assert torch.allclose(t.client_state[STATE_KEY][n], want, atol=1e-6)
        assert float(want.abs().max()) < 5.0  # gradient-sized, where (x - y) / (K eta) is about 1 everywhere


def test_scaffold_server_update() -> None:
    from wafl.common.algorithms import registry

    algo = registry.resolve("scaffold", {}, {"num_clients": 10, "lr": 0.05})
    assert algo.server.weight(123) == 1.0  # the paper's uniform mean over the round's clients
    prev = {"w": torch.ones(3), extra_name("c.w"): torch.full((3,), 2.0)}
    mean = {"w": torch.tensor([0.5, 1.0, 1.5]), extra_name("c.w"): torch.tensor([1.0, -1.0, 0.0])}
    out = algo.server.finalize(prev, mean, participants=4)
    assert torch.equal(out["w"], mean["w"])
    assert torch.allclose(out[extra_name("c.w")], torch.tensor([2.4, 1.6, 2.0]))


def test_scaffold_c_divides_by_the_training_clients_not_the_held_out_ones() -> None:
    """``c`` is the mean of the ``N`` clients' variates, ``c <- c + (1/N) sum_S dc_i``; with ``new_clients = K``
    the ``K`` held-out clients have none, so ``N = num_clients - K``. Built as the engine builds it."""
    from wafl.common.algorithms import registry
    from wafl.common.config import load_config

    cfg = load_config(None, {"algorithm": "scaffold", "num_clients": 10, "new_clients": 3})
    algo = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    dcs = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 0.0, -1.0]), torch.tensor([-0.5, 4.0, 2.0])]
    c0 = torch.tensor([0.25, -0.75, 1.0])
    prev = {"w": torch.ones(3), extra_name("c.w"): c0}
    mean = {"w": torch.zeros(3), extra_name("c.w"): sum(dcs) / len(dcs)}
    out = algo.server.finalize(prev, mean, participants=len(dcs))
    want = [c0[j].item() + sum(dc[j].item() for dc in dcs) / (10 - 3) for j in range(3)]
    assert torch.allclose(out[extra_name("c.w")], torch.tensor(want), atol=1e-6)
