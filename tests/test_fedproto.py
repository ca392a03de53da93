"""FedProto as in its paper (prototypes only, the per-class mean over holders weighted by counts or
uniform as ``proto_weighting`` says, MSE over all samples and dimensions) and the variant with a
FedAvg global model (``fedproto-avg``)."""

import pytest
import torch
import wafl.server.strategies.base as strategies_base
from algorithm_checks import client
from wafl.cli.sim.simulate import simulate
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
    assert algo.knowledge_weighting == "count" and not algo.evaluates_global
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


@pytest.mark.parametrize("algorithm", ["fedproto", "fedproto-avg"])
def test_proto_weighting_defaults_to_count_and_refuses_other_values(algorithm) -> None:
    assert registry.resolve(algorithm).params["proto_weighting"] == "count"
    assert registry.resolve(algorithm).knowledge_weighting == "count"
    assert registry.resolve(algorithm, {"proto_weighting": "uniform"}).knowledge_weighting == "uniform"
    with pytest.raises(ValueError, match=r"params\.proto_weighting='median' must be one of \['count', 'uniform'\]"):
        registry.resolve(algorithm, {"proto_weighting": "median"})


def slow_prototype_mean(uploads: list[dict], j: int, weighting: str) -> list[float]:
    """Class ``j``'s global prototype, coordinate by coordinate in float64 in upload order: each holder
    of the class weighs its count ("count", the FedProto paper's) or 1 ("uniform", the authors' code)."""
    holders = [u[j] for u in uploads if j in u]
    weights = [float(c.count) if weighting == "count" else 1.0 for c in holders]
    total = sum(weights)
    return [sum(w * float(c.rep[d]) for w, c in zip(weights, holders)) / total for d in range(holders[0].rep.numel())]


@pytest.mark.parametrize("weighting", ["count", "uniform"])
@pytest.mark.parametrize("algorithm", ["fedproto", "fedproto-avg"])
def test_the_server_averages_the_clients_prototypes_as_proto_weighting_says(monkeypatch, algorithm, weighting) -> None:
    """A real run's uploads, recorded where the server folds them, against the formula recomputed by hand:
    equal to the last float32 bit, and different from the other formula where the counts differ."""
    made = []

    class Recording(KnowledgeAccumulator):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.uploads: list[dict] = []
            made.append(self)

        def add(self, k) -> None:
            self.uploads.append({j: ClassKnowledge(c.class_id, c.count, c.rep.clone(), c.soft) for j, c in k.items()})
            super().add(k)

    monkeypatch.setattr(strategies_base, "KnowledgeAccumulator", Recording)
    cfg = load_config(
        None,
        {
            "algorithm": algorithm,
            "params": {"proto_weighting": weighting},
            "num_clients": 3,
            "rounds": 1,
            "local_epochs": 1,
            "partition": "dirichlet",
            "alpha": 0.3,
            "checkpoint": False,
        },
    )
    simulate(cfg)
    acc = next(a for a in made if a.uploads)
    assert len(acc.uploads) == 3
    got = acc.result()
    other = "uniform" if weighting == "count" else "count"
    differs = False
    for j, ck in got.items():
        want = torch.tensor(slow_prototype_mean(acc.uploads, j, weighting), dtype=torch.float32)
        assert torch.equal(ck.rep, want), f"class {j}"
        assert ck.count == sum(u[j].count for u in acc.uploads if j in u)
        differs |= not torch.equal(want, torch.tensor(slow_prototype_mean(acc.uploads, j, other), dtype=torch.float32))
    assert differs  # the two formulas give other prototypes on this run: the check tells them apart
