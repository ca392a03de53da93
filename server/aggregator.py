"""Streaming weighted aggregation: server memory O(model), not O(clients x model).

Each upload is folded into one running float64 sum chunk by chunk as it streams in. Because a
transfer is only accepted at its trailer (CRC, completeness), every fold also keeps the raw
chunk bytes until the upload ends: the received message itself while the server's
:class:`RetainedBytes` budget (``rollback_memory_mb``, shared by every upload in flight, at most
``rollback_upload_mb`` of it for one upload) has room, which costs no copy, and beyond it in the
upload's slot of an unlinked spill file (:class:`SpillArena`: one file per accumulator, in the page
cache, not the server's heap). An
upload that fails after some folds is subtracted back out from what it kept, so it leaves no
trace beyond float64 rounding (a relative 1e-16, far below the float32 the model is stored
in). The global model itself is never touched until the round closes.

Bounded influence (:class:`Rule`): with ``clip_norm`` an upload whose update (its floating-point
tensors minus the reference, the global model it was trained from; buffered uploads are
updates already) has an L2 norm above the bound is scaled down to it when it commits, by
subtracting the excess back out from its spill file. With ``center`` ``trimmed_mean`` or
``median`` the committed uploads' chunks are kept until the round is aggregated and read back one
tensor at a time (memory O(uploads x largest tensor) beyond the budget, the rest stays on disk):
coordinate-wise median, or mean after dropping the ``floor(trim * k)`` largest and smallest
values of each coordinate; these two ignore the weights (unless the algorithm's updates are
scaled by them: :meth:`Accumulator.robust`). Without ``clip_norm`` the bound is
adaptive by default (:class:`NormBound`, ``norm_bound`` in the configuration): a multiple of the
median norm of recently accepted updates: an upload within the bound is folded exactly as
without one, and one whose running norm goes beyond it is taken back out of the sums at that
chunk and folded, clipped, at its commit.
"""

from __future__ import annotations

import enum
import heapq
import math
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

import numpy as np
import torch
from wafl.common.algorithms.base import EXTRA_PREFIX
from wafl.common.algorithms.server_updates import is_statistic
from wafl.common.codec import (
    FLOAT_WIRE_DTYPES,
    ChunkError,
    Manifest,
    RawChunk,
    TensorSpec,
    itemsize,
    numpy_view,
    torch_dtype,
)
from wafl.common.config import ConfigError, RunConfig, register_config_check
from wafl.common.errors import Code, InvariantError


class Center(enum.StrEnum):
    """The configuration's ``aggregator``: what a collection's committed uploads combine into."""

    MEAN = "mean"  # their weighted mean, folded as they stream in
    TRIMMED_MEAN = "trimmed_mean"  # coordinate-wise, ``trim_fraction`` dropped at each end
    MEDIAN = "median"  # coordinate-wise


CENTERS = tuple(c.value for c in Center)


def check_aggregator(cfg: RunConfig) -> None:
    """The ``aggregator`` section: a known rule. Whether it can do what it is for with the uploads one
    aggregation combines (:func:`check_robust`) depends on the round policy, which checks it
    (``wafl.server.strategies.check_aggregation``)."""
    if cfg.aggregator not in CENTERS:
        raise ConfigError(f"aggregator={cfg.aggregator!r} is not one of {list(CENTERS)}")


_scratch = threading.local()  # each folding thread's float64 buffers (UploadFold._contribution, _update)


def _buffer(name: str, size: int) -> np.ndarray:
    """This thread's float64 buffer ``name``, at least ``size`` long, reused chunk after chunk."""
    buf: np.ndarray | None = getattr(_scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.float64)
        setattr(_scratch, name, buf)
    return buf[:size]


# An update whose L2 norm exceeds this is refused: its square overflows float32, the dtype models
# are kept and averaged in (a client or server summing squares in float32 would get Inf).
MAX_UPDATE_NORM = math.sqrt(float(np.finfo(np.float32).max))  # about 1.8e19

# NumPy's OpenBLAS computes a dot product of more than 10,000 values on its worker threads (as many as the
# cores), which spin while they wait for work: under load they take the cores from the training, and
# the sum's order, so its last bits, depends on how many cores the machine has. ``sq_norm`` takes the
# dot product block by block, each block under that threshold: one thread, the same bits everywhere.
SQ_NORM_BLOCK = 10_000


