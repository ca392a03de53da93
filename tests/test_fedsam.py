"""FedSAM: each local step is SAM's ascent-then-descent, checked against plain SGD by hand."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_fedsam_round_is_sam_by_hand(digits) -> None:
    rho, lr = 0.1, 0.05
    t = client(digits, "fedsam", {"rho": rho})
    t.begin_round(1, global_payload(t))
    slow = copy.deepcopy(t.gm)
    params = list(slow.parameters())
    (batches,) = future_batches(t, 1)
    for x, y in batches:
        g = torch.autograd.grad(F.cross_entropy(slow(x), y), params)
        norm = torch.sqrt(sum((gi**2).sum() for gi in g))
        with torch.no_grad():
            w = [p.clone() for p in params]
            for p, gi in zip(params, g):
                p.add_(rho * gi / norm)
        g2 = torch.autograd.grad(F.cross_entropy(slow(x), y), params)
        with torch.no_grad():
            for p, wi, gi in zip(params, w, g2):
                p.copy_(wi - lr * gi)
    t.train_gm()
    assert close(t.gm, slow)
