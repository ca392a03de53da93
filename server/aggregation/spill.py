"""Where an open upload's received chunks are kept until it ends (its rollback reads them back): in
memory while the server's :class:`RetainedBytes` budget (``rollback_memory_mb``, shared by every upload
in flight, at most ``rollback_upload_mb`` of it for one upload) has room, which costs no copy, and
beyond it in the upload's slot of an unlinked spill file (:class:`SpillArena`: one file per
accumulator, in the page cache, not the server's heap).
"""

from __future__ import annotations

import heapq
import os
import tempfile
import threading
from typing import IO

from wafl.common.config import FederationSection


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
        cls, mb: float = FederationSection.rollback_memory_mb, upload_mb: float = FederationSection.rollback_upload_mb
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