def sq_norm(d: np.ndarray) -> float:
    """``d . d`` of a 1-D float64 array, summed in blocks of :data:`SQ_NORM_BLOCK` values (each a single-
    threaded BLAS dot): the same bits on every machine for one BLAS build, and no BLAS threads woken."""
    total = 0.0  # one block (up to SQ_NORM_BLOCK values): 0.0 + np.dot(d, d), exactly np.dot's value
    for i in range(0, d.size, SQ_NORM_BLOCK):
        b = d[i : i + SQ_NORM_BLOCK]
        total += float(np.dot(b, b))
    return total


@dataclass(frozen=True)
class Rule:
    """How uploads combine: ``center`` (weighted mean, trimmed mean, median), optional update-norm
    clipping: at the fixed ``clip_norm``, or else (``adaptive`` > 0) at the bound each collection's
    accumulator is given (:attr:`Accumulator.bound`, see :class:`NormBound`)."""

    center: str = Center.MEAN  # a :class:`Center`'s name
    trim: float = 0.1  # trimmed_mean: share of the values dropped at each end of every coordinate
    clip_norm: float | None = None  # L2 bound on each upload's update (floating-point tensors)
    adaptive: float = 0.0  # without clip_norm: the bound's multiple of the median of recent accepted norms

    @property
    def keeps_uploads(self) -> bool:
        return self.center != Center.MEAN

    @property
    def measures(self) -> bool:
        """Whether each upload's update norm is measured (clipped, recorded, refused beyond float32)."""
        return self.clip_norm is not None or self.adaptive > 0


def bounded(name: str) -> bool:
    """Whether clipping bounds a travelling tensor: the model's, not an algorithm's extra tensors
    (control variates, a generator, label counts, per-client rows of a summed tensor), whose values
    are not an update of the model and whose scale says nothing of one."""
    return not name.startswith(EXTRA_PREFIX)


class NormBound:
    """The default bound on each update's influence: ``multiple`` x the median L2 norm of the updates
    accepted in the last ``window`` collections (each taken after its own clipping); before any, in
    the first round, ``multiple x first`` (1 by default) x the norm of the global model's
    floating-point tensors: an update no larger than the model itself (the largest honest
    first-round update on digits is 0.17 of it).

    Why this rule. Without a bound, the weighted mean has a breakdown point of zero: one upload of
    finite but huge values (1e30) moves the average anywhere (Blanchard et al. 2017). Bounding the
    norm of every update is the defence that costs honest federations nothing when the bound sits
    above their updates: Sun et al. 2019 ("Can you really backdoor federated learning?") show norm
    bounding removes most of an attacker's effect, and Andrew et al. 2021 ("Differentially private
    learning with adaptive clipping") set the bound from a quantile of the clients' update norms
    instead of a hand-tuned constant, since update norms change by orders of magnitude with the
    model, the learning rate and the round. The median of the accepted norms is that quantile in its
    most robust form: fewer than half of the uploads, however large, cannot move it, and an
    attacker's own clipped norms enter it at most at the bound. Departure: the *lower* median
    (:func:`lower_median`, the ``ceil(n/2)``-th smallest of ``n`` norms), not the mean of the two
    middle ones when ``n`` is even. With the mean, an attacker holding exactly half of the uploads (one
    of two clients) lifts the bound by half its own clipped norm every round, which its next upload
    reaches again: 10 -> 67 -> 354 -> ... -> 44,921 in 16 rounds over honest norms of 3.9. The lower
    median of ``n`` norms of which at most half are the attacker's is at most the largest honest norm
    of the window, so the bound stays at most ``multiple`` x that; with an odd ``n`` it is the
    median itself, the same value as before. The ``multiple`` (10 by default)
    leaves room for the spread of honest non-IID updates (clients with more data take more steps):
    on digits (10 clients, Dirichlet 0.5; FedAvg, FedDyn, SCAFFOLD) the largest honest update was
    1.3-2.5 x the previous rounds' median, so seeded honest runs build bit-identical
    models with the bound and without. An attacker then moves the model at most by its weight times
    ``multiple`` honest updates, instead of arbitrarily. Updates beyond what float32 can square are
    refused outright (:data:`MAX_UPDATE_NORM`).
    """

    def __init__(self, multiple: float, window: int = 3, first: float = 0.1) -> None:
        self.multiple = multiple
        self.window = window
        self.first = first
        self.history: list[list[float]] = []  # accepted norms of the last collections, oldest first

    def bound(self, reference_norm: float) -> float | None:
        if self.multiple <= 0:
            return None
        norms = [n for h in self.history for n in h]
        if norms:
            return self.multiple * lower_median(norms)
        return self.multiple * self.first * reference_norm if reference_norm > 0 else None

    def record(self, norms: list[float]) -> None:
        if norms:
            self.history = [*self.history, list(norms)][-self.window :]

    def state_dict(self) -> list[list[float]]:
        return [list(h) for h in self.history]

    def load_state_dict(self, history: list[list[float]]) -> None:
        self.history = [[float(n) for n in h] for h in history][-self.window :]


