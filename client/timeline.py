"""A client's phase timeline (gm_train, upload, pm_train, idle, evaluate, slowdown, offline) on a monotonic clock."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from wafl.common.metrics import PHASES


@dataclass
class PhaseEvent:
    phase: str
    round: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.start_unix = time.time()
        self.events: list[PhaseEvent] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    @contextlib.contextmanager
    def phase(self, name: str, round: int) -> Iterator[PhaseEvent]:
        """Records the phase on exit; the event it yields has its end (and so its duration) once the block is left."""
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        event = PhaseEvent(name, round, self.now(), math.nan)
        try:
            yield event
        finally:
            event.end_s = self.now()
            self.events.append(event)
