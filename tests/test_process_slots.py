"""Training slots in processes (client/process_slots.py): a simulation whose clients train in forked
processes builds exactly the models of one whose clients train in threads; a failure in a training
process reaches the simulation as an error that names the client and the call; nothing is left
running afterwards."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from wafl.cli.sim.simulate import simulate
from wafl.client.compute import SharedSlots
from wafl.client.process_slots import ProcessSlots
from wafl.client.trainer import Trainer
from wafl.common.balance import balanced_groups
from wafl.common.config import RunConfig, load_config
from wafl.common.errors import InvariantError

TIMING = {"wall_s", "round_s"}


def _cfg(algorithm: str, **over: Any) -> RunConfig:
    settings = {"num_clients": 5, "rounds": 3, "protocol": "compute-and-wait", "checkpoint": False}
    return load_config(None, {**settings, "algorithm": algorithm, **over})


def _children() -> list[int]:
    """This process's live children (from /proc)."""
    me, found = os.getpid(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == me and fields[0] != "Z":
                found.append(int(d.name))
    return found


@pytest.mark.parametrize("algorithm", ["fedavg", "fedhkd", "scd"])
def test_processes_build_the_models_threads_build(algorithm: str, tmp_path: Path) -> None:
    before = set(_children())
    cfg = _cfg(algorithm)
    threads = simulate(cfg, tmp_path / "threads", pool=lambda: SharedSlots(2))
    processes = simulate(cfg, tmp_path / "processes", slot_processes=2)
    strip = [{k: v for k, v in r.items() if k not in TIMING and k != "run_id"} for r in (*threads, *processes)]
    assert strip[: len(threads)] == strip[len(threads) :]
    assert processes[-1]["gm_accuracy"] > 0.3  # chance: 0.1
    assert processes[-1]["clients"] == 5
    ckpt = [(tmp_path / d / "checkpoint.pt").exists() for d in ("threads", "processes")]
    assert ckpt == [False, False]
    assert set(_children()) <= before  # the training processes were reaped


def test_a_broadcast_crosses_once_per_process_and_round(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every client of a round receives one model and one knowledge object (SharedReception): each
    process gets them with the first of its clients' begin_round calls, the others refer to them."""
    from wafl.client import process_slots

    sent: list[tuple[Any, Any]] = []
    real = process_slots._message

    def message(obj: Any) -> Any:
        if len(obj) == 4 and obj[2] == "begin_round":
            sent.append((obj[3][1], obj[3][2]))
        return real(obj)

    monkeypatch.setattr(process_slots, "_message", message)
    cfg = _cfg("fedhkd", num_clients=6)
    rows = simulate(cfg, tmp_path, slot_processes=2)
    assert rows[-1]["gm_accuracy"] > 0.3
    assert len(sent) == 6 * 3  # every client is selected in each of the 3 rounds
    models = [m for m, _ in sent if not process_slots._is_same(m)]
    knowledge = [k for _, k in sent if not process_slots._is_same(k)]
    assert len(models) == 2 * 3  # once per process and round
    assert len(knowledge) == 2 * 3 and all(isinstance(k, dict) for k in knowledge)
    assert any(knowledge)  # from round 2 on, the global knowledge of the round before


def test_an_error_in_a_training_process_names_the_client_and_the_call(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    orig = Trainer.train_gm

    def train_gm(self: Trainer, *a: Any, **k: Any) -> Any:
        if self.index == 3:
            raise ValueError("no data today")
        return orig(self, *a, **k)

    monkeypatch.setattr(Trainer, "train_gm", train_gm)  # before the fork: the processes inherit it
    with pytest.raises(ValueError, match="no data today") as e:
        simulate(_cfg("fedavg"), slot_processes=2)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "in client 3's gm_round, training process pid" in notes  # the GM phase's one call
    assert "in the simulation's client client-3" in notes
    # the other process, whose reply finds the pipe closed, ends quietly: the error above is the one told
    assert "Traceback" not in capfd.readouterr().err


def test_a_training_process_that_dies_fails_the_run_with_its_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(_children())

    def train_gm(self: Trainer, *a: Any, **k: Any) -> Any:
        os._exit(7)

    monkeypatch.setattr(Trainer, "train_gm", train_gm)
    with pytest.raises(RuntimeError, match=r"training process \d \(pid \d+\) exited with code 7"):
        simulate(_cfg("fedavg"), slot_processes=2)
    assert set(_children()) <= before


def test_what_process_slots_refuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="slot_processes=2 needs protocol='compute-and-wait' \\(not 'wait-free'\\)"):
        simulate(_cfg("scd", protocol="wait-free"), slot_processes=2)

    async def misuse() -> None:
        cfg = _cfg("fedavg")
        trainers = [Trainer(cfg, i, device="cpu") for i in range(5)]
        slots = ProcessSlots(2, trainers)
        try:
            # each process a share of nearly equal samples: the largest client alone against the rest, or so
            homes = [[t.num_samples for t in trainers if slots.home[id(t)] == k] for k in range(2)]
            sizes = [t.num_samples for t in trainers]
            assert sorted(map(sorted, homes)) == sorted(sorted(sizes[i] for i in g) for g in balanced_groups(sizes, 2))
            assert abs(sum(homes[0]) - sum(homes[1])) <= max(sizes)
            with pytest.raises(TypeError, match="methods of their clients' trainers"):
                await slots.run(len, [])
            with pytest.raises(TypeError, match="not client 0's gm or pm"):
                await slots.run(trainers[0].evaluate_local, trainers[1].gm)
            with pytest.raises(InvariantError, match="compute-and-wait only"):
                await slots.fill(lambda stop: None, lambda: True)
            acc, n = await slots.run(trainers[1].evaluate_local, trainers[1].gm)  # the client's own model: fine
            assert 0.0 <= acc <= 1.0 and n > 0
        finally:
            slots.shutdown()

    with pytest.raises(ValueError, match="slots=0 must be at least 1"):
        ProcessSlots(0, [])
    with pytest.raises(ValueError, match="groups=0 must be at least 1"):
        balanced_groups([3, 1], 0)
    assert balanced_groups([5, 1, 1, 3], 2) == [[0], [1, 2, 3]]
    asyncio.run(misuse())


def test_a_sweep_with_slot_processes_records_what_one_without_them_records(tmp_path: Path) -> None:
    """``wafl sweep --slot-processes 2``: the compute-and-wait point trains in two processes, the wait-free
    one in threads, and every results line is the one a sweep without the option writes."""
    import json
    import subprocess
    import sys

    spec = tmp_path / "s.toml"
    spec.write_text(
        '[base]\nnum_clients = 4\nrounds = 2\nalgorithm = "scd"\ncheckpoint = false\npm_min_steps = 100000\n'
        'pm_max_epochs = 1\n[grid]\nprotocol = ["compute-and-wait", "wait-free"]\n'
    )
    rows = {}
    for mode, extra in (("threads", []), ("processes", ["--slot-processes", "2"])):
        cmd = [sys.executable, "-m", "wafl.cli.main", "sweep", str(spec), "--out", str(tmp_path / mode), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        rows[mode] = {
            d.name: [
                {k: v for k, v in json.loads(x).items() if k not in TIMING and k != "run_id"}
                for x in (d / "results.jsonl").read_text().splitlines()
            ]
            for d in (tmp_path / mode).iterdir()
            if d.is_dir()
        }
    assert sorted(rows["threads"]) == ["protocol=compute-and-wait", "protocol=wait-free"]
    assert rows["threads"] == rows["processes"]
    started = {
        d.name: "slot_processes.started" in (d / "logs" / "run.jsonl").read_text()
        for d in (tmp_path / "processes").iterdir()
    }
    assert started == {"protocol=compute-and-wait": True, "protocol=wait-free": False}
    bad = subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", "sweep", str(spec), "--slot-processes", "-1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "--slot-processes=-1 must be >= 0" in bad.stderr, bad.stderr
