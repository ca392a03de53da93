"""FedRoD: balanced softmax for the body and generic head, a personal head on detached features."""

import copy

import numpy as np
import pytest
import torch
from algorithm_checks import client, close, future_batches, global_payload, sgd_steps
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def slow_loss(model, x, y, counts: list[int]) -> torch.Tensor:
    """Per sample: ``-log(n_y e^{g_y} / sum_c n_c e^{g_c})`` plus ``-log softmax(g.detach() + p(h.detach()))_y``."""
    h = model.features(x)
    g = model.classifier(h)
    p = model.personal_head(h.detach())
    total = 0.0
    for b in range(len(y)):
        yb = int(y[b])
        den = sum(counts[c] * torch.exp(g[b, c]) for c in range(len(counts)) if counts[c] > 0)
        total = total - torch.log(counts[yb] * torch.exp(g[b, yb]) / den)
        z = g[b].detach() + p[b]
        total = total - (z[yb] - torch.log(torch.exp(z).sum()))
    return total / len(y)


def test_fedrod_round_matches_the_slow_objective(digits) -> None:
    t = client(digits, "fedrod", index=1, alpha=0.1, batch_size=128)
    g = global_payload(t)
    assert "personal_head.weight" not in g and "classifier.weight" in g
    t.begin_round(1, g)
    counts = np.bincount(digits.train_labels[t.train_idx], minlength=10).tolist()
    assert 0 in counts  # a class the client lacks: it drops out of the balanced softmax
    slow = copy.deepcopy(t.gm)
    (batches,) = future_batches(t, 1)
    sgd_steps(slow, list(slow.parameters()), iter(batches), lambda m, x, y: slow_loss(m, x, y, counts), 0.05)
    t.train_gm()
    assert close(t.gm, slow, atol=1e-4)


def test_fedrod_personal_model_adds_the_personal_head(digits, tmp_path) -> None:
    t = client(digits, "fedrod", state_dir=tmp_path)
    t.begin_round(1, global_payload(t))
    t.train_gm()
    shared = {k: v.clone() for k, v in t.gm.state_dict().items() if not k.startswith("personal_head")}
    t.train_pm(None, 1.0)  # the personal head alone
    assert all(torch.equal(t.gm.state_dict()[k], v) for k, v in shared.items())
    x = torch.as_tensor(digits.test.tensors[0][:5])
    with torch.no_grad():
        h = t.gm.features(x)
        want = t.gm.classifier(h) + t.gm.personal_head(h)
        assert torch.allclose(t.personal_model()(x), want)
        assert torch.allclose(t.gm(x), t.gm.classifier(h))  # the generic model, as the server tests it
    again = client(digits, "fedrod", state_dir=tmp_path)
    assert torch.equal(again.gm.personal_head.weight, t.gm.personal_head.weight)
