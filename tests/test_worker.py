"""Workers that host many clients: the shared training slots, the index ranges, and a federation
of six clients in two worker processes over localhost sockets."""

import asyncio
import json
import math
import threading

import numpy as np
import pytest
from wafl.cli.launch.hosts import Hosts
from wafl.cli.launch.launcher import launch, split_clients
from wafl.cli.main import main
from wafl.client.compute import FILL, URGENT, SharedSlots
from wafl.client.trainer import STATE_MAGIC, Trainer
from wafl.client.worker import format_indices, parse_indices
from wafl.common.config import ConfigError, load_config
from wafl.common.verified import load_verified


def test_indices_round_trip_and_refusals() -> None:
    assert parse_indices("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert format_indices([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    for bad in ("3-1", "a", "0-2,2", "-1", ""):
        with pytest.raises(ConfigError):
            parse_indices(bad)
    assert split_clients(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert sorted(i for part in split_clients(1000, 7) for i in part) == list(range(1000))


def test_workers_get_clients_of_nearly_equal_total_samples() -> None:
    sizes = [92, 164, 103, 125, 141, 158, 249, 174, 122, 110]  # the default run's shards (digits, seed 0)
    groups = split_clients(10, 2, sizes)
    assert groups == [[0, 3, 5, 6, 9], [1, 2, 4, 7, 8]]  # 734 and 704 samples; contiguous halves: 625 and 813
    assert split_clients(4, 2, [5, 5, 5, 5]) == [[0, 2], [1, 3]]  # equal loads: the smaller group, then the lower
    rng = np.random.default_rng(0)
    for n, w in ((1000, 7), (13, 13), (5, 3)):
        s = rng.integers(1, 500, n).tolist()
        parts = split_clients(n, w, s)
        assert sorted(i for p in parts for i in p) == list(range(n)) and all(p == sorted(p) and p for p in parts)
        loads = [sum(s[i] for i in p) for p in parts]
        assert max(loads) - min(loads) <= max(s)  # greedy largest-first: within one client of balanced
    with pytest.raises(ValueError, match="3 sizes for 4 clients"):
        split_clients(4, 2, [1, 2, 3])


def test_run_refuses_bad_worker_counts(capsys) -> None:
    assert main(["run", "--clients", "4", "--workers", "5", "--rounds", "1"]) == 2
    assert "--workers=5 must lie in 1..4" in capsys.readouterr().err
    assert main(["run", "--clients", "4", "--workers", "many", "--rounds", "1"]) == 2
    assert main(["run", "--clients", "4", "--slots", "2", "--workers", "0", "--rounds", "1"]) == 2  # no workers
    assert "--slots=2 needs --workers" in capsys.readouterr().err


def test_run_hosts_the_clients_in_workers_by_default() -> None:
    from wafl.cli.commands.preflight import workers as _workers
    from wafl.cli.launch.launcher import default_workers

    assert _workers(None, load_config(None, {"num_clients": 10}), False) == default_workers(10)
    assert _workers(None, load_config(None, {"num_clients": 1}), False) == 1  # never more workers than clients
    assert _workers(None, load_config(None, {"num_clients": 100}), True) is None  # per-client links or CPU shares
    assert _workers("off", load_config(None, {"num_clients": 100}), False) is None
    assert _workers("0", load_config(None, {"num_clients": 100}), False) is None  # one process per client
    assert _workers("3", load_config(None, {"num_clients": 100}), False) == 3
    assert default_workers(100, cores=16) == 16 and default_workers(4, cores=16) == 4


async def _blocking(slots: SharedSlots, cls: int, gate: threading.Event, log: list[str], name: str) -> None:
    await slots.acquire(cls)
    log.append(name)
    try:
        await asyncio.to_thread(gate.wait, 10)
    finally:
        slots.release()


async def test_slots_bound_the_trainings_at_once() -> None:
    slots = SharedSlots(2)
    lock = threading.Lock()
    now, most = [0], [0]

    def work() -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        threading.Event().wait(0.02)
        with lock:
            now[0] -= 1

    await asyncio.gather(*(slots.run(work) for _ in range(12)))
    assert most[0] == 2 and slots.busy_max == 2 and slots.free == 2
    slots.shutdown()


async def test_federation_work_gets_a_free_slot_before_fill_work() -> None:
    slots = SharedSlots(1)
    gate, order = threading.Event(), []
    holder = asyncio.create_task(_blocking(slots, URGENT, gate, order, "holder"))
    await asyncio.sleep(0.05)
    fill = asyncio.create_task(_blocking(slots, FILL, threading.Event(), order, "fill"))
    await asyncio.sleep(0.01)
    urgent = asyncio.create_task(_blocking(slots, URGENT, threading.Event(), order, "urgent"))
    await asyncio.sleep(0.05)
    assert order == ["holder"] and slots.urgent_waiting == 1
    gate.set()
    await holder
    await asyncio.sleep(0.05)
    assert order == ["holder", "urgent"]  # queued after the fill work, served before it
    for t in (fill, urgent):
        t.cancel()
    await asyncio.gather(fill, urgent, return_exceptions=True)
    assert slots.free == 1 and not slots.waiters
    slots.shutdown()


async def test_fill_work_gives_its_slot_up_to_federation_work_and_continues() -> None:
    slots = SharedSlots(1)
    steps, during = [0], []
    stop = threading.Event()
    wake = asyncio.Event()

    def train(should_stop) -> int:  # a PM: one step per check, until its client's broadcast
        while not should_stop():
            steps[0] += 1
            threading.Event().wait(0.005)
        return steps[0]

    pm = asyncio.create_task(slots.fill(train, stop.is_set, wake))
    await asyncio.sleep(0.1)
    assert steps[0] > 0
    # federation work arrives: the PM pauses between two steps, the GM runs, then the PM continues
    await slots.run(lambda: during.append(steps[0]) or threading.Event().wait(0.05) or during.append(steps[0]))
    assert during[0] == during[1]  # no PM step while the GM held the only slot
    await asyncio.sleep(0.1)
    assert steps[0] > during[1] and not pm.done()
    stop.set()
    wake.set()
    await asyncio.wait_for(pm, 5)
    assert slots.free == 1
    slots.shutdown()


async def test_paused_fill_work_ends_at_its_broadcast_without_a_slot() -> None:
    slots = SharedSlots(1)
    stop, gate = threading.Event(), threading.Event()
    wake = asyncio.Event()
    pm = asyncio.create_task(slots.fill(lambda should_stop: [None for _ in iter(should_stop, True)], stop.is_set, wake))
    await asyncio.sleep(0.05)
    gm = asyncio.create_task(_blocking(slots, URGENT, gate, [], "gm"))  # holds the slot until gate
    await asyncio.sleep(0.1)
    assert not pm.done() and slots.free == 0
    stop.set()
    wake.set()  # the broadcast: the paused PM ends although the GM still holds the slot
    await asyncio.wait_for(pm, 5)
    assert not gm.done()
    gate.set()
    await gm
    assert slots.free == 1 and not slots.waiters
    slots.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)  # three processes starting PyTorch: minutes on a loaded 2-core machine
def test_six_clients_in_two_workers_over_sockets(tmp_path) -> None:
    """Every client uploads every round, the GM learns, and each client's PM and its optimizer
    state carry over from round to round (Adam's step count is the sum of both rounds' PM steps)."""
    cfg = load_config(
        None,
        {
            "num_clients": 6,
            "rounds": 2,
            "algorithm": "ditto",
            "protocol": "wait-free",
            "optimizer": "adam",
            "lr": 0.003,
            "local_epochs": 2,
            "pm_max_epochs": 1.0,  # with pm_min_steps above one epoch: exactly one PM epoch per round
            "pm_min_steps": 1000,
        },
    )
    out = tmp_path / "run"
    s = launch(cfg, out, hosts=Hosts(workers=2), show_progress=False, timeout_s=300, slots=1)
    assert s.ok, (out / "logs" / "server.log").read_text()[-2000:]
    assert s.client_codes == [0, 0]
    assert sorted(p.name for p in (out / "logs").glob("worker-*.jsonl")) == ["worker-0.jsonl", "worker-1.jsonl"]
    events = [json.loads(line) for line in (out / "logs" / "server.jsonl").read_text().splitlines()]
    uploads = {(e["client"], e["round"]) for e in events if e["event"] == "upload.accepted"}
    assert uploads == {(f"client-{i}", r) for i in range(6) for r in (1, 2)}
    assert [r["clients"] for r in s.rows] == [6, 6]
    assert s.rows[-1]["gm_accuracy"] > 0.3  # chance is 0.1
    assert all(r["pm_accuracy"] is not None for r in s.rows)
    for w in (0, 1):
        lines = [json.loads(x) for x in (out / "logs" / f"worker-{w}.jsonl").read_text().splitlines()]
        done = next(x for x in lines if x["event"] == "worker.done")
        assert done["clients"] == 3 and done["failed"] == 0 and done["slots_held_max"] == 1
    for i in range(6):
        saved = load_verified(out / "clients" / f"client-{i}.pt", STATE_MAGIC, "client state")
        assert saved["pm_initialized"] and saved["pm"] is not None
        per_epoch = math.ceil(Trainer(cfg, i, device="cpu").num_samples / cfg.training.batch_size)
        steps = {int(v["step"]) for v in saved["pm_optimizer"]["state"].values()}
        assert steps == {2 * per_epoch}, (i, steps, per_epoch)
