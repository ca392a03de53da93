"""Streaming weighted aggregation: server memory O(model), not O(clients x model).

Each upload is folded into one running float64 sum chunk by chunk as it streams in. Because a
transfer is only accepted at its trailer (CRC, completeness), every fold also keeps the raw
chunk bytes until the upload ends (in memory or in a spill file: :mod:`wafl.server.aggregation.spill`). An
upload that fails after some folds is subtracted back out from what it kept, so it leaves no
trace beyond float64 rounding (a relative 1e-16, far below the float32 the model is stored
in). The global model itself is never touched until the round closes.

Bounded influence (:class:`~wafl.server.aggregation.rule.Rule`): with ``clip_norm`` an upload whose
update has an L2 norm above the bound is scaled down to it when it commits, by subtracting the excess
back out from its spill file. With a robust center (``trimmed_mean``, ``median``:
:mod:`wafl.server.aggregation.robust`) the committed uploads' chunks are kept until the round is
aggregated and read back one tensor at a time (memory O(uploads x largest tensor) beyond the budget,
the rest stays on disk). Without ``clip_norm`` the bound is adaptive by default
(:class:`~wafl.server.aggregation.norm_bound.NormBound`): an upload within the bound is folded exactly
as without one, and one whose running norm goes beyond it is taken back out of the sums at that chunk
and folded, clipped, at its commit.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Mapping

import numpy as np
import torch
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
from wafl.common.errors import Code, InvariantError
from wafl.server.aggregation.norm_bound import MAX_UPDATE_NORM, bounded, sq_norm
from wafl.server.aggregation.robust import ROBUST_CENTERS
from wafl.server.aggregation.rule import Rule
from wafl.server.aggregation.spill import RetainedBytes, SpillArena, SpillSlot

_scratch = threading.local()  # each folding thread's float64 buffers (UploadFold._contribution, _update)


def _buffer(name: str, size: int) -> np.ndarray:
    """This thread's float64 buffer ``name``, at least ``size`` long, reused chunk after chunk."""
    buf: np.ndarray | None = getattr(_scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.float64)
        setattr(_scratch, name, buf)
    return buf[:size]


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
        """The rule's robust center (its ``combine`` in :data:`~wafl.server.aggregation.robust.ROBUST_CENTERS`:
        coordinate-wise median, trimmed mean) of the (clipped) committed uploads, tensor by tensor.

        The weights are ignored, except with ``scaled`` (``ServerUpdate.robust_scaled``): then each
        upload's update of a trained tensor (floating, not normalization statistics nor an extra tensor)
        enters multiplied by its weight, the center of ``ref + w_i (x_i - ref)`` (FedNova's normalized
        updates ``(x_i - ref) / a_i`` with ``w_i = 1 / a_i``)."""
        if not self.kept:
            raise ValueError("no upload was aggregated")
        out: dict[str, torch.Tensor] = {}
        combine = ROBUST_CENTERS[self.rule.center].combine
        factors = np.array([[f.weight] for f in self.kept]) if scaled else None  # (k, 1)
        for s in self.manifest:
            values = np.stack([f.values(s.name, s.numel) for f in self.kept])  # (k, numel) float64
            if factors is not None and s.dtype in FLOAT_WIRE_DTYPES and bounded(s.name) and not is_statistic(s.name):
                ref = 0.0 if self.reference is None else self.reference[s.name]
                values = ref + factors * (values - ref)
            c = combine(values, self.rule.trim)
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
