"""FedRep: the head trains with the body frozen, then the body with the head frozen; only the body travels."""

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload, sgd_steps
from wafl.client.protocol import RoundProtocol
from wafl.client.session import ReceivedModel
from wafl.common import metrics as M
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


class _Transport:
    """A server of one client: it sends ``models`` one at a time, the next once the client has uploaded
    (its round is done), and keeps the client's reports."""

    client_id = "client-0"

    def __init__(self, models: list) -> None:
        self._models = models
        self.on_header = None
        self.reports: list[tuple[int, dict[str, float]]] = []
        self._uploaded = asyncio.Event()

    async def models(self):
        for m in self._models:
            yield m
            if not m.final:
                await self._uploaded.wait()
                self._uploaded.clear()

    async def upload(self, round, state, num_samples, metrics, knowledge=None) -> int:
        self._uploaded.set()
        return 0

    async def report(self, round, metrics, timeline=None, start_unix=0.0) -> None:
        self.reports.append((round, dict(metrics)))


def _slow_accuracy(t, state: dict[str, torch.Tensor]) -> float:
    """A fresh copy of the network holding ``state``, tested one local test sample at a time."""
    net = copy.deepcopy(t.gm)
    net.load_state_dict(state)
    net.eval()
    correct = 0
    with torch.no_grad():
        for i in t.test_idx:
            x, y = t.data.test[int(i)]
            correct += int(int(net(x.unsqueeze(0)).argmax(1)) == int(y))
    return correct / len(t.test_idx)


@pytest.mark.parametrize("protocol", ["compute-and-wait", "wait-free"])
def test_fedrep_pm_accuracy_is_the_received_global_body_with_the_personal_head(digits, protocol) -> None:
    """FedRep's paper and the authors' code (main_fedrep.py: the averaged body is loaded, then
    test_img_local_all with each client's head) score the PM of a round as the next global body with the
    client's personal head, never the client's own trained body; the final PM likewise on the final body."""
    t = client(digits, "fedrep", protocol=protocol, pm_epochs=1, pm_min_steps=3)
    first = global_payload(t)
    gen = torch.Generator().manual_seed(7)
    # the server's next bodies: far from what the client trains (a reported accuracy of its own body differs)
    bodies = [first] + [
        {k: v + 0.5 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in first.items()}
        for _ in range(2)
    ]
    heads: list[dict[str, torch.Tensor]] = []  # the client's head after each round's personal phase
    train_pm = t.train_pm

    def recording_train_pm(*args, **kwargs):
        stats = train_pm(*args, **kwargs)
        heads.append({k: t.gm.state_dict()[k].detach().clone() for k in t.local_keys})
        return stats

    t.train_pm = recording_train_pm
    models = [ReceivedModel(r, True, r == 3, dict(b), {}) for r, b in zip((1, 2, 3), bodies)]
    transport = _Transport(models)
    asyncio.run(RoundProtocol(transport, t, protocol).run())  # type: ignore[arg-type]
    pm = {r: m[M.PM_ACCURACY] for r, m in transport.reports if M.PM_ACCURACY in m}
    assert sorted(pm) == [1, 2] and len(heads) == 2
    for r in (1, 2):  # round r's PM: the body broadcast after it (round r + 1's, the final one) with round r's head
        assert pm[r] == pytest.approx(_slow_accuracy(t, {**bodies[r], **heads[r - 1]}), abs=1e-12)
    assert any(M.FINAL in m for _, m in transport.reports)
