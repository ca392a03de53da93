"""Streaming weighted aggregation: server memory O(model), not O(clients x model).

Each upload is folded into one running float64 sum chunk by chunk as it streams in. Because a
transfer is only accepted at its trailer (CRC, completeness), every fold also appends the raw
chunk bytes to an unlinked spill file on disk (the page cache, not the server's heap); an
upload that fails after some folds is subtracted back out from that file, so it leaves no
trace beyond float64 rounding (a relative 1e-16, far below the float32 the model is stored
in). The global model itself is never touched until the round closes.
"""

from __future__ import annotations

import math
import tempfile
import threading
from typing import IO

import numpy as np
import torch
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
from wafl.common.errors import Code


class SpillPool:
    """Unlinked temporary files for rollback data, reused from upload to upload.

    Overwriting a file whose pages are already in the page cache costs a memory copy; a fresh
    file first has the kernel allocate every page (about 7x the cost per MiB here). A pool
    keeps at most ``keep`` idle files; their pages are page cache, not the server's heap.
    """

    def __init__(self, spill_dir: str | None = None, keep: int = 16) -> None:
        self.spill_dir = spill_dir
        self.keep = keep
        self.idle: list[IO[bytes]] = []
        self.lock = threading.Lock()

    def acquire(self) -> IO[bytes]:
        with self.lock:
            f = self.idle.pop() if self.idle else None
        if f is None:
            return tempfile.TemporaryFile(dir=self.spill_dir)
        f.seek(0)
        return f

    def release(self, f: IO[bytes]) -> None:
        with self.lock:
            if len(self.idle) < self.keep:
                self.idle.append(f)
                return
        f.close()


class Accumulator:
    """Running ``sum_i w_i * x_i`` per tensor (float64), the committed weight and count.

    One accumulator can serve round after round (``reset``), so that its sums are faulted in
    once instead of at the first fold of every round.
    """

    def __init__(self, manifest: Manifest, spill_dir: str | None = None) -> None:
        self.manifest = manifest
        self.sums = {s.name: np.zeros(s.numel, dtype=np.float64) for s in manifest}
        self.lock = threading.Lock()
        self.total_weight = 0.0
        self.count = 0
        self.spills = SpillPool(spill_dir)
        self.open_folds: set[UploadFold] = set()

    def reset(self) -> None:
        """Zeroes the sums for a new round; no fold may be open."""
        with self.lock:
            if self.open_folds:
                raise RuntimeError(f"{len(self.open_folds)} uploads still open: cancel_open() first")
            for v in self.sums.values():
                v.fill(0.0)
            self.total_weight = 0.0
            self.count = 0

    def begin(self, weight: float) -> UploadFold:
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"aggregation weight {weight} must be positive")
        fold = UploadFold(self, weight)
        with self.lock:
            self.open_folds.add(fold)
        return fold

    def cancel_open(self) -> int:
        """Rolls back every fold still in flight (the round is closing); returns how many."""
        with self.lock:
            folds = list(self.open_folds)
        for f in folds:
            f.rollback()
        return len(folds)

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


class UploadFold:
    """One upload's contribution, folded chunk by chunk; ``commit`` or ``rollback`` ends it."""

    def __init__(self, acc: Accumulator, weight: float) -> None:
        self.acc = acc
        self.weight = weight
        self.spill = acc.spills.acquire()
        self.scratch = np.empty(0, dtype=np.float64)  # weight * values, reused chunk after chunk
        self.folded: list[tuple[str, int, int, int]] = []  # (name, start element, elements, wire dtype)
        self.state = "open"

    def _contribution(self, values: np.ndarray) -> np.ndarray:
        if self.scratch.size < values.size:
            self.scratch = np.empty(values.size, dtype=np.float64)
        return np.multiply(values, self.weight, out=self.scratch[: values.size], dtype=np.float64)

    def add(self, spec: TensorSpec, chunk: RawChunk) -> None:
        """Checks the chunk's values (finite) and folds ``weight * values`` into the sum."""
        values = numpy_view(chunk.data, spec.dtype)
        if values.size == 0:
            return
        contribution = self._contribution(values)
        if spec.dtype in FLOAT_WIRE_DTYPES and not math.isfinite(float(np.add.reduce(contribution))):
            # A float64 sum of finite values this size cannot overflow: NaN/Inf is in the data.
            bad = "NaN" if np.isnan(values).any() else "Inf"
            raise ChunkError(f"tensor {spec.name!r}: {bad} value in chunk at byte {chunk.offset}")
        start = chunk.offset // itemsize(spec.dtype)
        with self.acc.lock:  # the spill write too: a rollback must never interleave with it
            if self.state != "open":
                raise ChunkError("the round closed while this upload was streaming", Code.ABORTED)
            self.spill.write(chunk.data)
            target = self.acc.sums[spec.name][start : start + values.size]
            np.add(target, contribution, out=target)
            self.folded.append((spec.name, start, values.size, spec.dtype))

    def commit(self) -> None:
        with self.acc.lock:
            if self.state != "open":
                raise ChunkError("the round closed while this upload was streaming", Code.ABORTED)
            self.acc.total_weight += self.weight
            self.acc.count += 1
            self.state = "committed"
            self.acc.open_folds.discard(self)
        self._release()

    def rollback(self) -> None:
        """Subtracts what was folded (read back from the spill file); idempotent."""
        with self.acc.lock:
            if self.state != "open":
                return
            self.state = "rolled back"
            self.acc.open_folds.discard(self)
            self.spill.seek(0)
            for name, start, n, wire in self.folded:
                nbytes = n * itemsize(wire)
                data = self.spill.read(nbytes)
                target = self.acc.sums[name][start : start + n]
                # its own temporary: a fold may still be writing ``scratch`` in another thread
                np.subtract(target, np.multiply(numpy_view(data, wire), self.weight, dtype=np.float64), out=target)
            self.folded.clear()
        self._release()

    def _release(self) -> None:
        self.scratch = np.empty(0, dtype=np.float64)
        self.acc.spills.release(self.spill)
