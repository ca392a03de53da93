"""One path for learning: a federation run in process and the same one over localhost gRPC
(separate server and client processes) build bit-identical global models."""

import torch
from wafl.cli.launch.launcher import launch
from wafl.cli.sim.simulate import simulate
from wafl.common.config import load_config
from wafl.server.checkpoint import load_checkpoint


def _global(run_dir):
    return load_checkpoint(run_dir / "checkpoint.pt")["global_state"]


def test_in_process_and_grpc_build_identical_models(tmp_path) -> None:
    cfg = load_config(None, {"num_clients": 3, "rounds": 3, "seed": 7, "algorithm": "fedavg", "device": "cpu"})
    torch.set_num_threads(1)  # the client processes train with one thread too (launcher: --threads 1)
    rows = simulate(cfg, tmp_path / "local")
    s = launch(cfg, tmp_path / "grpc", show_progress=False, timeout_s=300)
    assert s.ok, (tmp_path / "grpc" / "logs" / "server.log").read_text()[-2000:]
    local, remote = _global(tmp_path / "local"), _global(tmp_path / "grpc")
    assert list(local) == list(remote)
    for name in local:
        assert torch.equal(local[name], remote[name]), name
    assert [r["gm_accuracy"] for r in rows] == [r["gm_accuracy"] for r in s.rows]
    assert rows[-1]["gm_accuracy"] > 0.3  # trained: chance is 0.1
    # not trivially equal: the models moved away from the initial one
    initial = simulate(load_config(None, {**cfg.to_dict(), "rounds": 1}), tmp_path / "one")
    assert initial[0]["gm_accuracy"] != rows[-1]["gm_accuracy"]


def test_in_process_clients_share_one_decoded_broadcast(tmp_path, monkeypatch) -> None:
    """Every client of a simulation receives a round's global model alike: it is held and decoded once
    (as in a worker process), and each client still loads the same values."""
    from wafl.client.trainer import Trainer

    seen: dict[int, list[tuple[int, int, bytes]]] = {}
    begin = Trainer.begin_round

    def spy(self, round, state, knowledge=None, selected=True):  # type: ignore[no-untyped-def]
        first = next(iter(state.values()))
        seen.setdefault(round, []).append((self.index, first.data_ptr(), first.numpy().tobytes()))
        return begin(self, round, state, knowledge, selected)

    monkeypatch.setattr(Trainer, "begin_round", spy)
    cfg = load_config(None, {"num_clients": 4, "rounds": 2, "seed": 1, "algorithm": "fedavg", "device": "cpu"})
    simulate(cfg, tmp_path)
    assert sorted(seen) == [1, 2]
    for round, received in seen.items():
        assert sorted(i for i, _, _ in received) == [0, 1, 2, 3]
        assert len({ptr for _, ptr, _ in received}) == 1, round  # one buffer for the four clients
        assert len({b for _, _, b in received}) == 1, round
    assert seen[1][0][2] != seen[2][0][2]  # a new model each round