def lower_median(values: list[float]) -> float:
    """The ``ceil(n/2)``-th smallest of ``n`` values: the median for odd ``n``, the lower middle one for even ``n``."""
    return float(sorted(values)[(len(values) - 1) // 2])


def check_robust(center: str, trim: float, uploads: int) -> str | None:
    """Why a robust ``center`` cannot work with ``uploads`` per aggregation (None when it can)."""
    if center == Center.TRIMMED_MEAN and math.floor(trim * uploads) < 1:
        return (
            f"aggregator=trimmed_mean with trim_fraction={trim:g} trims floor({trim:g} x {uploads}) = 0 values at "
            f"each end of a round of {uploads} uploads: it is the plain mean; set trim_fraction >= {1 / uploads:.3g} "
            "or use more clients per round"
        )
    if center == Center.MEDIAN and uploads < 3:
        return (
            f"aggregator=median of {uploads} uploads per round is their mean: it resists no outlier; "
            "use at least 3 clients per round"
        )
    return None


class RetainedBytes:
    """The bytes of received chunks that open uploads hold in memory for their rollback, across
    every accumulator of a server: up to ``limit`` in all and ``per_upload`` for one upload; a chunk
    that does not fit is spilled.

    The cap per upload keeps a large model's uploads on the spill file (a few large writes, cheap
    per byte) and the budget for the many small ones, for which a spill write per chunk costs the
    most per byte: with it, ten concurrent uploads of a 45 MB model hold 20 MiB, not the 256 MiB
    of the whole budget."""

    def __init__(self, limit: int, per_upload: int | None = None) -> None:
        if limit < 0:
            raise ValueError(f"retained bytes limit {limit} must be >= 0")
        if per_upload is not None and per_upload < 0:
            raise ValueError(f"retained bytes per upload {per_upload} must be >= 0")
        self.limit = limit
        self.per_upload = limit if per_upload is None else per_upload
        self.used = 0
        self.lock = threading.Lock()

    def take(self, n: int, held: int = 0) -> bool:
        """Reserves ``n`` bytes for an upload that holds ``held`` already; False (nothing reserved)
        when they do not fit, in the budget or in the upload's share of it."""
        if held + n > self.per_upload:
            return False
        with self.lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n

    @classmethod
    def of_mb(
        cls, mb: float = RunConfig.rollback_memory_mb, upload_mb: float = RunConfig.rollback_upload_mb
    ) -> RetainedBytes:
        """A budget of ``mb`` MiB, ``upload_mb`` for one upload (by default the run configuration's
        ``rollback_memory_mb`` and ``rollback_upload_mb``)."""
        return cls(int(mb * (1 << 20)), int(upload_mb * (1 << 20)))


class SpillArena:
    """Rollback data of every upload of an accumulator in one unlinked temporary file, one slot
    of ``slot_bytes`` (the manifest's bytes: the most an upload can fold) per upload in flight.

    A slot freed by one upload is reused by the next (lowest first): overwriting pages that are
    already in the page cache costs a memory copy, while a fresh file first has the kernel
    allocate every page (about 7x the cost per MiB here), and a file per upload would cost a
    descriptor and a creation each. The pages are page cache, not the server's heap; :meth:`trim`
    gives back all but ``keep`` slots once no upload is open (between rounds).
    """

    def __init__(self, slot_bytes: int, spill_dir: str | None = None, keep: int = 16) -> None:
        self.slot_bytes = max(1, slot_bytes)
        self.spill_dir = spill_dir
        self.keep = keep
        self.file: IO[bytes] | None = None
        self.slots = 0  # slots the file has room for
        self.free: list[int] = []  # a heap of free slots
        self.in_use = 0
        self.lock = threading.Lock()

    def acquire(self) -> SpillSlot:
        with self.lock:
            if self.file is None:
                self.file = tempfile.TemporaryFile(dir=self.spill_dir)
            if self.free:
                slot = heapq.heappop(self.free)
            else:
                slot = self.slots
                self.slots += 1
            self.in_use += 1
            return SpillSlot(self, self.file.fileno(), slot)

    def release(self, spill: SpillSlot) -> None:
        with self.lock:
            heapq.heappush(self.free, spill.slot)
            self.in_use -= 1

    def trim(self) -> None:
        """Shrinks the file to ``keep`` slots when no upload holds one."""
        with self.lock:
            if self.file is None or self.in_use or self.slots <= self.keep:
                return
            os.ftruncate(self.file.fileno(), self.keep * self.slot_bytes)
            self.slots = self.keep
            self.free = list(range(self.keep))

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()
                self.file = None


class SpillSlot:
    """One upload's region of a :class:`SpillArena`, written and read like a file of its own."""

    __slots__ = ("arena", "fd", "slot", "base", "pos")

    def __init__(self, arena: SpillArena, fd: int, slot: int) -> None:
        self.arena = arena
        self.fd = fd
        self.slot = slot
        self.base = slot * arena.slot_bytes
        self.pos = 0

    def write(self, data: bytes | memoryview) -> None:
        n = len(data)
        if self.pos + n > self.arena.slot_bytes:
            raise ValueError(f"spill slot overflow: {self.pos + n} > {self.arena.slot_bytes} bytes")
        while n:  # pwrite may write less than asked
            done = os.pwrite(self.fd, data, self.base + self.pos)
            self.pos += done
            data = memoryview(data)[done:]
            n -= done

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        data = os.pread(self.fd, n, self.base + self.pos)
        while len(data) < n:  # short read (large n)
            more = os.pread(self.fd, n - len(data), self.base + self.pos + len(data))
            if not more:
                raise ValueError("spill slot read past its end")
            data += more
        self.pos += n
        return data


class Accumulator:
    """Running ``sum_i w_i * x_i`` per tensor (float64), the committed weight and count.

    One accumulator can serve round after round (``reset``), so that its sums are faulted in
    once instead of at the first fold of every round.
    """

    def __init__(
        self,
        manifest: Manifest,
        spill_dir: str | None = None,
        rule: Rule = Rule(),
        retained: RetainedBytes | None = None,
    ) -> None:
        self.manifest = manifest
        self.retained = retained if retained is not None else RetainedBytes.of_mb()
        self.rule = rule
        self.sums = {s.name: np.zeros(s.numel, dtype=np.float64) for s in manifest}
        # ``lock`` guards the sums (a fold worker adding a chunk, a rollback); ``folds_lock`` the
        # bookkeeping (open and kept folds, weight, count), so that the event loop, which begins and
        # commits uploads, never waits for another upload's chunk being added
        self.lock = threading.Lock()
        self.folds_lock = threading.Lock()
        self.total_weight = 0.0
        self.count = 0
        self.spills = SpillArena(sum(s.nbytes for s in manifest), spill_dir)
        self.open_folds: set[UploadFold] = set()
        self.kept: list[UploadFold] = []  # committed uploads whose values a robust center reads back
        # what an update is measured against (flat float64 per tensor); None: the uploads are updates
        self.reference: dict[str, np.ndarray] | None = None
        self.bound: float | None = None  # the adaptive clipping bound of this collection (Rule.adaptive)
        self.norms: list[float] = []  # the committed uploads' update norms, after clipping
        self.clipped = 0  # committed uploads whose update was scaled down

    def set_reference(self, state: Mapping[str, torch.Tensor] | None) -> None:
        """The model the next uploads were trained from (None: they are updates already)."""
        if state is None or not self.rule.measures and not self.rule.keeps_uploads:
            self.reference = None
            return
        self.reference = {
            s.name: state[s.name].detach().cpu().reshape(-1).to(torch.float64).numpy().copy() for s in self.manifest
        }

    def reset(self) -> None:
        """Zeroes the sums for a new round; no fold may be open."""
        with self.lock, self.folds_lock:
            if self.open_folds:
                raise RuntimeError(f"{len(self.open_folds)} uploads still open: cancel_open() first")
            for v in self.sums.values():
                v.fill(0.0)
            self.total_weight = 0.0
            self.count = 0
            self.norms = []
            self.clipped = 0
            kept, self.kept = self.kept, []
        for f in kept:
            f._release()
        self.spills.trim()

    def begin(self, weight: float) -> UploadFold:
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"aggregation weight {weight} must be positive")
        fold = UploadFold(self, weight)
        with self.folds_lock:
            self.open_folds.add(fold)
        return fold

    def cancel_open(self) -> int:
        """Rolls back every fold still in flight (the round is closing); returns how many."""
        with self.folds_lock:
            folds = list(self.open_folds)
        for f in folds:
            f.rollback()
        return len(folds)

    def center(self, scaled: bool = False) -> dict[str, torch.Tensor]:
        """What the rule makes of the committed uploads: the weighted mean, or a robust center
        (``scaled``: of the weight-scaled updates, see :meth:`robust`)."""
        return self.mean() if not self.rule.keeps_uploads else self.robust(scaled)

    def robust(self, scaled: bool = False) -> dict[str, torch.Tensor]:
        """Coordinate-wise median or trimmed mean of the (clipped) committed uploads, tensor by tensor.

        The weights are ignored, except with ``scaled`` (``ServerUpdate.robust_scaled``): then each
        upload's update of a trained tensor (floating, not normalization statistics nor an extra tensor)
        enters multiplied by its weight, the center of ``ref + w_i (x_i - ref)`` (FedNova's normalized
        updates ``(x_i - ref) / a_i`` with ``w_i = 1 / a_i``)."""
        if not self.kept:
            raise ValueError("no upload was aggregated")
        out: dict[str, torch.Tensor] = {}
        k = len(self.kept)
        cut = int(math.floor(self.rule.trim * k)) if self.rule.center == Center.TRIMMED_MEAN else 0
        factors = np.array([[f.weight] for f in self.kept]) if scaled else None  # (k, 1)
        for s in self.manifest:
            values = np.stack([f.values(s.name, s.numel) for f in self.kept])  # (k, numel) float64
            if factors is not None and s.dtype in FLOAT_WIRE_DTYPES and bounded(s.name) and not is_statistic(s.name):
                ref = 0.0 if self.reference is None else self.reference[s.name]
                values = ref + factors * (values - ref)
            if self.rule.center == Center.MEDIAN:
                c = np.median(values, axis=0)
            else:
                values.sort(axis=0)
                c = values[cut : k - cut].mean(axis=0)
            dt = torch_dtype(s.dtype)
            t = torch.from_numpy(c.reshape(s.shape))
            out[s.name] = t.to(dt) if dt.is_floating_point else torch.round(t).to(dt)
        return out

    def mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean in each tensor's own dtype (integers rounded)."""
        if self.count == 0:
            raise ValueError("no upload was aggregated")
        out: dict[str, torch.Tensor] = {}
        scale = 1.0 / self.total_weight
        for s in self.manifest:
            dt = torch_dtype(s.dtype)
            if dt == torch.float32:  # straight into float32, no float64 temporary
                m = np.multiply(self.sums[s.name], scale, out=np.empty(s.numel, np.float32), casting="same_kind")
                out[s.name] = torch.from_numpy(m.reshape(s.shape))
                continue
            t = torch.from_numpy((self.sums[s.name] * scale).reshape(s.shape))
            out[s.name] = t.to(dt) if dt.is_floating_point else torch.round(t).to(dt)
        return out


class FoldState(enum.StrEnum):
    """Where an :class:`UploadFold` stands: open until its commit or its rollback ends it."""

    OPEN = "open"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled back"


class UploadFold:
    """One upload's contribution, folded chunk by chunk; ``commit`` or ``rollback`` ends it.

    Each folded chunk is kept until the fold ends (and, for a robust center, until the round is
    aggregated): the received bytes themselves while the accumulator's :class:`RetainedBytes`
    budget has room, otherwise a copy in the fold's spill slot, taken from the arena at the first
    chunk that needs one."""

    def __init__(self, acc: Accumulator, weight: float) -> None:
        self.acc = acc
        self.weight = weight
        self.spill: SpillSlot | None = None
        self.retained = 0  # bytes of the budget this fold holds
        self.lock = threading.Lock()  # its state: a chunk being added, commit and rollback exclude each other
        self.released = False  # its spill slot and retained bytes went back
        # (name, start element, elements, wire dtype, the chunk's bytes or its position in the spill slot)
        self.folded: list[tuple[str, int, int, int, memoryview | bytes | int]] = []
        self.state = FoldState.OPEN
        self.sq_norm = 0.0  # squared L2 norm of the model's update so far (what clipping bounds)
        self.sq_all = 0.0  # the same over every floating-point tensor, extra tensors included
        self.scale = 1.0  # the update's factor once committed (clipping)
        # with clipping or a robust center nothing reaches the sums before the commit: the kept chunks
        # hold the upload until its norm is known (or the center reads it back)
        self.deferred = acc.rule.clip_norm is not None or acc.rule.keeps_uploads

    def _contribution(self, values: np.ndarray) -> np.ndarray:
        # ``weight * values`` in the folding thread's buffer, reused chunk after chunk and upload after
        # upload: memory per fold worker, not per upload in flight
        return np.multiply(values, self.weight, out=_buffer("contribution", values.size), dtype=np.float64)

    def add(self, spec: TensorSpec, chunk: RawChunk) -> None:
        """Checks the chunk's values (finite) and folds ``weight * values`` into the sum."""
        values = numpy_view(chunk.data, spec.dtype)
        if values.size == 0:
            return
        contribution = self._contribution(values)
        start = chunk.offset // itemsize(spec.dtype)
        beyond = False  # this chunk takes the update beyond the adaptive bound
        if spec.dtype in FLOAT_WIRE_DTYPES:
            measured = self.acc.rule.measures
            # the update's squared norm is finite exactly when the values are (the reference is), so a
            # measured chunk needs no separate pass for that; a float64 sum of finite values this size
            # cannot overflow either: NaN/Inf is in the data
            total = sq_norm(self._update(spec.name, start, values)) if measured else float(np.add.reduce(contribution))
            if not math.isfinite(total) and not np.isfinite(values).all():
                bad = "NaN" if np.isnan(values).any() else "Inf"
                raise ChunkError(f"tensor {spec.name!r}: {bad} value in chunk at byte {chunk.offset}")
            if measured:  # ``total`` is the update's squared norm
                self.sq_all += total
                if bounded(spec.name):
                    self.sq_norm += total
                if not self.sq_all <= MAX_UPDATE_NORM**2:  # inf included
                    raise ChunkError(
                        f"tensor {spec.name!r}: the update's L2 norm exceeds {MAX_UPDATE_NORM:.3g} at byte "
                        f"{chunk.offset}, beyond what float32 can average"
                    )
                bound = self.acc.bound
                beyond = not self.deferred and bound is not None and self.sq_norm > bound * bound
        with self.lock:  # keeping the chunk too: a rollback must never interleave with it
            if self.state is not FoldState.OPEN:
                raise ChunkError("the round closed while this upload was streaming", Code.ABORTED)
            if beyond:
                self._defer()
            self.folded.append((spec.name, start, values.size, spec.dtype, self._keep(chunk.data)))
            if not self.deferred:
                with self.acc.lock:
                    target = self.acc.sums[spec.name][start : start + values.size]
                    np.add(target, contribution, out=target)

    def _keep(self, data: memoryview | bytes) -> memoryview | bytes | int:
        """The chunk when the budget has room (the received bytes themselves; a copy of a buffer
        its sender may still change), else its position in the spill slot."""
        n = len(data)
        if self.acc.retained.take(n, self.retained):
            self.retained += n
            immutable = isinstance(data, bytes) or isinstance(data, memoryview) and isinstance(data.obj, bytes)
            return data if immutable else bytes(data)
        if self.spill is None:
            self.spill = self.acc.spills.acquire()
        pos = self.spill.pos
        self.spill.write(data)
        return pos

    def _kept(self, kept: memoryview | bytes | int, nbytes: int) -> memoryview | bytes:
        if isinstance(kept, int):
            if self.spill is None:
                raise InvariantError(f"a chunk kept at spill position {kept} but the fold has no spill slot")
            self.spill.seek(kept)
            return self.spill.read(nbytes)
        return kept

    def _update(self, name: str, start: int, values: np.ndarray) -> np.ndarray:
        """``values`` minus the reference at ``start`` (float64; the values themselves without one), in one
        pass into the folding thread's second buffer (valid until its next chunk)."""
        ref = self.acc.reference
        out = _buffer("update", values.size)
        if ref is None:
            np.copyto(out, values)
            return out
        return np.subtract(values, ref[name][start : start + values.size], out=out, dtype=np.float64)

    def commit(self) -> None:
        """Adds the upload to the collection; with clipping its update is scaled to the bound first
        (an adaptive bound's excess is subtracted back out of the sums it was folded into)."""
        acc = self.acc
        clip = acc.rule.clip_norm if acc.rule.clip_norm is not None else acc.bound
        norm = math.sqrt(self.sq_norm)
        with self.lock:
            if self.state is not FoldState.OPEN:
                raise ChunkError("the round closed while this upload was streaming", Code.ABORTED)
            if clip is not None and norm > clip:
                self.scale = clip / norm
            if self.deferred and not acc.rule.keeps_uploads:
                with acc.lock:
                    self._fold_kept()
            self.state = FoldState.COMMITTED
            with acc.folds_lock:
                if acc.rule.measures:
                    acc.norms.append(norm * self.scale)
                    acc.clipped += self.scale != 1.0
                acc.total_weight += self.weight
                acc.count += 1
                acc.open_folds.discard(self)
                if acc.rule.keeps_uploads:
                    acc.kept.append(self)
                    return
        self._release()

    def _fold_kept(self) -> None:
        """Adds ``weight * (ref + scale * (x - ref))`` of every kept chunk to the sums (both locks held)."""
        for name, start, n, wire, kept in self.folded:
            target = self.acc.sums[name][start : start + n]
            target += self.weight * self._clipped(
                name, start, numpy_view(self._kept(kept, n * itemsize(wire)), wire), wire
            )

    def _defer(self) -> None:
        """The update went beyond the adaptive bound: what it folded so far (within the bound) is
        subtracted back out of the sums and the rest waits for the commit, which folds all of it
        clipped (its lock held). Values beyond the bound never reach the sums unscaled, so no
        cancellation of large numbers can leave a trace there."""
        for name, start, n, wire, kept in self.folded:
            subtrahend = np.multiply(
                numpy_view(self._kept(kept, n * itemsize(wire)), wire), self.weight, dtype=np.float64
            )
            with self.acc.lock:
                target = self.acc.sums[name][start : start + n]
                np.subtract(target, subtrahend, out=target)
        self.deferred = True

    def _clipped(self, name: str, start: int, values: np.ndarray, wire: int) -> np.ndarray:
        """Float64 values with the update scaled by ``scale`` (floating-point tensors only)."""
        v = values.astype(np.float64)
        if self.scale == 1.0 or wire not in FLOAT_WIRE_DTYPES or not bounded(name):
            return v
        ref = self.acc.reference
        base = 0.0 if ref is None else ref[name][start : start + v.size]
        return base + self.scale * (v - base)

    def values(self, name: str, numel: int) -> np.ndarray:
        """A committed upload's tensor as float64, clipped: ``ref + scale * (x - ref)``."""
        out = np.empty(numel, dtype=np.float64)
        for n_, start, n, wire, kept in self.folded:
            if n_ == name:
                data = self._kept(kept, n * itemsize(wire))
                out[start : start + n] = self._clipped(name, start, numpy_view(data, wire), wire)
        return out

    def rollback(self) -> None:
        """Subtracts what was folded (from the kept chunks); idempotent."""
        with self.lock:
            if self.state is not FoldState.OPEN:
                return
            self.state = FoldState.ROLLED_BACK
            with self.acc.folds_lock:
                self.acc.open_folds.discard(self)
            for name, start, n, wire, kept in [] if self.deferred else self.folded:
                data = self._kept(kept, n * itemsize(wire))
                # its own temporary: another upload's fold may be using this thread's scratch buffer
                subtrahend = np.multiply(numpy_view(data, wire), self.weight, dtype=np.float64)
                with self.acc.lock:
                    target = self.acc.sums[name][start : start + n]
                    np.subtract(target, subtrahend, out=target)
        self._release()

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.folded = []
            if self.retained:
                self.acc.retained.give(self.retained)
                self.retained = 0
            if self.spill is not None:
                self.acc.spills.release(self.spill)


register_config_check("aggregator", check_aggregator)
