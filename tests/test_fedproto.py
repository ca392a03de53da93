"""FedProto as in its paper (prototypes only, uniform per-class mean over holders, MSE over all
samples and dimensions) and the variant with a FedAvg global model (``fedproto-avg``)."""

import pytest
import torch
from algorithm_checks import client
from wafl.cli.simulate import simulate
from wafl.common.algorithms import registry
from wafl.common.algorithms.prototypes import fedproto_paper_term
from wafl.common.config import load_config
from wafl.common.datasets import load_dataset
from wafl.common.knowledge import ClassKnowledge, KnowledgeAccumulator


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_paper_regularizer_is_the_mean_over_all_samples_and_dimensions() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(6, 4, generator=gen)
    y = torch.tensor([0, 2, 2, 1, 3, 0])
    protos = {j: ClassKnowledge(j, 5, torch.randn(4, generator=gen), torch.zeros(4)) for j in (0, 2)}
    total = 0.0
    for b in range(6):  # classes 1 and 3 have no prototype: they count in the mean with 0
        if int(y[b]) in protos:
            total += sum(float(h[b, d] - protos[int(y[b])].rep[d]) ** 2 for d in range(4))
    assert fedproto_paper_term(h, y, protos).item() == pytest.approx(total / (6 * 4), rel=1e-6)
    assert fedproto_paper_term(h, y, {}).item() == 0.0


def test_prototypes_are_averaged_uniformly_over_the_clients_holding_the_class() -> None:
    gen = torch.Generator().manual_seed(1)
    uploads = [
        {0: ClassKnowledge(0, 3, torch.randn(4, generator=gen), torch.rand(3, generator=gen))},
        {
            0: ClassKnowledge(0, 50, torch.randn(4, generator=gen), torch.rand(3, generator=gen)),
            2: ClassKnowledge(2, 7, torch.randn(4, generator=gen), torch.rand(3, generator=gen)),
        },
    ]
    acc = KnowledgeAccumulator(3, uniform=True)
    for u in uploads:
        acc.add(u)
    got = acc.result()
    assert sorted(got) == [0, 2]
    assert torch.allclose(got[0].rep, (uploads[0][0].rep + uploads[1][0].rep) / 2)
    assert torch.allclose(got[2].rep, uploads[1][2].rep)
    assert got[0].count == 53


def test_paper_fedproto_shares_no_model_and_keeps_its_local_model(digits, tmp_path) -> None:
    algo = registry.resolve("fedproto")
    assert algo.knowledge_weighting == "uniform" and not algo.evaluates_global
    t = client(digits, "fedproto", state_dir=tmp_path)
    assert dict(algo.payload(t.gm)) == {}
    t.begin_round(1, {})
    t.train_gm()
    again = client(digits, "fedproto", state_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(t.gm.state_dict().values(), again.gm.state_dict().values()))
    avg = registry.resolve("fedproto-avg")
    assert avg.knowledge_weighting == "count" and len(avg.payload(t.gm)) == len(t.gm.state_dict())


def test_paper_fedproto_runs_without_a_global_model() -> None:
    cfg = load_config(
        None,
        {"algorithm": "fedproto", "num_clients": 3, "rounds": 2, "local_epochs": 1, "checkpoint": False},
    )
    rows = simulate(cfg)
    assert [r["gm_accuracy"] for r in rows] == [None, None]
    assert all(r["pm_accuracy"] is not None and r["knowledge_classes"] > 0 for r in rows)
