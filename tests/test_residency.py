"""A hosted client's tensors leave the training device between its trainings (``wafl worker`` on an
accelerator): the move reaches every tensor a round leaves behind, changes no result, and at most
``capacity`` idle clients stay resident. Here the training device is the CPU, so an offload to
the CPU copies every tensor to new storage (``copy=True``): a run that offloads and onloads every
client around each of its calls must build bit for bit the models of a run that never does."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from wafl.cli.sim.simulate import simulate
from wafl.client.compute import SharedSlots
from wafl.client.residency import Residency, relocate
from wafl.client.trainer import Trainer
from wafl.common.algorithms import registry
from wafl.common.config import load_config
from wafl.common.datasets import FederatedDataset

HAS_CUDA = torch.cuda.is_available()


def tensors(root: object) -> list[tuple[str, torch.Tensor]]:
    """The tensors reachable from ``root`` (a trainer: its attributes) through any object's attributes,
    containers and closures, with their paths (independent of :func:`relocate`'s own traversal; the
    dataset is shared)."""
    seen: set[int] = set()
    found: list[tuple[str, torch.Tensor]] = []

    def walk(o: object, path: str) -> None:
        if id(o) in seen or isinstance(o, FederatedDataset | Trainer | type | types.ModuleType | np.ndarray):
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append((path, o))
            if isinstance(o, torch.nn.Parameter) and o.grad is not None:
                found.append((path + ".grad", o.grad))
            return
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{path}[{'<param>' if isinstance(k, torch.Tensor) else k!r}]")
        elif isinstance(o, list | tuple | set | frozenset):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")
        elif isinstance(o, types.FunctionType):
            for name, cell in zip(o.__code__.co_freevars, o.__closure__ or ()):
                try:
                    walk(cell.cell_contents, f"{path}.<{name}>")
                except ValueError:
                    pass
        elif isinstance(o, types.MethodType):
            walk(o.__self__, f"{path}.__self__")
        elif hasattr(o, "__dict__"):
            for k, v in vars(o).items():
                walk(v, f"{path}.{k}")

    walk(vars(root) if isinstance(root, Trainer) else root, "trainer")
    return found


class Recording(Residency):
    """A residency that remembers every client it saw."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.clients: dict[int, Trainer] = {}

    def enter(self, client: Trainer) -> None:  # type: ignore[override]
        self.clients[client.index] = client
        super().enter(client)


def _cfg(algorithm: str, **extra: object):
    return load_config(
        None,
        {
            "algorithm": algorithm,
            "num_clients": 3,
            "rounds": 2,
            "protocol": "compute-and-wait",
            "local_epochs": 1,
            "pm_epochs": 1,
            "seed": 3,
            **extra,
        },
    )


ALGORITHMS = [*registry.names()[0], *(f"feddyn+{r}" for r in registry.names()[1])]  # and each regularizer


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_offloading_every_client_around_each_call_changes_no_result_and_reaches_every_tensor(algorithm: str) -> None:
    cfg = _cfg(algorithm)
    plain = simulate(cfg)
    made: list[Recording] = []

    def pool() -> SharedSlots:
        made.append(Recording(1))
        return SharedSlots(1, made[0])

    hosted = simulate(cfg, pool=pool)
    drop = {"run_id", "wall_s", "round_s"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in hosted] == [
        {k: v for k, v in r.items() if k not in drop} for r in plain
    ]
    residency = made[0]
    assert residency.resident_max == 1  # one slot, compute-and-wait: one client at a time
    assert residency.offloads >= 2 * cfg.federation.num_clients and residency.onloads > residency.offloads
    assert sorted(residency.clients) == list(range(cfg.federation.num_clients))
    for trainer in residency.clients.values():
        trainer.onload()
        before = [t.detach() for _, t in tensors(trainer)]  # views keep the old memory: no new tensor can take it
        old = {t.untyped_storage().data_ptr() for t in before}
        trainer.offload("cpu")  # the training device is the CPU: every tensor is copied
        missed = [path for path, t in tensors(trainer) if t.numel() and t.untyped_storage().data_ptr() in old]
        assert missed == [], f"{algorithm}: offload missed these tensors"
        assert before
        away = [t.detach() for _, t in tensors(trainer)]
        old = {t.untyped_storage().data_ptr() for t in away}
        trainer.onload()  # everything offload moved comes back (copied again): model gradients too
        missed = [path for path, t in tensors(trainer) if t.numel() and t.untyped_storage().data_ptr() in old]
        assert missed == [], f"{algorithm}: onload left these tensors on the host"


