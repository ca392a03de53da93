"""The plateau rule: a run stops once the accuracy it watches has flattened (``plateau_window``).

With ``plateau_window = W`` rounds and ``plateau_delta = D`` points, at the end of round ``r`` the server
looks at the watched accuracy ``a(t)`` of the rounds ``t`` up to ``n = r - lag`` that were evaluated::

    recent = mean of a(t) over the evaluated t in (n - W, n]
    before = mean of a(t) over the evaluated t in (n - 2W, n - W]
    gap    = recent - before                  (fractions; the results line's plateau_gap is 100 * gap)
    se     = sqrt(var(recent) / len(recent) + var(before) / len(before))    (sample variances)
    flat   = 100 * (|gap| + z * se) <= D      (defined when n >= 2W and both windows hold a value;
                                               with z > 0, two values each)

and, when ``flat`` (for each watched accuracy, below), ends the run after round ``r`` as it ends after the
last one (the final model goes to every client: version ``r + 1``, as version ``rounds + 1`` ends a run
that reaches its maximum, so the clients' final reports and the new clients' adaptation name round ``r``);
``rounds`` is the maximum. The round's results line then says ``stop_reason = "plateau"``; the last
round's line says ``"max_rounds"`` when the rule did not hold there either.

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
* ``plateau_z = z`` (default 0: the plain rule above) asks for ``|gap|`` to lie within D with room for its
  noise: the rule holds when ``|gap|`` plus z standard errors is within D, so ``z = 1.645`` makes D a
  one-sided 95 % bound on the gain from one window to the next. At 10 % participation a GM's accuracy
  moves 1-2 points from round to round, and the plain rule with W = 10 stopped FedAvg curves that still
  gained 0.1-0.25 points a round (``docs/measurements/real-data.md``): two 10-round means fall within
  0.3 points of each other by chance. ``se`` takes each window's spread about its own mean, so a window
  on a rising curve counts its rise as noise too, which only delays the stop.
* ``plateau_metric = "auto"`` watches every accuracy the method's tables report: ``gm_accuracy`` where its
  global model is evaluated and ``pm_accuracy`` where it has a personalized model (a personal phase, or a
  local model that is the personal one), and ends the run once each of them has flattened, at the first
  evaluated round where the rule holds for all of them at once (each with its own lag). A method with both
  models (SCD, Ditto, FedHKD, ...) is watched on both: its PM flattens tens of rounds before its GM, and a
  rule that watched the PM alone stopped SCD at round 87 with its GM still gaining about 1.4 points every
  10 rounds, so that the tables' GM verdicts compared a rising GM with a flat one. The results lines of a
  run that watches two accuracies name each one's gap (``plateau_gap_gm``, ``plateau_gap_pm``; and
  ``plateau_se_gm``, ``plateau_se_pm`` under ``plateau_z``); a run that watches one writes ``plateau_gap``
  (and ``plateau_se``). ``gm_accuracy`` or ``pm_accuracy`` watches that one alone.
* A run resumed from a checkpoint (``--resume``) reads the watched values of the rounds its checkpoint
  holds back from its ``results.jsonl``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from wafl.common.choices import PlateauMetric

if TYPE_CHECKING:
    from wafl.common.algorithms.base import Algorithm

GM, PM = PlateauMetric.GM_ACCURACY.value, PlateauMetric.PM_ACCURACY.value  # the results fields watched
METRICS = tuple(m.value for m in PlateauMetric)  # plateau_metric's values
PLATEAU, MAX_ROUNDS = "plateau", "max_rounds"  # stop_reason's values


class PlateauFields(Protocol):
    """The evaluation section's fields of the rule (a :class:`~wafl.common.config.EvaluationSection`)."""

    @property
    def plateau_window(self) -> int: ...
    @property
    def plateau_delta(self) -> float: ...
    @property
    def plateau_z(self) -> float: ...
    @property
    def plateau_metric(self) -> str: ...


class PlateauRounds(Protocol):
    """The federation section's field of the rule, the maximum (a :class:`~wafl.common.config.FederationSection`)."""

    @property
    def rounds(self) -> int: ...


class PlateauSettings(Protocol):
    """The sections of the run configuration the rule reads (a :class:`~wafl.common.config.RunConfig` has them)."""

    @property
    def evaluation(self) -> PlateauFields: ...
    @property
    def federation(self) -> PlateauRounds: ...


def watched_metrics(metric: str, algorithm: Algorithm) -> tuple[str, ...]:
    """The results fields ``plateau_metric`` watches for ``algorithm``: the one named, or under ``auto`` the GM's
    accuracy where its global model is evaluated and the PM's where it has a personalized model."""
    if metric != PlateauMetric.AUTO:
        return (str(metric),)
    return (GM,) * bool(algorithm.evaluates_global) + (PM,) * (algorithm.personal != "none")


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


def gap_se(values: Mapping[int, float], newest: int, window: int) -> float | None:
    """The standard error of :func:`gap` (module docstring), fractions; None where a window holds fewer
    than two values."""
    if window < 1 or newest < 2 * window:
        return None
    total = 0.0
    for lo in (newest - window + 1, newest - 2 * window + 1):
        xs = [values[t] for t in range(lo, lo + window) if t in values]
        if len(xs) < 2:
            return None
        m = sum(xs) / len(xs)
        total += sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)
    return math.sqrt(total)


