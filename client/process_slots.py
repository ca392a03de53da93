"""Training slots in processes: the clients of one federation, trained in ``slots`` forked processes.

:class:`~wafl.client.compute.SharedSlots` runs its clients' training in threads of the process
whose event loop runs their protocol (and, in a simulation, the server): Python's GIL is shared
by the event loop and every training thread. :class:`ProcessSlots` forks ``slots`` processes
once every client's :class:`~wafl.client.trainer.Trainer` is built, each the home of a share of
the clients with nearly equal training samples (:func:`~wafl.common.balance.balanced_groups`). A
client lives in its process from then on, which runs its calls one after another, in the order
they were made, as a slot does. The event loop keeps the protocol, the transport and the aggregation; a call
sends the trainer's method name and arguments to the client's process and awaits what it
returns. A process holds each of its clients' whole state (models, optimizers, random
generators), and each client's calls reach it in their order, so a seeded run builds the same
models as with threads.

What crosses: pickles (protocol 5) whose tensors' bytes travel out of band (small ones inside the
pickle), written to the pipe from the tensor's memory and read into one buffer that the received
tensors share; a model of the client's (``evaluate_local(t.gm)``) as the attribute's name;
``begin_round``'s context (which holds the models) not at all. A broadcast that every client of a
round receives alike (the same state tensors, the same knowledge object: see
:class:`~wafl.client.reception.SharedReception`) is sent to each process once and kept there until
the next one. Only
compute-and-wait runs here: the wait-free PM's ``fill`` asks the event loop whether to stop
between two batches, which a process cannot do.
"""

from __future__ import annotations

import asyncio
import fcntl
import io
import os
import pickle
import signal
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import structlog
import torch
from wafl.client.trainer import Trainer
from wafl.common.balance import balanced_groups
from wafl.common.errors import InvariantError

T = TypeVar("T")
log = structlog.get_logger("client")

NO_RESULT = frozenset({"begin_round"})  # methods whose result (the round's context: models) stays in the process


class ProcessSlots:
    """``slots`` forked training processes for ``trainers`` (see the module docstring)."""

    def __init__(self, slots: int, trainers: Sequence[Trainer]) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        self.slots = min(slots, max(1, len(trainers)))
        # nearly equal samples a process: a round ends with its last training, on the busiest process
        shares = [[trainers[i] for i in g] for g in balanced_groups([t.num_samples for t in trainers], self.slots)]
        self.home = {id(t): k for k, share in enumerate(shares) for t in share}
        self.children: list[_Child] = []
        for k, share in enumerate(shares):  # each process closes the pipes of those forked before it
            self.children.append(_Child(k, share, [fd for c in self.children for fd in (c.wfd, c.rfd)]))
        log.info("slot_processes.started", processes=self.slots, pids=[c.pid for c in self.children])

    # ------------------------------------------------------------ the compute interface
    def view(self, client: Trainer | None = None) -> ProcessSlots:
        return self

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        trainer = getattr(fn, "__self__", None)
        if not isinstance(trainer, Trainer) or id(trainer) not in self.home:
            raise TypeError(f"process slots run the methods of their clients' trainers, not {fn!r}")
        name = fn.__name__
        call = (trainer.index, name, tuple(_model_name(trainer, a) for a in args))
        child = self.children[self.home[id(trainer)]]
        return await child.call(call)

    async def fill(self, train: Callable[[Callable[[], bool]], T], stop: Callable[[], bool], wake: Any = None) -> T:
        # simulate() refuses slot_processes for a wait-free run (trains_in_processes): reaching here is a bug
        raise InvariantError("process slots run compute-and-wait only: a wait-free PM asks the event loop when to stop")

    def close(self) -> None:
        pass  # the pool outlives each client; :meth:`shutdown` ends it

    def shutdown(self) -> None:
        for c in self.children:
            c.stop()


@dataclass(frozen=True)
class _Model:
    """An argument that is one of the client's own models: its attribute's name on the trainer."""

    attr: str


def _model_name(trainer: Trainer, arg: Any) -> Any:
    if isinstance(arg, torch.nn.Module):
        for attr in ("gm", "pm"):
            if getattr(trainer, attr, None) is arg:
                return _Model(attr)
        raise TypeError(f"a model argument that is not client {trainer.index}'s gm or pm cannot reach its process")
    return arg


