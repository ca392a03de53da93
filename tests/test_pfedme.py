"""pFedMe: K inner steps on the personal model per batch, then the local model's step, by hand."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload
from wafl.common.algorithms import registry
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_pfedme_round_by_hand(digits) -> None:
    lam, plr, k, lr = 15.0, 0.01, 3, 0.05
    t = client(digits, "pfedme", {"lambda": lam, "personal_lr": plr, "k": k})
    with torch.no_grad():  # a personal model left from an earlier round: theta restarts from w regardless
        for p in t.pm.parameters():
            p.add_(1.0)
    t.begin_round(1, global_payload(t))
    w_model, th_model = copy.deepcopy(t.gm), copy.deepcopy(t.gm)
    w, th = list(w_model.parameters()), list(th_model.parameters())
    (batches,) = future_batches(t, 1)
    for xb, yb in batches:
        for _ in range(k):
            g = torch.autograd.grad(F.cross_entropy(th_model(xb), yb), th)
            with torch.no_grad():
                for a, ga, b in zip(th, g, w):
                    a.sub_(plr * (ga + lam * (a - b)))
        with torch.no_grad():
            for b, a in zip(w, th):
                b.sub_(lr * lam * (b - a))
    t.train_gm()
    assert close(t.gm, w_model)
    assert close(t.pm, th_model)


def test_pfedme_server_and_personal_phase(digits) -> None:
    algo = registry.resolve("pfedme", {"beta": 0.5})
    prev = {"w": torch.zeros(2)}
    assert torch.equal(algo.server.finalize(prev, {"w": torch.tensor([2.0, 4.0])}, 3)["w"], torch.tensor([1.0, 2.0]))
    assert not algo.pm_when_unselected and algo.personal == "separate"
    t = client(digits, "pfedme")
    t.begin_round(1, global_payload(t))
    t.train_gm()
    before = copy.deepcopy(t.gm)
    t.train_pm(None, 1.0)  # the inner problem alone: the local model stays
    assert close(t.gm, before, atol=0)
