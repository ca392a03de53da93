"""The adaptive protocol's decision: how many PM steps a client trains before its upload, the rest after.

The model of a synchronous round, as client ``i`` sees it (docs/design.md, "The adaptive protocol"):
after its GM phase the client trains ``k`` PM steps of ``s`` seconds each (``P = k s``), uploads, and
trains its PM in the background (as wait-free) until the next broadcast stops it. ``V`` is that
background window: from the start of its upload (from its end under ``pm_yield_transfers``) to the
next broadcast's arrival (its header under ``pm_yield_transfers``). With ``F`` the window the
client would have if its upload closed the round (its upload ``U``, then the round's tail ``C``:
aggregation, broadcast, download; ``C`` alone under ``pm_yield_transfers``) and ``S`` its slack
(how much later its upload could end without closing the round later)::

    V = F + max(0, S - P)          V_free = F + S   (the window of an upload right after the GM)

so ``V + P = V_free`` in a round whose pre-upload PM stayed within the slack, and ``V + P = F + P >
V_free`` in one where it did not (it lengthened the round by ``P - S``). The client estimates

    V_free ~ min over its last WINDOW_ROUNDS rounds of (V + P)

exact when the other clients' times do not change, and an underestimate under noise (the
minimum), which errs towards training before the upload (the budget kept, the round longer).
The budget is ``B`` PM steps per round (``pm_epochs`` epochs, compute-and-wait's amount); the
decision::

    k = clamp(B - floor(V_free / s), 0, B)

trains before the upload only the part of the budget that the window after an immediate upload
would not hold. A client whose window holds its budget uploads first (wait-free); one off the
critical path trains the remainder within its slack where it fits (``P <= S``: the round is not
delayed); the last uploader on a fast link trains ``B s - F``, which lengthens the round by that
much: compute-and-wait's delay less ``F``. ``s`` is the median seconds per PM step of its last
:data:`STEP_SAMPLES` background PM phases: the rate at which the window holds steps, slower than a
step before the upload where the background PM shares the client's CPU with its upload or runs
at a lower priority (before any: of its pre-upload PM phases, then the GM's seconds per step, a
prior of the same model's cost). The first round, with no window measured, uploads first (``k = 0``): it
never delays the round, and with ``P = 0`` it measures ``V_free`` itself. ``B = 0``
(``pm_epochs = 0``) is wait-free.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

WINDOW_ROUNDS = 8  # rounds whose windows give V_free (a link or a load that changes is forgotten after as many)
STEP_SAMPLES = 5  # PM phases whose seconds per step give s


@dataclass(frozen=True)
class Decision:
    """One round's plan: ``pre_steps`` of the ``budget_steps`` before the upload; the rest of the PM after it."""

    round: int
    pre_steps: int
    budget_steps: int
    step_s: float | None  # s (None: not known yet)
    free_window_s: float | None  # V_free predicted (None: no window measured yet)
    rule: str  # which case decided: first-round, no-budget, window-holds-budget, pm-first


class AdaptivePlanner:
    """The per-client state of the rule in the module docstring; times in seconds."""

    def __init__(self, budget_steps: int, window_rounds: int = WINDOW_ROUNDS) -> None:
        if budget_steps < 0:
            raise ValueError(f"budget_steps={budget_steps} must be at least 0")
        self.budget_steps = budget_steps
        self.free_windows: deque[float] = deque(maxlen=window_rounds)  # V + P of the latest rounds with an upload
        self.pm_step_s: deque[float] = deque(maxlen=STEP_SAMPLES)  # the background PM's (after the upload)
        self.pre_step_s: deque[float] = deque(maxlen=STEP_SAMPLES)  # the pre-upload PM's
        self.gm_step_s: float | None = None

    def observe_gm(self, seconds: float, steps: int) -> None:
        if steps > 0 and seconds > 0:
            self.gm_step_s = seconds / steps

    def observe_pm(self, seconds: float, steps: int, background: bool = True) -> None:
        """A PM phase: ``background`` after the upload (the rate the window holds steps at), else before it."""
        if steps > 0 and seconds > 0:
            (self.pm_step_s if background else self.pre_step_s).append(seconds / steps)

    def observe_window(self, pre_s: float, window_s: float) -> None:
        """One round's pre-upload PM seconds ``P`` and its background window ``V``."""
        self.free_windows.append(max(0.0, window_s) + max(0.0, pre_s))

    @property
    def step_s(self) -> float | None:
        for samples in (self.pm_step_s, self.pre_step_s):
            if samples:
                return statistics.median(samples)
        return self.gm_step_s

    def decide(self, round: int) -> Decision:
        b, s = self.budget_steps, self.step_s
        if b == 0:
            return Decision(round, 0, 0, s, None, "no-budget")
        if not self.free_windows or s is None:
            return Decision(round, 0, b, s, None, "first-round")
        free = min(self.free_windows)
        k = min(b, max(0, b - math.floor(free / s)))
        return Decision(round, k, b, s, free, "pm-first" if k > 0 else "window-holds-budget")
