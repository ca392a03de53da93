"""How the benchmark's child processes end with it: a death signal for exec'd servers, a watchdog and
an orphan-aware queue read for spawned workers."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from typing import Any


def die_with_parent() -> None:
    """In a child about to exec: receive SIGTERM if the benchmark process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def orphan_watchdog() -> None:
    """In a spawned child: exit at once (skipping interpreter teardown) if the benchmark dies."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="orphan-watchdog").start()


def get_or_orphaned(q: Any, parent: int) -> Any:
    """``q.get()`` that gives up (returns None) once the process that started us is gone."""
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None