class _Child:
    """One forked training process and its two pipes, read and written by the event loop itself
    (``add_reader`` / ``add_writer``): a helper thread would take the GIL from the event loop at
    every wake-up."""

    def __init__(self, k: int, trainers: list[Trainer], others: list[int]) -> None:
        """``others``: the parent's ends of the processes forked before this one, closed in it (their
        processes see the end of their pipe when the parent closes it)."""
        self.k = k
        self.loop = asyncio.get_running_loop()
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        for fd in (to_child, to_parent):
            _widen(fd)
        pid = os.fork()
        if pid == 0:  # the training process: serves calls until its pipe closes
            for fd in (to_child, from_child, *others):
                os.close(fd)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (an interrupt ends the parent's run)
            code = 0
            try:
                _serve(from_parent, to_parent, {t.index: t for t in trainers})
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(from_parent)
        os.close(to_parent)
        self.pid = pid
        self.wfd, self.rfd = to_child, from_child
        os.set_blocking(self.wfd, False)
        os.set_blocking(self.rfd, False)
        self.out = bytearray()  # bytes not yet written to the process
        self.head, self.head_at = bytearray(_LEN.size), 0  # the next reply's length, as far as read
        self.body: bytearray | None = None  # the reply being read
        self.body_at = 0
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.next_id = 0
        # begin_round's model and knowledge sent last, by argument position (the process keeps them)
        self.held: dict[int, dict[Any, Any]] = {}
        self.exited: str | None = None
        self.loop.add_reader(self.rfd, self._readable)

    async def call(self, call: tuple[int, str, tuple[Any, ...]]) -> Any:
        if self.exited is not None:
            raise RuntimeError(self.exited)
        fut: asyncio.Future[Any] = self.loop.create_future()
        call_id = self.next_id
        self.next_id += 1
        index, name, args = call
        if name == "begin_round":  # (round, state, knowledge, selected): what the process holds already, not again
            args = self._once(args)
        parts = _message((call_id, index, name, args))
        self.pending[call_id] = fut
        self._send(parts)
        return await fut

    def _once(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``begin_round``'s arguments with its model and its knowledge replaced by ``_SAME`` where the
        process received the same ones last: the same objects in them (every client of a broadcast
        receives the same tensors and, through :class:`~wafl.client.reception.SharedReception`, the
        same knowledge)."""
        out = list(args)
        for i in _HELD:
            if i >= len(out) or out[i] is None:
                continue
            new, last = out[i], self.held.get(i)
            if last is not None and len(last) == len(new) and all(new.get(k) is v for k, v in last.items()):
                out[i] = _SAME
            else:
                self.held[i] = dict(new)
        return tuple(out)

    def _send(self, parts: list[Buffer]) -> None:
        if not self.out:  # nothing waits for the pipe: straight into it
            try:
                n = os.writev(self.wfd, parts)
            except BlockingIOError:
                n = 0
            parts = _after(parts, n)
            if not parts:
                return
            self.loop.add_writer(self.wfd, self._writable)
        for p in parts:  # after the bytes that wait
            self.out += p

    def _writable(self) -> None:
        try:
            n = os.write(self.wfd, self.out)
        except BlockingIOError:
            return
        except OSError as e:  # the process is gone: its reader says how
            self.loop.remove_writer(self.wfd)
            self.out.clear()
            log.warning("slot_process.write_failed", process=self.k, error=str(e))
            return
        del self.out[:n]
        if not self.out:
            self.loop.remove_writer(self.wfd)

    def _readable(self) -> None:
        """Reads what the process wrote: each reply's length, then its body straight into a buffer of
        that size, whose tensors the reply's arrays then share (no further copy)."""
        while True:
            if self.body is None:
                got = self._read_into(memoryview(self.head)[self.head_at :])
                if got is None:
                    return
                self.head_at += got
                if self.head_at < _LEN.size:
                    continue
                self.head_at = 0
                self.body, self.body_at = bytearray(_LEN.unpack(self.head)[0]), 0
            if self.body_at < len(self.body):
                got = self._read_into(memoryview(self.body)[self.body_at :])
                if got is None:
                    return
                self.body_at += got
            if self.body_at == len(self.body):
                body, self.body = self.body, None
                call_id, ok, value = _load(body)
                fut = self.pending.pop(call_id)
                if fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

    def _read_into(self, view: memoryview) -> int | None:
        """Bytes read into ``view``; None when none are there yet, or the process has gone."""
        try:
            got = os.readv(self.rfd, [view])
        except BlockingIOError:
            return None
        if not got:
            self._ended()
            return None
        return got

    def _ended(self) -> None:
        if self.exited is not None:
            return
        self.loop.remove_reader(self.rfd)
        _, status = os.waitpid(self.pid, 0)
        self.exited = f"training process {self.k} (pid {self.pid}) exited with code {os.waitstatus_to_exitcode(status)}"
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(self.exited))

    def stop(self) -> None:
        """Closes the pipes (the process exits once its current call returns) and reaps it; kills it
        when it has not exited within 30 s."""
        if self.exited is None:
            self.loop.remove_reader(self.rfd)
        if self.out:
            self.loop.remove_writer(self.wfd)
        os.close(self.wfd)
        os.close(self.rfd)
        if self.exited is not None:
            return
        deadline = time.monotonic() + 30.0
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.01)
        self.exited = f"training process {self.k} was stopped"


_LEN = struct.Struct("<Q")  # a message's length, then the message (:func:`_message`)
_ALIGN = 64  # where each array's bytes start in a message (from its start)
_IN_BAND = 4096  # arrays smaller than this travel inside the pickle (a part and its padding cost more than a copy)
Buffer = bytes | bytearray | memoryview