def test_offload_moves_only_tensors_on_the_training_device_and_onload_returns_exactly_those() -> None:
    cfg = _cfg("scd")
    t = Trainer(cfg, 0, device="cpu")
    t.begin_round(1, dict(t.algorithm.payload(t.gm)))
    t.train_gm()
    t.train_pm(None, 0.2)
    params = {id(p) for p in [*t.gm.parameters(), *t.pm.parameters()]}
    before = {k: v.clone() for k, v in t.pm.state_dict().items()}
    momentum = [s["momentum_buffer"] for s in t.pm_optimizer.state.values()]
    t.device = torch.device("meta")  # pretend the CPU is the host of a meta device: nothing is on "meta"
    t.offload("cpu")
    assert t.label_counts.device.type == "cpu" and all(
        m is s["momentum_buffer"] for m, s in zip(momentum, t.pm_optimizer.state.values())
    )
    t.device = torch.device("cpu")
    t.offload("cpu")  # now everything is on the training device: new storage for every tensor
    new_momentum = [s["momentum_buffer"] for s in t.pm_optimizer.state.values()]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(momentum, new_momentum))
    assert {id(p) for p in [*t.gm.parameters(), *t.pm.parameters()]} == params  # the same parameter objects
    assert set(t.pm_optimizer.state) <= {p for p in t.pm.parameters()}
    t.onload()
    assert all(torch.equal(before[k], v) for k, v in t.pm.state_dict().items())
    assert t._offloaded is None
    t.train_pm(None, 0.2)  # the optimizer still drives the PM's parameters
    assert any(not torch.equal(before[k], v) for k, v in t.pm.state_dict().items())


def test_relocate_keeps_one_tensor_one_and_rebuilds_tuples() -> None:
    shared = torch.ones(3)
    original = shared
    lin = torch.nn.Linear(2, 2)
    param = lin.weight

    def closure() -> torch.Tensor:
        return shared

    root = {"a": shared, "b": [shared, (shared, 1)], "m": lin, "p": [param], "f": closure}
    moved = relocate(root, lambda t: t.clone())
    assert root["a"] is root["b"][0] is root["b"][1][0] is closure() and root["a"] is not original
    assert root["p"][0] is lin.weight is param  # parameters stay themselves, their data moves
    assert [id(t) for t in moved] == [id(root["a"])]  # the one free tensor (the module's go their own way)
    lin.weight.grad = torch.ones(2, 2)
    grad, ptrs = lin.weight.grad, [lin.weight.grad.data_ptr(), lin.weight.data_ptr(), lin.bias.data_ptr()]
    moved = relocate({"m": lin}, lambda t: t, lambda t: t.clone())  # module tensors only: gradients too
    assert moved == [] and lin.weight is param and lin.weight.grad is grad and torch.equal(grad, torch.ones(2, 2))
    new = [lin.weight.grad.data_ptr(), lin.weight.data_ptr(), lin.bias.data_ptr()]
    assert all(a != b for a, b in zip(ptrs, new))  # each copied (a copy is made while its original lives)


class Fake:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def offload(self, home: torch.device) -> None:
        self.log.append(f"off {self.name}")

    def onload(self) -> None:
        self.log.append(f"on {self.name}")


def test_residency_evicts_the_least_recently_used_idle_client_and_never_one_in_use() -> None:
    log: list[str] = []
    a, b, c = Fake("a", log), Fake("b", log), Fake("c", log)
    r = Residency(2)
    for x in (a, b):
        r.enter(x)
        r.leave(x)
    r.enter(a)
    r.leave(a)  # a used last: b is the least recently used
    r.enter(c)
    assert log == ["on a", "on b", "off b", "on c"]
    r.enter(a)  # resident already: nothing moves
    r.enter(b)  # a and c in use: nothing to evict, three resident for now
    assert log[-1] == "on b" and r.resident_max == 3
    for x in (c, a, b):
        r.leave(x)
    r.enter(Fake("d", log))
    assert log[-3:] == ["off c", "off a", "on d"]  # least recently used first, down to the capacity
    assert r.offloads == 3 and r.onloads == 5 and len(r.resident) == 2
    with pytest.raises(ValueError, match="capacity=0"):
        Residency(0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_an_offloaded_client_frees_its_device_memory_and_trains_on_after_onload() -> None:
    cfg = _cfg("ditto", device="cuda")
    t = Trainer(cfg, 0, device="cuda")
    t.begin_round(1, {k: v.cpu() for k, v in t.algorithm.payload(t.gm).items()})
    t.train_gm()
    t.train_pm(None, 0.2)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    t.offload("cpu")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < resident
    assert [path for path, x in tensors(t) if x.device.type == "cuda"] == []
    t.onload()
    params = [*t.gm.parameters(), *t.pm.parameters()]
    assert all(p.device.type == "cuda" and (p.grad is None or p.grad.device.type == "cuda") for p in params)
    assert all(s["momentum_buffer"].device.type == "cuda" for s in t.pm_optimizer.state.values())
    t.train_pm(None, 0.2)
    t.gm_upload_state()


def test_wait_free_clients_sharing_one_slot_and_one_resident_place_finish_and_learn() -> None:
    """The wait-free PM holds its client resident while it waits for its slot back, so another client's
    GM makes two resident for a while. (Its global models are not compared with a plain run's: the PM
    draws from the client's batch order for as many steps as time allows, so a wait-free GM depends on
    timing.) Every round closes with every client's PM evaluated, and the global model learns."""
    cfg = _cfg("ditto", protocol="wait-free", rounds=4)
    made: list[Recording] = []

    def pool() -> SharedSlots:
        made.append(Recording(1))
        return SharedSlots(1, made[0])

    rows = simulate(cfg, pool=pool)
    assert [r["round"] for r in rows] == list(range(1, cfg.federation.rounds + 1))
    assert [r["pm_reports"] for r in rows] == [cfg.federation.num_clients] * cfg.federation.rounds
    assert rows[-1]["gm_accuracy"] > 0.3  # ten classes: chance is 0.1
    assert made[0].offloads > 0 and 1 <= made[0].resident_max <= cfg.federation.num_clients
