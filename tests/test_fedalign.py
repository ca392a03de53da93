"""FedAlign: the Lipschitz estimate, the sub-network and the rescaled term, against closed forms."""

import math

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, global_payload
from wafl.common.algorithms.base import Forward
from wafl.common.algorithms.fedalign import (
    LipschitzAlignment,
    lipschitz_gap,
    sub_block,
    top_singular_value,
    transmitting_matrix,
)
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_lipschitz_estimate_is_the_top_singular_value() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 5, 2, 2, generator=gen)
    m = transmitting_matrix(a, b)
    for i in range(3):
        want = torch.einsum("cs,ds->cd", a[i].reshape(4, 4), b[i].reshape(5, 4)) / 4
        assert torch.allclose(m[i], want, atol=1e-6)
    got = top_singular_value(m, iterations=200)
    assert torch.allclose(got, torch.linalg.matrix_norm(m, ord=2), rtol=1e-4)
    # vectors (a fully connected block): the estimate is ||a|| ||b||
    u, v = torch.randn(3, 6, generator=gen), torch.randn(3, 2, generator=gen)
    assert torch.allclose(top_singular_value(transmitting_matrix(u, v)), u.norm(dim=1) * v.norm(dim=1), rtol=1e-5)


def test_term_matches_a_slow_recomputation(digits) -> None:
    t = client(digits, "fedalign")
    ctx = t.begin_round(1, global_payload(t))
    x = torch.as_tensor(digits.train.tensors[0][:6])
    y = torch.as_tensor(digits.train.tensors[1][:6])
    h, logits = t.gm.forward_split(x)
    term = LipschitzAlignment(0.45, 0.25)
    value = term(t.gm, Forward(x, y, h, logits, ctx), ctx)
    f = t.gm.features
    with torch.no_grad():
        xin = f[:-3](x)
        c, hidden, out = xin.shape[1], f[-3].out_features, f[-1].out_features  # 1024, 128, 32: slices of a quarter
        i, k, o = c // 4, hidden // 4, out // 4
        w1, b1, w2, b2 = f[-3].weight[:k, :i], f[-3].bias[:k], f[-1].weight[:o, :k], f[-1].bias[:o]
        gap = 0.0
        for b in range(6):
            hs = w2 @ torch.relu(w1 @ xin[b, :i] + b1) + b2
            full = float(xin[b].norm() * h[b].norm())
            sub = float(xin[b, :i].norm() * hs.norm())
            gap += (sub - full) ** 2 / 6
        ce = float(F.cross_entropy(logits, y))
    assert value.item() == pytest.approx(0.45 * ce, rel=1e-4)  # rescaled to mu * CE
    assert gap > 0 and math.isfinite(gap)
    with torch.no_grad():
        got = lipschitz_gap(xin, h, *sub_block(f[-3], f[-1], xin, 0.25))
    assert got.item() == pytest.approx(gap, rel=1e-4)
    grads = torch.autograd.grad(value, [f[-3].weight, f[-1].weight, f[0].weight], allow_unused=True)
    assert grads[0] is not None and float(grads[0][:k, :i].abs().sum()) > 0
    assert float(grads[0][k:].abs().sum()) == 0 and float(grads[0][:, i:].abs().sum()) == 0  # only the slice
    assert float(grads[1][:o, :k].abs().sum()) > 0 and float(grads[1][o:].abs().sum()) == 0
    assert grads[2] is None  # nothing before the block


def test_inactive_sub_network_gives_a_finite_term() -> None:
    """A sample on which every unit of the slice is inactive has a zero estimate, not NaN."""
    first, last = torch.nn.Linear(8, 4), torch.nn.Linear(4, 4)
    with torch.no_grad():
        first.weight.zero_()
        first.bias.fill_(-1.0)
        last.bias.zero_()
    x = torch.randn(3, 8)
    xs, hs = sub_block(first, last, x, 0.5)
    assert xs.shape == (3, 4) and hs.shape == (3, 2) and float(hs.detach().abs().sum()) == 0
    h = torch.randn(3, 4)
    gap = lipschitz_gap(x, h, xs, hs)
    assert math.isfinite(gap.item())
    want = float(((x.norm(dim=1) * h.norm(dim=1)) ** 2).mean())
    assert gap.item() == pytest.approx(want, rel=1e-4)


def test_lenet5_block_ends_in_its_relu_and_matches_a_slow_recomputation() -> None:
    """LeNet-5's features end in Linear(256, 120) - ReLU - Linear(120, 84) - ReLU: the block is those four
    layers, and the sub-network's block at width 0.25 ends in the ReLU too."""
    from wafl.common.algorithms.fedalign import final_block
    from wafl.common.models.lenet5 import lenet5

    torch.manual_seed(0)
    model = lenet5()
    pre, first, last, relu_out = final_block(model)
    f = model.features
    assert relu_out and first is f[-4] and last is f[-2] and len(pre) == len(f) - 4
    x = torch.randn(6, 1, 28, 28)
    y = torch.randint(0, 10, (6,))
    h, logits = model.forward_split(x)
    value = LipschitzAlignment(0.45, 0.25)(model, Forward(x, y, h, logits, None), None)
    with torch.no_grad():
        xin = pre(x)
        i, k, o = math.ceil(256 / 4), math.ceil(120 / 4), math.ceil(84 / 4)
        w1, b1, w2, b2 = first.weight[:k, :i], first.bias[:k], last.weight[:o, :k], last.bias[:o]
        gap = 0.0
        for b in range(6):
            hs = torch.relu(w2 @ torch.relu(w1 @ xin[b, :i] + b1) + b2)
            assert torch.equal(sub_block(first, last, xin[b : b + 1], 0.25, True)[1][0], hs)
            full = float(xin[b].norm() * h[b].norm())
            sub = float(xin[b, :i].norm() * hs.norm())
            gap += (sub - full) ** 2 / 6
        got = lipschitz_gap(xin, h, *sub_block(first, last, xin, 0.25, relu_out))
    assert got.item() == pytest.approx(gap, rel=1e-4) and gap > 0
    assert value.detach().item() == pytest.approx(0.45 * float(F.cross_entropy(logits, y).detach()), rel=1e-4)


def test_a_model_without_the_block_is_refused_by_name() -> None:
    from wafl.common.algorithms.fedalign import final_block

    model = torch.nn.Module()
    model.features = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ValueError, match="Linear - ReLU - Linear"):
        final_block(model)
