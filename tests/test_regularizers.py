"""Regularizers and server updates checked against slow, independent re-computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.tensors import flat_np, random_like_params, tiny_model
from wafl.common.algorithms.regularizers import (
    asd_kl,
    asd_term,
    asd_weights,
    fedavgm_update,
    not_true_logits,
    ntd_term,
    params_snapshot,
    proximal_term,
)

# ----------------------------------------------------------------------------- FedProx / Ditto


def test_proximal_value_and_gradient():
    model = tiny_model()
    anchor = random_like_params(model, 1)
    mu = 0.37
    loss = proximal_term(model, anchor, mu)

    w, a = flat_np(model.parameters()), flat_np(anchor)
    slow = 0.0
    for wi, ai in zip(w.tolist(), a.tolist()):
        slow += (wi - ai) ** 2
    assert loss.item() == pytest.approx(mu / 2 * slow, rel=1e-12)

    grads = torch.autograd.grad(loss, list(model.parameters()))
    np.testing.assert_allclose(flat_np(grads), mu * (w - a), rtol=1e-12, atol=1e-14)


def test_proximal_zero_at_anchor_and_frozen_params_skipped():
    model = tiny_model()
    assert proximal_term(model, params_snapshot(model), 1.0).item() == 0.0
    model[0].bias.requires_grad_(False)
    anchor = params_snapshot(model)
    assert len(anchor) == 3
    with pytest.raises(ValueError, match="anchor"):
        proximal_term(model, random_like_params(model, 2), 1.0)  # 4 tensors for 3 trainable params


# ----------------------------------------------------------------------------- FedAvgM


def test_fedavgm_two_steps_against_numpy():
    rng = np.random.default_rng(1)
    w, v = rng.normal(size=5), np.zeros(5)
    beta, eta = 0.9, 0.7
    tw, tv = torch.from_numpy(w), torch.from_numpy(v)
    for _ in range(2):
        avg = rng.normal(size=5)
        tw, tv = fedavgm_update(tw, torch.from_numpy(avg), tv, beta, eta)
        v = beta * v + (w - avg)
        w = w - eta * v
        np.testing.assert_allclose(tv.numpy(), v, rtol=1e-12)
        np.testing.assert_allclose(tw.numpy(), w, rtol=1e-12)
    # beta = 0, eta = 1 is plain FedAvg
    new_w, _ = fedavgm_update(torch.zeros(3), torch.arange(3.0), torch.ones(3), 0.0, 1.0)
    torch.testing.assert_close(new_w, torch.arange(3.0))


# ----------------------------------------------------------------------------- ASD


def _softmax(row: list[float], temp: float = 1.0) -> list[float]:
    mx = max(row)
    e = [math.exp((x - mx) / temp) for x in row]
    s = sum(e)
    return [x / s for x in e]


def _slow_asd(z, s, y, freq, temp, uniform=False):
    """Returns (weights, KL per sample, total) with plain Python loops."""
    b = len(z)
    kls, a = [], []
    for i in range(b):
        qg, qk = _softmax(s[i], temp), _softmax(z[i], temp)
        kls.append(sum(pg * (math.log(pg) - math.log(pk)) for pg, pk in zip(qg, qk)))  # KL(global||local)
        p1 = _softmax(s[i], 1.0)
        entropy = -sum(p * math.log(p) for p in p1)
        a.append(math.exp(-entropy) / freq[y[i]])
    alpha = [1.0 / b] * b if uniform else [ai / sum(a) for ai in a]
    return alpha, kls, sum(al * kl for al, kl in zip(alpha, kls))


@pytest.mark.parametrize("temp", [1.0, 2.0, 4.0])
def test_asd_against_loops(temp):
    torch.manual_seed(0)
    b, c = 6, 5
    z = torch.randn(b, c, dtype=torch.float64) * 2
    s = torch.randn(b, c, dtype=torch.float64) * 2
    y = torch.tensor([0, 1, 1, 4, 2, 0])
    freq = torch.tensor([0.4, 0.1, 0.2, 0.05, 0.25], dtype=torch.float64)

    alpha, kls, total = _slow_asd(z.tolist(), s.tolist(), y.tolist(), freq.tolist(), temp)
    np.testing.assert_allclose(asd_weights(s, y, freq).numpy(), alpha, rtol=1e-10)
    np.testing.assert_allclose(asd_kl(z, s, temp).detach().numpy(), kls, rtol=1e-10)
    assert asd_term(z, s, y, freq, temp).item() == pytest.approx(total, rel=1e-10)
    assert asd_weights(s, y, freq).sum().item() == pytest.approx(1.0, rel=1e-12)
    # KL direction matters: the reverse direction gives a different number
    reverse = [
        sum(pk * (math.log(pk) - math.log(pg)) for pg, pk in zip(_softmax(si, temp), _softmax(zi, temp)))
        for zi, si in zip(z.tolist(), s.tolist())
    ]
    assert not np.allclose(kls, reverse, rtol=1e-3)
    # counts instead of frequencies give the same weights
    torch.testing.assert_close(asd_weights(s, y, freq * 200), asd_weights(s, y, freq))


def test_asd_uniform_equals_batch_mean_kl():
    torch.manual_seed(1)
    z, s = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (7,))
    freq = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    got = asd_term(z, s, y, freq, 2.0, uniform=True)
    ref = F.kl_div(F.log_softmax(z / 2, 1), F.log_softmax(s / 2, 1), log_target=True, reduction="batchmean")
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    _, _, slow = _slow_asd(z.tolist(), s.tolist(), y.tolist(), freq.tolist(), 2.0, uniform=True)
    assert got.item() == pytest.approx(slow, rel=1e-10)


def test_asd_gradient_only_through_student():
    torch.manual_seed(2)
    b, c, temp = 5, 3, 2.0
    z = torch.randn(b, c, dtype=torch.float64, requires_grad=True)
    s = torch.randn(b, c, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 2, 1])
    freq = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    asd_term(z, s, y, freq, temp).backward()
    assert s.grad is None
    # analytic: d/dz_i [alpha_i KL_i] = alpha_i * (softmax(z_i/T) - softmax(s_i/T)) / T
    alpha = asd_weights(s.detach(), y, freq)
    expected = alpha[:, None] * (torch.softmax(z.detach() / temp, 1) - torch.softmax(s.detach() / temp, 1)) / temp
    torch.testing.assert_close(z.grad, expected, rtol=1e-10, atol=1e-12)


def test_asd_zero_frequency_raises():
    z = torch.randn(3, 3)
    y = torch.tensor([0, 2, 1])
    with pytest.raises(ValueError, match=r"class\(es\) \[2\]"):
        asd_term(z, z.clone(), y, torch.tensor([0.5, 0.5, 0.0]), 2.0)
    # a zero frequency for a class absent from the batch is fine
    asd_term(z, z.clone(), torch.tensor([0, 1, 1]), torch.tensor([0.5, 0.5, 0.0]), 2.0)


# ----------------------------------------------------------------------------- FedNTD


def _slow_ntd(z, s, y, temp):
    total = 0.0
    for zi, si, yi in zip(z, s, y):
        zs = [v for c, v in enumerate(zi) if c != yi]
        ss = [v for c, v in enumerate(si) if c != yi]
        qs, qt = _softmax(zs, temp), _softmax(ss, temp)
        total += sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(qt, qs))  # KL(teacher||student)
    return temp**2 * total / len(z)


def test_not_true_selection():
    logits = torch.arange(12.0).reshape(3, 4)
    out = not_true_logits(logits, torch.tensor([0, 2, 3]))
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0], [8.0, 9.0, 10.0]]))


@pytest.mark.parametrize("temp", [1.0, 3.0])
def test_ntd_against_loops(temp):
    torch.manual_seed(3)
    z = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    s = torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 4, 2, 2, 1, 3])
    got = ntd_term(z, s, y, temp)
    assert got.item() == pytest.approx(_slow_ntd(z.tolist(), s.tolist(), y.tolist(), temp), rel=1e-10)
    # the true-class logit carries no gradient and does not change the loss
    got.backward()
    assert torch.all(z.grad[torch.arange(6), y] == 0)
    z2 = z.detach().clone()
    z2[torch.arange(6), y] += 10.0
    assert ntd_term(z2, s, y, temp).item() == pytest.approx(got.item(), rel=1e-12)
    # it differs from a plain KL over all classes
    full = F.kl_div(F.log_softmax(z / temp, 1), F.log_softmax(s / temp, 1), log_target=True, reduction="batchmean")
    assert abs(full.item() * temp**2 - got.item()) > 1e-6
