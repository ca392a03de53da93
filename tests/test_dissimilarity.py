"""Gradient dissimilarity G_d (wafl.common.analysis.dissimilarity) and the grad_dissimilarity_every option."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from wafl.cli.main import main
from wafl.cli.sim.simulate import dissimilarity_probe, simulate
from wafl.common.algorithms import registry
from wafl.common.analysis.dissimilarity import full_gradient, gradient_dissimilarity
from wafl.common.config import ConfigError, load_config
from wafl.common.datasets import load_dataset
from wafl.common.models import build_model
from wafl.server.selection import select_clients
from wafl.server.strategies import check_aggregation


def slow_dissimilarity(grads: list[list[float]]) -> float:
    k, n = len(grads), len(grads[0])
    num = sum(sum(g[i] ** 2 for i in range(n)) for g in grads) / k
    mean = [sum(g[i] for g in grads) / k for i in range(n)]
    return num / sum(m**2 for m in mean)


def test_the_ratio_against_a_slow_recomputation() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, generator=gen) + 0.3 for _ in range(5)]
    got = gradient_dissimilarity(grads)
    assert got["grad_dissimilarity"] == pytest.approx(slow_dissimilarity([g.tolist() for g in grads]), rel=1e-9)
    assert got["grad_dissimilarity"] > 1  # Jensen
    assert got["grad_sq_norm_mean"] / got["mean_grad_sq_norm"] == pytest.approx(got["grad_dissimilarity"])
    same = gradient_dissimilarity([grads[0]] * 4)
    assert same["grad_dissimilarity"] == pytest.approx(1.0, abs=1e-12)
    assert gradient_dissimilarity([torch.zeros(3)])["grad_dissimilarity"] == 1.0
    assert gradient_dissimilarity([torch.ones(2), -torch.ones(2)])["grad_dissimilarity"] == float("inf")
    with pytest.raises(ValueError):
        gradient_dissimilarity([])


def test_full_gradient_is_the_mean_of_per_sample_gradients() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    data = TensorDataset(torch.randn(10, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 2, 1, 0, 0, 1, 2, 2]))
    idx = np.array([0, 2, 3, 5, 8, 9])
    got = full_gradient(model, data, idx, batch_size=4)  # batches of 4 and 2, weighted by size
    slow = torch.zeros_like(got)
    for i in idx:
        x, y = data[int(i)]
        g = torch.autograd.grad(F.cross_entropy(model(x[None]), y[None]), list(model.parameters()))
        slow += torch.cat([t.reshape(-1) for t in g]) / len(idx)
    assert torch.allclose(got, slow, atol=1e-12)


def tiny_cfg(**over: object):
    base = {"num_clients": 5, "rounds": 1, "local_epochs": 1, "device": "cpu", "checkpoint": False}
    base.update(over)
    base.setdefault("protocol", "compute-and-wait")
    return check_aggregation(load_config(None, base))


def test_the_probe_every_n_rounds_and_identical_data_give_one() -> None:
    cfg = tiny_cfg(grad_dissimilarity_every=2)
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("cnn", data.num_classes, data.in_channels, data.image_size)
    same = np.arange(40)
    trainers = {f"client-{i}": SimpleNamespace(train_idx=same) for i in range(3)}
    probe = dissimilarity_probe(cfg, SimpleNamespace(model=model, dataset=data), trainers)
    state = model.state_dict()
    assert probe(1, state, list(trainers)) == {} and probe(3, state, list(trainers)) == {}
    assert probe(2, state, list(trainers))["grad_dissimilarity"] == pytest.approx(1.0, abs=1e-9)
    trainers["client-2"] = SimpleNamespace(train_idx=np.arange(40, 80))
    assert probe(4, state, list(trainers))["grad_dissimilarity"] > 1.0


def test_an_in_process_run_records_g_d_at_the_global_model(tmp_path: Path) -> None:
    """Round 1's G_d is that of the selected clients at the initial model, recomputed here from scratch."""
    cfg = tiny_cfg(rounds=2, fraction=0.6, grad_dissimilarity_every=1, algorithm="fedavg+asd")
    rows = simulate(cfg, tmp_path / "run")
    assert all(r["grad_dissimilarity"] >= 1.0 for r in rows)
    data = load_dataset("digits")
    torch.manual_seed(cfg.federation.seed)  # as the engine builds the first global model
    model = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict()).build(
        build_model(cfg.training.model, data.num_classes, data.in_channels, data.image_size, cfg.training.code_len)
    )
    ids = [f"client-{i}" for i in range(cfg.federation.num_clients)]
    selected = sorted(select_clients(cfg.federation.seed, 1, ids, cfg.federation.fraction), key=ids.index)
    assert len(selected) == 3
    from wafl.common.partition import run_shards

    shards = run_shards(cfg, data.train_labels)  # the run's own partition rule, as the engine's
    grads = []
    for c in selected:
        idx = shards[ids.index(c)]
        x = torch.stack([data.train[int(i)][0] for i in idx])
        y = torch.as_tensor([int(data.train[int(i)][1]) for i in idx])
        model.eval()
        g = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        grads.append(torch.cat([t.reshape(-1) for t in g]).double().tolist())
    assert rows[0]["grad_dissimilarity"] == pytest.approx(slow_dissimilarity(grads), rel=1e-4)


def test_the_option_is_validated_and_refused_over_the_network(tmp_path: Path, capsys) -> None:
    with pytest.raises(ConfigError, match="grad_dissimilarity_every"):
        tiny_cfg(grad_dissimilarity_every=-1)
    with pytest.raises(ConfigError, match="grad_dissimilarity_every=2 needs aggregation='sync'"):
        tiny_cfg(grad_dissimilarity_every=2, aggregation="buffered")
    code = main(
        ["run", "--clients", "2", "--rounds", "1", "--set", "grad_dissimilarity_every=1", "--quiet"]
        + ["--out", str(tmp_path / "net")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "grad_dissimilarity_every=1 is measured in process only" in err
    assert not (tmp_path / "net" / "results.jsonl").exists()
