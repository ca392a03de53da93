"""The plateau rule: a run stops once the accuracy it watches has flattened (``plateau_window``).

With ``plateau_window = W`` rounds and ``plateau_delta = D`` points, at the end of round ``r`` the server
looks at the watched accuracy ``a(t)`` of the rounds ``t`` up to ``n = r - lag`` that were evaluated::

    recent = mean of a(t) over the evaluated t in (n - W, n]
    before = mean of a(t) over the evaluated t in (n - 2W, n - W]
    gap    = recent - before                  (fractions; the results line's plateau_gap is 100 * gap)
    flat   = 100 * |gap| <= D                 (defined when n >= 2W and both windows hold a value)

and, when ``flat``, ends the run after round ``r`` as it ends after the last one (the final model goes to
every client: version ``r + 1``, as version ``rounds + 1`` ends a run that reaches its maximum, so the
clients' final reports and the new clients' adaptation name round ``r``); ``rounds`` is the maximum. The
round's results line then says ``stop_reason = "plateau"``; the last round's line says ``"max_rounds"``
when the rule did not hold there either.

Choices the issue (52) leaves open, made here:

* The windows are counted in rounds, not in evaluations: with ``eval_every = E`` each window holds the
  W/E or so rounds that were evaluated (``eval_every`` must lie in 1..W, so that each holds one), and
  the last ``2W`` rounds before the maximum are evaluated every round (:meth:`RunConfig.evaluates`).
* The rule is checked only at the end of an evaluated round, so that the run's last model is always
  evaluated. Between two evaluations the windows hold the same values, so nothing is missed.
* ``lag``: the GM's accuracy of round ``r`` is known when round ``r`` closes (``lag = 0``); a personalized
  model's (PM) accuracy of round ``r`` comes in the clients' reports after the next broadcast, and the
  results line of round ``r - 1`` is the newest one the server has certainly written when round ``r``
  closes (``ResultsLog.close_before``), so the PM rule looks one round back (``lag = 1``). The decision
  is then a function of the written lines only, the same on every re-run that writes the same lines.
* "Within D points" is ``|gap| <= D``: a curve that falls by more than D points a window goes on.
* ``plateau_metric = "auto"`` watches ``pm_accuracy`` for a method with a personalized model (a personal
  phase, or a local model that is the personal one) and ``gm_accuracy`` otherwise.
* A run resumed from a checkpoint (``--resume``) reads the watched values of the rounds its checkpoint
  holds back from its ``results.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wafl.common.algorithms.base import Algorithm
    from wafl.common.config import RunConfig

GM, PM = "gm_accuracy", "pm_accuracy"
METRICS = ("auto", GM, PM)  # plateau_metric's values
PLATEAU, MAX_ROUNDS = "plateau", "max_rounds"  # stop_reason's values


def watched_metric(metric: str, algorithm: Algorithm) -> str:
    """The results field ``plateau_metric`` watches for ``algorithm`` (``auto``: the PM where it has one)."""
    if metric != "auto":
        return metric
    return PM if algorithm.personal != "none" else GM


def gap(values: Mapping[int, float], newest: int, window: int) -> float | None:
    """``recent - before`` (module docstring) over ``values`` (round -> watched accuracy, evaluated rounds
    only) for the windows that end at round ``newest``; None where it is not defined."""
    if window < 1 or newest < 2 * window:
        return None
    recent = [values[t] for t in range(newest - window + 1, newest + 1) if t in values]
    before = [values[t] for t in range(newest - 2 * window + 1, newest - window + 1) if t in values]
    if not recent or not before:
        return None
    return sum(recent) / len(recent) - sum(before) / len(before)


def flat(g: float, delta: float) -> bool:
    """Whether a gap (fractions) lies within ``delta`` points."""
    return 100.0 * abs(g) <= delta


def ran_to_end(rows: Sequence[Mapping[str, Any]], rounds: int) -> bool:
    """Whether a run's results lines reach its end: ``rounds`` lines, or a last line that stopped on the plateau."""
    return len(rows) == rounds or (bool(rows) and rows[-1].get("stop_reason") == PLATEAU)


class PlateauWatch:
    """The engine's side of the rule: it collects the watched accuracy round by round and says, at the
    end of each round, what the round's results line records and whether the run stops there."""

    def __init__(self, window: int, delta: float, metric: str, rounds: int) -> None:
        self.window = window
        self.delta = delta
        self.metric = metric
        self.lag = 1 if metric == PM else 0
        self.rounds = rounds
        self.values: dict[int, float] = {}
        self.stop = False

    @classmethod
    def of(
        cls,
        cfg: RunConfig,
        algorithm: Algorithm,
        listeners: list[Callable[[dict[str, Any]], None]],
        resumed_from: Path | None = None,
        resumed_through: int = 0,
    ) -> PlateauWatch | None:
        """The watch of a run whose configuration enables the rule (None otherwise). A PM watch listens
        to the results lines as they are written (``listeners``); a resumed run reads the lines of the
        rounds up to ``resumed_through`` back from ``resumed_from`` (its ``results.jsonl``)."""
        if not cfg.plateau_window:
            return None
        watch = cls(cfg.plateau_window, cfg.plateau_delta, watched_metric(cfg.plateau_metric, algorithm), cfg.rounds)
        if resumed_from is not None and resumed_from.is_file():
            for line in resumed_from.read_text().splitlines():
                if line.strip() and int((row := json.loads(line)).get("round", 0)) <= resumed_through:
                    watch.row(row)
        if watch.metric == PM:
            listeners.append(watch.row)
        return watch

    def row(self, row: Mapping[str, Any]) -> None:
        """A results line: its watched accuracy, if it has one, joins the values."""
        v = row.get(self.metric)
        if v is not None:
            self.values[int(row["round"])] = float(v)

    def end_of_round(self, r: int, gm: float | None, evaluated: bool, last: bool) -> dict[str, Any]:
        """Round ``r`` closed (its GM accuracy ``gm``, None where not evaluated; ``last``: the maximum was
        reached): the fields its results line gets (``plateau_gap`` in points where the rule was checked,
        ``stop_reason`` where the run ends). Sets :attr:`stop` when the rule holds."""
        if self.metric == GM and gm is not None:
            self.values[r] = gm
        fields: dict[str, Any] = {}
        if evaluated:
            g = gap(self.values, r - self.lag, self.window)
            if g is not None:
                fields["plateau_gap"] = round(100.0 * g, 6)
                self.stop = flat(g, self.delta)
        if self.stop or last:
            fields["stop_reason"] = PLATEAU if self.stop else MAX_ROUNDS
        return fields