def flat(g: float, delta: float, se: float | None = 0.0, z: float = 0.0) -> bool:
    """Whether a gap (fractions) lies within ``delta`` points, with room for ``z`` of its standard errors
    ``se`` (fractions; None: unknown, so the rule cannot hold when ``z > 0``)."""
    if not z:
        return 100.0 * abs(g) <= delta
    return se is not None and 100.0 * (abs(g) + z * se) <= delta


def ran_to_end(rows: Sequence[Mapping[str, Any]], rounds: int) -> bool:
    """Whether a run's results lines reach its end: ``rounds`` lines, or a last line that stopped on the plateau."""
    return len(rows) == rounds or (bool(rows) and rows[-1].get("stop_reason") == PLATEAU)


class Watched:
    """One watched accuracy: its results field, the rounds it looks back (``lag``, module docstring) and its
    values so far (round -> accuracy, evaluated rounds only)."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.lag = 1 if metric == PM else 0
        self.values: dict[int, float] = {}

    def check(self, r: int, window: int, z: float) -> tuple[float | None, float | None]:
        """The gap of the windows that end at round ``r - lag`` (fractions; None where not defined) and, under
        ``z``, its standard error."""
        newest = r - self.lag
        g = gap(self.values, newest, window)
        return g, (gap_se(self.values, newest, window) if z and g is not None else None)


class PlateauWatch:
    """The engine's side of the rule: it collects the watched accuracies round by round and says, at the
    end of each round, what the round's results line records and whether the run stops there (once every
    watched accuracy has flattened)."""

    def __init__(self, window: int, delta: float, metrics: Sequence[str], rounds: int, z: float = 0.0) -> None:
        if not metrics:
            raise ValueError("a plateau watch needs at least one accuracy to watch")
        self.window = window
        self.delta = delta
        self.z = z
        self.watched = [Watched(m) for m in metrics]
        self.rounds = rounds
        self.stop = False

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(w.metric for w in self.watched)

    def values(self, metric: str) -> dict[int, float]:
        """The values collected so far of the watched ``metric`` (round -> accuracy)."""
        return next(w.values for w in self.watched if w.metric == metric)

    @classmethod
    def of(
        cls,
        cfg: PlateauSettings,
        algorithm: Algorithm,
        listeners: list[Callable[[dict[str, Any]], None]],
        resumed_from: Path | None = None,
        resumed_through: int = 0,
    ) -> PlateauWatch | None:
        """The watch of a run whose configuration enables the rule (None otherwise). A watch of the PM listens
        to the results lines as they are written (``listeners``); a resumed run reads the lines of the
        rounds up to ``resumed_through`` back from ``resumed_from`` (its ``results.jsonl``)."""
        ev = cfg.evaluation
        if not ev.plateau_window:
            return None
        metrics = watched_metrics(ev.plateau_metric, algorithm)
        watch = cls(ev.plateau_window, ev.plateau_delta, metrics, cfg.federation.rounds, ev.plateau_z)
        if resumed_from is not None and resumed_from.is_file():
            for line in resumed_from.read_text().splitlines():
                if line.strip() and int((row := json.loads(line)).get("round", 0)) <= resumed_through:
                    watch.row(row)
        if PM in metrics:
            listeners.append(watch.row)
        return watch

    def row(self, row: Mapping[str, Any]) -> None:
        """A results line: its watched accuracies, where it has them, join the values."""
        for w in self.watched:
            v = row.get(w.metric)
            if v is not None:
                w.values[int(row["round"])] = float(v)

    def end_of_round(self, r: int, gm: float | None, evaluated: bool, last: bool) -> dict[str, Any]:
        """Round ``r`` closed (its GM accuracy ``gm``, None where not evaluated; ``last``: the maximum was
        reached): the fields its results line gets (each watched accuracy's gap in points where the rule was
        checked, with its standard error under ``plateau_z``: ``plateau_gap`` and ``plateau_se`` for a watch of
        one accuracy, ``plateau_gap_gm``, ``plateau_gap_pm``, ... for a watch of several; ``stop_reason`` where
        the run ends). Sets :attr:`stop` when the rule holds for every watched accuracy."""
        fields: dict[str, Any] = {}
        flats = []
        for w in self.watched:
            if w.metric == GM and gm is not None:
                w.values[r] = gm
            g, se = w.check(r, self.window, self.z) if evaluated else (None, None)
            flats.append(g is not None and flat(g, self.delta, se, self.z))
            if g is not None:
                suffix = "" if len(self.watched) == 1 else "_" + w.metric.removesuffix("_accuracy")
                fields["plateau_gap" + suffix] = round(100.0 * g, 6)
                if se is not None:
                    fields["plateau_se" + suffix] = round(100.0 * se, 6)
        if evaluated:
            self.stop = all(flats)
        if self.stop or last:
            fields["stop_reason"] = PLATEAU if self.stop else MAX_ROUNDS
        return fields
