"""New clients (``new_clients``): held out of training, they adapt each evaluated global model and
report its accuracy on their local test splits, in process and over gRPC between real processes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from wafl.cli.launch.launcher import launch
from wafl.cli.sim.simulate import simulate
from wafl.client.trainer import Trainer
from wafl.common import metrics as M
from wafl.common.config import ConfigError, RunConfig, load_config
from wafl.common.datasets import load_dataset
from wafl.common.errors import Code, Refused
from wafl.common.heterogeneity import new_client_indices
from wafl.common.proto import federation_pb2 as pb
from wafl.server.checkpoint import load_checkpoint
from wafl.server.engine import RoundEngine

BASE = {"num_clients": 5, "new_clients": 2, "rounds": 3, "seed": 4, "protocol": "compute-and-wait", "device": "cpu"}


def _global(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoint.pt")["global_state"]


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """The client indices whose Trainer method ``name`` ran, in order."""
    calls: list[int] = []
    original = getattr(Trainer, name)

    def spy(self: Trainer, *args, **kwargs):
        calls.append(self.index)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, name, spy)
    return calls


def _test_sizes(cfg, indices) -> dict[str, int]:
    data = load_dataset(cfg.data.dataset)
    return {f"client-{i}": len(Trainer(cfg, i, dataset=data, device="cpu").test_idx) for i in indices}


def test_the_draw_is_seeded_and_leaves_training_clients() -> None:
    assert new_client_indices(100, 20, 0) == new_client_indices(100, 20, 0)
    assert len(new_client_indices(100, 20, 0)) == 20
    assert new_client_indices(100, 20, 0) != new_client_indices(100, 20, 1)
    assert new_client_indices(10, 0, 3) == frozenset()
    assert all(0 <= i < 7 for i in new_client_indices(7, 6, 2))


def test_in_process_new_clients_never_train_and_adapt_each_evaluated_model(tmp_path, monkeypatch) -> None:
    torch.set_num_threads(1)
    cfg = load_config(None, BASE)
    new = sorted(new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed))
    trained, adapted = _spy(monkeypatch, "train_gm"), _spy(monkeypatch, "adapt")
    rows = simulate(cfg, tmp_path / "a")
    assert trained and not set(trained) & set(new)  # the held-out clients never train
    assert sorted(adapted) == sorted(new * cfg.federation.rounds)  # once per evaluated round (eval_every = 1), each
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["clients"] == r["selected"] == 3 for r in rows)  # only the 3 training clients take part
    sizes = _test_sizes(cfg, new)
    for r in rows:
        per = r["new_client_accuracies"]
        assert set(per) == set(sizes)
        mean = sum(per[c] * sizes[c] for c in per) / sum(sizes.values())  # weighted by local test size
        assert r["new_client_accuracy"] == pytest.approx(mean, abs=1e-6)
    assert rows[-1]["new_client_accuracy"] > 0.3  # chance is 0.1
    # the adaptation never leaks into training: without it (0 epochs: the GM tested as received) the
    # same global models are built, and the new clients' accuracies differ
    rows0 = simulate(load_config(None, {**BASE, "new_client_epochs": 0}), tmp_path / "b")
    a, b = _global(tmp_path / "a"), _global(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["gm_accuracy"] for r in rows] == [r["gm_accuracy"] for r in rows0]
    assert [r["new_client_accuracies"] for r in rows] != [r["new_client_accuracies"] for r in rows0]


def test_a_personalized_method_adapts_with_its_personal_phase(monkeypatch) -> None:
    torch.set_num_threads(1)
    cfg = load_config(None, {**BASE, "algorithm": "scd", "fraction": 0.5, "eval_every": 2})
    new = sorted(new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed))
    pm = _spy(monkeypatch, "train_pm")
    trained = _spy(monkeypatch, "train_gm")
    rows = simulate(cfg)
    assert not set(trained) & set(new)
    # evaluated after rounds 2 and 3 (eval_every = 2, and the last): two personal phases per new client
    assert sorted(i for i in pm if i in new) == sorted(new * 2)
    assert all(r["selected"] == 2 for r in rows)  # fraction 0.5 of the 3 training clients
    assert [r["new_client_accuracy"] is None for r in rows] == [True, False, False]
    assert rows[-1]["new_client_accuracy"] > 0.2  # chance is 0.1


def test_over_grpc_new_clients_join_wait_and_report_as_in_process(tmp_path) -> None:
    torch.set_num_threads(1)  # the client processes train with one thread too
    cfg = load_config(None, BASE)
    local = simulate(cfg, tmp_path / "local")
    s = launch(cfg, tmp_path / "grpc", show_progress=False, timeout_s=300)
    assert s.ok, (tmp_path / "grpc" / "logs" / "server.log").read_text()[-2000:]
    new = {
        f"client-{i}"
        for i in new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed)
    }
    # the same global models and the same adapted accuracies as in process
    a, b = _global(tmp_path / "local"), _global(tmp_path / "grpc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["new_client_accuracies"] for r in s.rows] == [r["new_client_accuracies"] for r in local]
    assert all(set(r["new_client_accuracies"]) == new and r["clients"] == 3 for r in s.rows)
    assert s.rows[-1]["new_client_accuracy"] > 0.3
    reports = [json.loads(line) for line in (tmp_path / "grpc" / "reports.jsonl").read_text().splitlines()]
    finals = {r["client"] for r in reports if r.get("final") == 1.0}
    assert finals == {f"client-{i}" for i in range(cfg.federation.num_clients)}  # the new clients ended too
    assert all(r.get("bytes_up", 0) == 0 for r in reports if r["client"] in new)
    # a new client only waited and adapted: no GM training, no upload on its timeline
    timelines = json.loads((tmp_path / "grpc" / "timelines.json").read_text())
    for c in new:
        assert {e["phase"] for e in timelines[c]["events"]} == {"evaluate"}
        assert sorted(e["round"] for e in timelines[c]["events"]) == [1, 2, 3]


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"new_clients": 5}, "new_clients=5 must be less than num_clients=5"),
        ({"new_clients": -1}, "new_clients=-1"),
        ({"new_client_epochs": -1}, "new_client_epochs=-1"),
        ({"min_clients": 4}, "min_clients=4 is more than the 3 training clients"),
        ({"aggregation": "buffered", "concurrency": 4}, "concurrency=4 is more than the 3 training clients"),
    ],
)
def test_bad_new_client_settings_are_refused_naming_the_field(fields, fragment) -> None:
    from wafl.server.strategies import check_aggregation

    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        check_aggregation(load_config(None, {**BASE, **fields}))


def test_fraction_counts_the_training_clients_only() -> None:
    from wafl.server.strategies import STRATEGIES, check_aggregation

    def per_aggregation(cfg: RunConfig) -> int:
        return STRATEGIES[cfg.rule.aggregation].check_config(cfg).uploads_per_aggregation(cfg)

    cfg = load_config(None, {**BASE, "num_clients": 10, "new_clients": 6, "fraction": 0.5})
    assert cfg.federation.training_clients == 4 and per_aggregation(cfg) == 2
    assert per_aggregation(load_config(None, {**BASE, "new_clients": 0})) == 5
    buffered = load_config(None, {**BASE, "num_clients": 10, "new_clients": 6, "aggregation": "buffered"})
    assert per_aggregation(buffered) == 2  # half of the 4 that may train at once
    with pytest.raises(ConfigError, match=r"concurrency=5 is more than the 4 training clients"):
        check_aggregation(
            load_config(
                None, {**BASE, "num_clients": 10, "new_clients": 6, "aggregation": "buffered", "concurrency": 5}
            )
        )


def test_the_server_refuses_uploads_from_new_clients_and_their_reports_from_others(tmp_path) -> None:
    cfg = load_config(None, BASE)
    engine = RoundEngine(cfg, tmp_path)
    engine.executor.shutdown(wait=False)
    new = min(new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed))
    old = min(
        set(range(cfg.federation.num_clients))
        - new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed)
    )
    cred = {}
    for i in (new, old):
        req = pb.JoinRequest(client_id=f"c{i}", protocol_version=1, client_index=i, num_samples=10)
        cred[i] = engine.join(req).session_credential
    assert set(engine.strategy.clients) == {f"c{old}"}  # the new client is never one to select

    def report(i: int, metrics: dict[str, float]) -> None:
        req = pb.ReportRequest(run_id=engine.run_id, client_id=f"c{i}", round=1, metrics=metrics)
        engine.report(req, cred[i])

    for i, metric in ((old, M.NEW_CLIENT_ACCURACY), (new, M.PM_ACCURACY)):
        with pytest.raises(Refused) as e:
            report(i, {metric: 0.5})
        assert e.value.code == Code.INVALID_ARGUMENT and metric in str(e.value)
    report(new, {M.NEW_CLIENT_ACCURACY: 0.5, M.NEW_CLIENT_TEST_SAMPLES: 8.0})
    header = pb.UploadHeader(run_id=engine.run_id, round=1, client_id=f"c{new}", num_samples=1, idempotency_key="k")
    with pytest.raises(Refused) as e:
        asyncio.run(engine.uploads.open_upload(header, cred[new]))
    assert e.value.code == Code.FAILED_PRECONDITION and "new client" in str(e.value)


def test_the_flatness_loss_is_taken_on_the_training_clients_data_only() -> None:
    from wafl.cli.report.analyze import training_union
    from wafl.common.partition import run_shards

    cfg = load_config(None, BASE)
    data = load_dataset(cfg.data.dataset)
    shards = run_shards(cfg, data.train_labels)
    new = new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed)
    union = training_union(cfg, data)
    assert len(union) == sum(len(s) for i, s in enumerate(shards) if i not in new)
    assert not set(union.tolist()) & {int(x) for i in new for x in shards[i]}


def test_the_new_clients_sweep_is_scd_fmnist_with_20_of_its_100_clients_held_out(repo: Path) -> None:
    from wafl.cli.experiments.sweep import load_sweep

    sweeps = repo / "configs" / "sweeps"
    base = [c for _, c in load_sweep(sweeps / "scd_fmnist.toml")[1]]
    new = [c for _, c in load_sweep(sweeps / "scd_fmnist_new_clients.toml")[1]]
    assert {
        (
            c.federation.num_clients,
            c.federation.new_clients,
            c.federation.training_clients,
            c.federation.new_client_epochs,
        )
        for c in new
    } == {(100, 20, 80, 1)}
    assert {c.training.algorithm for c in new} == {c.training.algorithm for c in base}  # SCD and its baselines
    assert {c.federation.seed for c in new} == {0, 1} and all(c.evaluation.eval_every == 1 for c in new)
    same = ("dataset", "model", "partition", "alpha", "fraction", "rounds", "lr", "momentum", "local_epochs")
    assert {tuple(c.to_dict()[f] for f in same) for c in new} == {tuple(c.to_dict()[f] for f in same) for c in base}
