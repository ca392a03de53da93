"""A client's phase timeline (gm_train, upload, pm_train, idle, evaluate, slowdown, offline) on a monotonic clock."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

PHASES = ("gm_train", "upload", "pm_train", "idle", "evaluate", "slowdown", "offline")


@dataclass
class PhaseEvent:
    phase: str
    round: int
    start_s: float
    end_s: float


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.start_unix = time.time()
        self.events: list[PhaseEvent] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    @contextlib.contextmanager
    def phase(self, name: str, round: int) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        start = self.now()
        try:
            yield
        finally:
            self.events.append(PhaseEvent(name, round, start, self.now()))
