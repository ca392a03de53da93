"""Which hosted clients keep their models on the training device.

A worker hosts many clients but trains only ``slots`` of them at once. On an accelerator, the
others' models would each hold device memory for nothing, so a :class:`Residency` keeps the
tensors of at most ``capacity`` clients on the device (the ones that trained last, and any
client whose training is in progress, e.g. a wait-free PM that gave its slot up and waits for
another) and moves an idle client's tensors to host memory when another client needs the room.

What moves is everything of the client's that holds tensors (:func:`relocate`): its GM and PM,
the PM's optimizer state, the algorithm's client state, the round's context (the received
model, extra tensors and knowledge, the frozen teacher) and the algorithm's own per-client
objects (loss terms, step rules). Offloading remembers which tensors it moved, so onloading
returns exactly those to the device and leaves tensors that always live on the host (such as
an optimizer's step counter) where they are. Parameters keep their identity (their ``data``
moves), so optimizers and anything else that refers to them stay valid; one tensor referred to
from several places moves once and stays one tensor.

Where the training device is the host (``cpu``), nothing moves: :class:`Residency` is only
created for a worker on an accelerator.
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

Move = Callable[[torch.Tensor], torch.Tensor]


def _never(obj: Any) -> bool:
    return False


def relocate(
    root: Any, move: Move, move_module: Move | None = None, skip: Callable[[Any], bool] = _never
) -> list[torch.Tensor]:
    """Moves every tensor reachable from ``root``, in place; returns the moved tensors that belong to no module.

    ``move`` decides per tensor and returns it unchanged to leave it where it is. The tensors of a
    module (its parameters' data, their gradients, its buffers) and any parameter's data go through
    ``move_module`` (default: ``move``); a parameter object stays itself, so the optimizers and
    modules that refer to it stay valid. Tensors are reached through dicts, lists, tuples
    (rebuilt), function closures, modules, optimizers (their state) and the attributes of wafl's own
    objects; one tensor referred to twice moves once and stays one tensor. ``skip(obj)`` prunes
    objects that are shared with others (the dataset) or are not the client's.
    """
    move_module = move_module or move
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(original) -> (original, kept alive; moved)
    seen: set[int] = set()
    moved: list[torch.Tensor] = []

    def tensor(t: torch.Tensor, mover: Move) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)][1]
        out: torch.Tensor
        if isinstance(t, nn.Parameter):
            t.data = move_module(t.data)
            out = t
        else:
            out = mover(t)
            if mover is move and out is not t:
                moved.append(out)
        memo[id(t)] = (t, out)
        return out

    def module_tensor(t: torch.Tensor) -> torch.Tensor:
        # Module._apply sets a parameter's (and a gradient's) data to what this returns, and stores buffers
        return tensor(t, move_module).data if isinstance(t, nn.Parameter) else tensor(t, move_module)

    def walk(o: Any) -> Any:
        """``o`` with its contents moved in place, or a tensor's (or tuple's) replacement."""
        if isinstance(o, torch.Tensor):
            return tensor(o, move)
        if o is None or isinstance(o, str | bytes | int | float | bool | torch.device | torch.dtype) or skip(o):
            return o
        if id(o) in seen:
            return o
        seen.add(id(o))
        if isinstance(o, nn.Module):
            o._apply(module_tensor)
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                walk(state)
        elif isinstance(o, dict):
            for k, v in o.items():
                new = walk(v)
                if new is not v:
                    o[k] = new
        elif isinstance(o, list):
            for i, v in enumerate(o):
                new = walk(v)
                if new is not v:
                    o[i] = new
        elif isinstance(o, tuple):
            items = [walk(v) for v in o]
            if any(a is not b for a, b in zip(items, o)):
                return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
        elif isinstance(o, types.FunctionType):
            for cell in o.__closure__ or ():
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                new = walk(v)
                if new is not v:
                    cell.cell_contents = new
        elif type(o).__module__.startswith("wafl.") and hasattr(o, "__dict__"):
            walk(vars(o))
        return o

    walk(root)
    return moved


class Resident(Protocol):
    """What :class:`Residency` moves: a client's trainer (:class:`~wafl.client.trainer.Trainer`)."""

    def offload(self, home: torch.device) -> None: ...

    def onload(self) -> None: ...


class Residency:
    """At most ``capacity`` idle clients' tensors on the device; a client in use is never moved.

    :meth:`enter` (before a training call, in the calling thread) brings the client's tensors to
    the device, first moving the least recently used idle residents to ``home`` while more than
    ``capacity`` would be resident; :meth:`leave` marks the call done. Thread-safe.
    """

    def __init__(self, capacity: int, home: torch.device | str = "cpu") -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be at least 1")
        self.capacity = capacity
        self.home = torch.device(home)
        self.lock = threading.Lock()
        self.resident: OrderedDict[int, Resident] = OrderedDict()  # least recently used first
        self.in_use: dict[int, int] = {}
        self.offloads = 0
        self.onloads = 0
        self.resident_max = 0

    def enter(self, client: Resident) -> None:
        with self.lock:
            key = id(client)
            self.in_use[key] = self.in_use.get(key, 0) + 1
            if key in self.resident:
                self.resident.move_to_end(key)
                return
            for other_key in [k for k in self.resident if not self.in_use.get(k)]:
                if len(self.resident) < self.capacity:
                    break
                self.resident.pop(other_key).offload(self.home)
                self.offloads += 1
            client.onload()
            self.onloads += 1
            self.resident[key] = client
            self.resident_max = max(self.resident_max, len(self.resident))

    def leave(self, client: Resident) -> None:
        with self.lock:
            key = id(client)
            self.in_use[key] -= 1
            if not self.in_use[key]:
                del self.in_use[key]

    def bound(self, client: Resident, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run with ``client`` resident."""

        def call(*args: Any) -> Any:
            self.enter(client)
            try:
                return fn(*args)
            finally:
                self.leave(client)

        return call
