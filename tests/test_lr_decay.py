"""The clients' learning rate decayed by round: the run option ``lr_decay`` (``lr * lr_decay ** (t - 1)`` in round
``t``, as the code of FedDyn and of ASD decays it by 0.998 a round), against plain SGD steps by hand."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload, sgd_steps
from wafl.common.config import ConfigError, load_config
from wafl.common.datasets import load_dataset
from wafl.common.training import decay_lr


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_decay_lr_sets_each_group_from_its_first_rate() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.2}], lr=0.1)
    assert [g["lr"] for g in decay_lr(opt, 0.5, 3).param_groups] == [0.1 * 0.25, 0.2 * 0.25]
    assert [g["lr"] for g in decay_lr(opt, 0.5, 4).param_groups] == [0.1 * 0.125, 0.2 * 0.125]  # not compounded
    assert [g["lr"] for g in decay_lr(opt, 0.5, 1).param_groups] == [0.1, 0.2]
    plain = torch.optim.SGD(a.parameters(), lr=0.1)
    before = copy.deepcopy(plain.state_dict())
    assert decay_lr(plain, 1.0, 50).state_dict() == before  # no decay: the optimizer as it was


def test_a_clients_local_steps_take_the_rounds_decayed_rate(digits) -> None:
    t = client(digits, "fedavg", lr_decay=0.9)
    payload = global_payload(t)
    t.begin_round(3, payload)
    slow = copy.deepcopy(t.gm)
    (batches,) = future_batches(t, 1)
    sgd_steps(slow, list(slow.parameters()), iter(batches), lambda m, x, y: F.cross_entropy(m(x), y), 0.05 * 0.9**2)
    t.train_gm()
    assert close(t.gm, slow, atol=1e-6)
    again = client(digits, "fedavg", lr_decay=0.9)  # round 1: the configured rate, the same bits as no decay
    plain = client(digits, "fedavg")
    for c in (again, plain):
        c.begin_round(1, payload)
        c.train_gm()
    assert all(torch.equal(p, q) for p, q in zip(again.gm.parameters(), plain.gm.parameters()))


def test_a_pm_optimizer_kept_across_rounds_takes_each_rounds_rate(digits) -> None:
    t = client(digits, "ditto", lr_decay=0.5)
    payload = global_payload(t)
    for r in (1, 2, 4):
        t.begin_round(r, payload)
        t.train_pm(num_epochs=0.1)
        assert [g["lr"] for g in t.pm_optimizer.param_groups] == [0.05 * 0.5 ** (r - 1)]


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_lr_decay_outside_its_range_is_refused_by_name(value: float) -> None:
    with pytest.raises(ConfigError, match=rf"lr_decay={value!r} must lie in \(0.0, 1.0\]"):
        load_config(None, {"lr_decay": value})