def _message(obj: Any) -> list[Buffer]:
    """``obj`` as the parts of one message: its length, then ``<I`` the number of arrays, ``<Q`` the
    pickle's length and each array's, the pickle (protocol 5), then the arrays' bytes out of band (those of
    at least ``_IN_BAND`` bytes; smaller ones are in the pickle), each at a multiple of 64 bytes from the
    message's start (padding between)."""
    arrays: list[pickle.PickleBuffer] = []

    def out_of_band(b: pickle.PickleBuffer) -> bool:  # False: out of band; small arrays stay in the pickle
        if b.raw().nbytes < _IN_BAND:
            return True
        arrays.append(b)
        return False

    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=out_of_band).dump(obj)
    pickled, raws = f.getbuffer(), [a.raw() for a in arrays]
    meta = struct.pack(f"<I{len(raws) + 1}Q", len(raws), pickled.nbytes, *(r.nbytes for r in raws))
    parts: list[Buffer] = [meta, pickled]
    size = len(meta) + pickled.nbytes
    for r in raws:
        pad = -size % _ALIGN
        parts += [bytes(pad), r]
        size += pad + r.nbytes
    return [_LEN.pack(size), *parts]


def _load(body: bytearray) -> Any:
    """The object of one message's body (:func:`_message`); its arrays share ``body``'s memory."""
    view = memoryview(body)
    (n,) = struct.unpack_from("<I", view)
    sizes = struct.unpack_from(f"<{n + 1}Q", view, 4)
    at = 4 + 8 * (n + 1)
    pickled = view[at : at + sizes[0]]
    at += sizes[0]
    arrays = []
    for size in sizes[1:]:
        at += -at % _ALIGN
        arrays.append(view[at : at + size])
        at += size
    return pickle.loads(pickled, buffers=arrays)


def _after(parts: list[Buffer], n: int) -> list[Buffer]:
    """What is left of ``parts`` once their first ``n`` bytes were written."""
    for i, p in enumerate(parts):
        size = memoryview(p).nbytes
        if n < size:
            return [memoryview(p).cast("B")[n:], *parts[i + 1 :]]
        n -= size
    return []


def _widen(fd: int) -> None:
    """A 1 MiB pipe where Linux allows it: a small model's upload fits, so the process is not held up
    until the event loop reads it."""
    try:
        fcntl.fcntl(fd, 1031, 1 << 20)  # F_SETPIPE_SZ
    except OSError:
        pass


_SAME = "__wafl_same_as_before__"  # begin_round's state or knowledge: the one this process received last
_HELD = (1, 2)  # begin_round's arguments a process keeps: the broadcast's model (state), its knowledge


def _is_same(arg: Any) -> bool:
    return isinstance(arg, str) and arg == _SAME


def _serve(rfd: int, wfd: int, trainers: dict[int, Trainer]) -> None:
    held: dict[int, Any] = {}  # begin_round's model and knowledge, as last received (:meth:`_Child._once`)
    while True:
        head = _read_exactly(rfd, _LEN.size)
        if head is None:  # the parent closed the pipe: the end
            return
        body = _read_exactly(rfd, _LEN.unpack(head)[0])
        if body is None:
            return
        call_id, index, name, args = _load(body)
        try:
            t = trainers[index]
            if name == "begin_round":  # the model and knowledge the parent sent with an earlier call, or new ones
                args = tuple(held[i] if i in _HELD and _is_same(a) else a for i, a in enumerate(args))
                held.update({i: args[i] for i in _HELD if i < len(args) and args[i] is not None})
            args = tuple(getattr(t, a.attr) if isinstance(a, _Model) else a for a in args)
            result = getattr(t, name)(*args)
            out = _message((call_id, True, None if name in NO_RESULT else result))
        except BaseException as e:
            e.add_note(f"in client {index}'s {name}, training process pid {os.getpid()}")
            try:
                out = _message((call_id, False, e))
            except Exception:  # an exception that does not pickle: its text
                out = _message((call_id, False, RuntimeError("".join(traceback.format_exception(e)))))
        try:
            while out:
                out = _after(out, os.writev(wfd, out))
        except BrokenPipeError:  # the parent closed its end (its run ended, or failed elsewhere): nobody waits
            return


def _read_exactly(fd: int, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, at = memoryview(buf), 0
    while at < n:
        got = os.readv(fd, [view[at:]])
        if not got:
            return None
        at += got
    return buf


class _Pickler(pickle.Pickler):
    """Tensors as numpy arrays (their bytes out of band: :func:`_message`); everything else as pickle does it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if t.dtype == torch.bfloat16:
                return _bfloat16, (t.contiguous().view(torch.int16).numpy(),)
            return torch.from_numpy, (t.contiguous().numpy(),)
        return NotImplemented


def _bfloat16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)
