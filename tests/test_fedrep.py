"""FedRep: the head trains with the body frozen, then the body with the head frozen; only the body travels."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload, sgd_steps
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_fedrep_round_is_head_then_body_by_plain_sgd(digits) -> None:
    t = client(digits, "fedrep", local_epochs=2)
    g = global_payload(t)
    assert g and all(k.startswith("features.") for k in g)  # the head never travels
    t.begin_round(1, g)
    slow = copy.deepcopy(t.gm)
    head, body = future_batches(t, 1, 1)  # a head epoch then a body epoch (local_epochs 2, rep_epochs 1)
    ce = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    sgd_steps(slow, list(slow.classifier.parameters()), iter(head), ce, 0.05)
    sgd_steps(slow, list(slow.features.parameters()), iter(body), ce, 0.05)
    t.train_gm()
    assert close(t.gm, slow)
    up = t.gm_upload_state()
    assert list(up) == list(g)
    assert all(torch.equal(up[k], t.gm.state_dict()[k]) for k in up)


def test_fedrep_head_is_personal_and_survives_a_restart(digits, tmp_path) -> None:
    t = client(digits, "fedrep", state_dir=tmp_path)
    t.begin_round(1, global_payload(t))
    t.train_gm()
    t.train_pm(None, 1.0)  # the personal phase: the head alone
    head = [p.detach().clone() for p in t.gm.classifier.parameters()]
    body = [p.detach().clone() for p in t.gm.features.parameters()]
    t.train_pm(None, 1.0)
    assert close(list(t.gm.features.parameters()), body, atol=0)  # the body is frozen in it
    again = client(digits, "fedrep", state_dir=tmp_path)
    assert close(list(again.gm.classifier.parameters()), list(t.gm.classifier.parameters()), atol=0)
    # a new global body replaces the body only
    new_body = {k: torch.zeros_like(v) for k, v in global_payload(again).items()}
    again.begin_round(2, new_body)
    assert all(float(p.detach().abs().sum()) == 0 for p in again.gm.features.parameters())
    assert close(list(again.gm.classifier.parameters()), list(t.gm.classifier.parameters()), atol=0)
    assert not close(list(t.gm.classifier.parameters()), head, atol=0)
    assert again.algorithm.pm_when_unselected and not again.algorithm.evaluates_global
