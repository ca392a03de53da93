"""FedBABU: the body trains and travels, the head stays at its initialisation; the PM fine-tunes the global model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload, sgd_steps
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_fedbabu_trains_the_body_with_the_initial_head(digits) -> None:
    t = client(digits, "fedbabu")
    g = global_payload(t)
    assert g and all(k.startswith("features.") for k in g)
    t.begin_round(1, g)
    slow = copy.deepcopy(t.gm)
    head0 = [p.detach().clone() for p in t.gm.classifier.parameters()]
    (batches,) = future_batches(t, 1)
    sgd_steps(slow, list(slow.features.parameters()), iter(batches), lambda m, x, y: F.cross_entropy(m(x), y), 0.05)
    t.train_gm()
    assert close(t.gm, slow)
    assert close(list(t.gm.classifier.parameters()), head0, atol=0)
    assert list(t.gm_upload_state()) == list(g)


def test_fedbabu_pm_is_the_received_global_model_fine_tuned(digits) -> None:
    t = client(digits, "fedbabu")
    g = global_payload(t)
    t.begin_round(1, g)
    t.train_gm()
    t.train_pm(None, 1.0)  # fine-tunes body and head
    assert not close(t.pm, t.gm, atol=0)
    assert not close(list(t.pm.classifier.parameters()), list(t.gm.classifier.parameters()), atol=0)
    new = {k: v + 0.01 for k, v in g.items()}
    t.begin_round(2, new)  # each round the PM restarts from the received global model
    assert close(t.pm, t.gm, atol=0)
    assert all(torch.equal(t.pm.state_dict()[k], v) for k, v in new.items())
    head = client(digits, "fedbabu", {"finetune": "head"})
    head.begin_round(1, global_payload(head))
    head.train_pm(None, 1.0)
    assert close(list(head.pm.features.parameters()), list(head.gm.features.parameters()), atol=0)
