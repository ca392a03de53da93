"""FedMD: a public split disjoint from the clients', digest towards the consensus, scores uploaded."""

import copy

import numpy as np
import pytest
import torch
from algorithm_checks import client, close
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import extra_name
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_public_split_is_deterministic_and_disjoint_from_every_client(digits) -> None:
    clients = [client(digits, "fedmd", {"public_size": 100}, index=i) for i in range(5)]
    public = clients[0].public_idx
    assert len(public) == 100 and len(np.unique(public)) == 100
    for t in clients:
        assert np.array_equal(t.public_idx, public)
        assert not set(public.tolist()) & set(t.train_idx.tolist())
    counts = np.bincount(digits.train_labels[public], minlength=10)
    assert counts.min() >= 9  # stratified


def test_fedmd_digest_and_scores_by_hand(digits) -> None:
    t = client(digits, "fedmd", {"public_size": 60, "digest_epochs": 1.0}, batch_size=16)
    gen = torch.Generator().manual_seed(0)
    consensus = torch.randn(60, 10, generator=gen)
    assert list(t.algorithm.payload(t.gm)) == [extra_name("consensus")]
    t.begin_round(2, {extra_name("consensus"): consensus})
    slow = copy.deepcopy(t.gm)
    rng = copy.deepcopy(t.rng)
    order = rng.permutation(np.arange(60))  # the digest's shuffled pass over the public split
    xs = torch.stack([digits.train[int(i)][0] for i in t.public_idx])
    params = list(slow.parameters())
    slow.train()
    for start in range(0, 60, 16):
        pos = torch.as_tensor(order[start : start + 16])
        loss = sum((slow(xs[pos])[b, c] - consensus[pos[b], c]).abs() for b in range(len(pos)) for c in range(10)) / (
            len(pos) * 10
        )
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(0.05 * g)
    digest = t.algorithm.phases[0]
    from wafl.common.training import train_phase

    train_phase(t.gm, digest, t.ctx, t._data(digest, 1.0), t._optimizer(list(t.gm.parameters())))
    assert close(t.gm, slow)
    scores = t.gm_upload_state()[extra_name("consensus")]
    with torch.no_grad():
        slow.eval()
        assert torch.allclose(scores, slow(xs), atol=1e-5)


def test_fedmd_consensus_is_a_uniform_mean_and_round_one_has_no_digest(digits) -> None:
    algo = registry.resolve("fedmd")
    assert algo.server.weight(500) == 1.0 and not algo.evaluates_global
    assert not algo.phases[0].when(type("C", (), {"round": 1})())
