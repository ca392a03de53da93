"""What a run set up on the host (network namespaces, control groups) and must take down even when the
launcher exits without closing it: each kind keeps its open objects in an :class:`OpenAtExit`, which closes
those still open when the interpreter exits."""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closable)


class OpenAtExit(Generic[T]):
    """The open objects of one kind (``what`` names it in a failed close's message); registered with
    :mod:`atexit` when made."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._open: set[T] = set()
        self._lock = threading.Lock()
        atexit.register(self.close_all)

    def add(self, obj: T) -> None:
        with self._lock:
            self._open.add(obj)

    def discard(self, obj: T) -> None:
        with self._lock:
            self._open.discard(obj)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def close_all(self) -> None:
        """Closes every object still open, each whatever the others do (best effort at interpreter exit)."""
        with self._lock:
            objs = list(self._open)
        for obj in objs:
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - the next one is closed all the same
                print(f"wafl.cli.launch: closing {self.what} {obj!r} failed: {exc}", file=sys.stderr)
