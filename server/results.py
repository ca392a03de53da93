"""The run's record: ``results.jsonl`` (one line per round), ``reports.jsonl``, ``timelines.json``.

``timelines.json`` is written once, at the end of the run (:meth:`ResultsLog.write_timelines`):
each client sends its timeline in its final Report, and rewriting the file for every one of them
would cost the server time quadratic in the clients.

A round's line is written once the clients that trained in it have reported their
personalized-model accuracy for it (they evaluate right after the broadcast that closes the
round), or when the next round closes, whichever comes first; lines stay in round order. With
``latest_pm`` (buffered aggregation, where clients train on different versions at once) a line
does not wait and its ``pm_accuracy`` is the mean of every client's latest report. With
``new_clients`` a line also has ``new_client_accuracy`` (the new clients' accuracies on their
local test sets after adapting that round's global model, weighted by test-set size; null where
the round was not evaluated) and ``new_client_accuracies`` (client id -> accuracy), and an
evaluated round's line waits for those reports too.

A line's ``round`` keeps its name for every aggregation rule: under sync it is the round, whose
clients trained on version ``round``; under buffered aggregation and FedAsync it is the model
version the line's collection was built from (the version it published is its ``version``
column). Reports name the same number.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from wafl.common import metrics as M
from wafl.common.jsonsafe import dumps


class ResultsLog:
    """Writes ``results.jsonl`` and ``reports.jsonl`` (module docstring): one line per aggregation,
    keyed by its ``round`` (under buffered aggregation, a model version)."""

    def __init__(self, out_dir: Path, run_start: float, latest_pm: bool = False, new_clients: bool = False) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.results_path = out_dir / "results.jsonl"
        self.reports_path = out_dir / "reports.jsonl"
        self.run_start = run_start
        self.pending: dict[int, tuple[dict[str, Any], set[str]]] = {}
        self.reports: dict[int, dict[str, tuple[float, int]]] = {}  # round -> client -> (pm_acc, n_test)
        self.latest_pm = latest_pm
        self.latest: dict[str, tuple[float, int]] = {}  # client -> its latest (pm_acc, n_test)
        self.new_clients = new_clients
        self.new_reports: dict[int, dict[str, tuple[float, int]]] = {}  # round -> new client -> (acc, n_test)
        self.timelines: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # called with every line written

    def add_round(self, row: dict[str, Any], expected_reports: set[str]) -> None:
        self.pending[row["round"]] = (row, set(expected_reports))
        self._flush()

    def add_report(
        self,
        client_id: str,
        round: int,
        metrics: dict[str, float],
        timeline: list[dict[str, Any]] | None = None,
        client_start_unix: float | None = None,
    ) -> None:
        now = time.monotonic() - self.run_start
        with self.reports_path.open("a") as f:
            f.write(
                dumps(
                    {
                        "client": client_id,
                        "round": round,
                        "t_s": round_(now),
                        **{k: round_(v) for k, v in metrics.items()},
                    }
                )
                + "\n"
            )
        if M.PM_ACCURACY in metrics:
            self.add_pm(round, client_id, metrics[M.PM_ACCURACY], int(metrics.get(M.PM_TEST_SAMPLES, 1)))
        if M.NEW_CLIENT_ACCURACY in metrics:
            n_test = int(metrics.get(M.NEW_CLIENT_TEST_SAMPLES, 1))
            self.new_reports.setdefault(round, {})[client_id] = (metrics[M.NEW_CLIENT_ACCURACY], n_test)
        if timeline:
            self.timelines[client_id] = {"client_start_unix": client_start_unix, "events": timeline}
        self._flush()

    def write_timelines(self, timelines: dict[str, Any]) -> None:
        """Writes ``timelines.json`` (every client's latest timeline); once, at the end of the run, from a worker
        thread: ``timelines`` is a copy of :attr:`timelines` taken on the event loop, whose report handlers may
        still add a late client's timeline meanwhile."""
        if timelines:
            (self.out_dir / "timelines.json").write_text(dumps(timelines, indent=1))

    def add_pm(self, round: int, client_id: str, accuracy: float, test_samples: int) -> None:
        self.reports.setdefault(round, {})[client_id] = (accuracy, test_samples)
        self.latest[client_id] = (accuracy, test_samples)

    def pm_accuracy(self, round: int) -> float | None:
        got = self.latest if self.latest_pm else self.reports.get(round)
        return weighted_mean((k, a) for a, k in (got or {}).values())

    def close_before(self, round: int) -> None:
        """Writes every pending line of a round earlier than ``round`` (its reports are late)."""
        for r in sorted(self.pending):
            if r < round:
                self.pending[r] = (self.pending[r][0], set())
        self._flush()

    def state_dict(self) -> dict[str, Any]:
        """The lines not yet written, as plain values: each with the reports it waits for, the reports of its
        round that came in, and every client's latest report (a snapshot between two versions, from which an
        in-process run resumes: :mod:`wafl.cli.sim.resume`)."""
        rounds = sorted(self.pending)
        return {
            "pending": [[r, self.pending[r][0], sorted(self.pending[r][1])] for r in rounds],
            "reports": [[r, _pairs(self.reports.get(r, {}))] for r in rounds],
            "new_reports": [[r, _pairs(self.new_reports.get(r, {}))] for r in rounds],
            "latest": _pairs(self.latest),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes :meth:`state_dict` back, in a log whose ``results.jsonl`` holds the lines written when it was
        taken (and no more); those lines become :attr:`rows` again (their listeners are not called)."""
        self.pending = {int(r): (dict(row), set(expected)) for r, row, expected in state["pending"]}
        self.reports = {int(r): _unpairs(got) for r, got in state["reports"] if got}
        self.new_reports = {int(r): _unpairs(got) for r, got in state["new_reports"] if got}
        self.latest = _unpairs(state["latest"])
        text = self.results_path.read_text() if self.results_path.exists() else ""
        self.rows = [json.loads(line) for line in text.splitlines() if line.strip()]

    def _flush(self) -> None:
        for r in sorted(self.pending):
            row, expected = self.pending[r]
            new = self.new_reports.get(r, {})
            if not expected.issubset(set(self.reports.get(r, {})) | set(new)):
                break  # keep order: a later round waits for this one
            del self.pending[r]
            row["pm_accuracy"] = round_(self.pm_accuracy(r))
            row["pm_reports"] = len(self.reports.get(r, {}))
            if self.new_clients:
                row["new_client_accuracy"] = round_(weighted_mean((n, a) for a, n in new.values()))
                row["new_client_accuracies"] = {c: round_(a) for c, (a, _) in sorted(new.items())}
            self.rows.append(row)
            for listener in self.listeners:
                listener(row)
            with self.results_path.open("a") as f:
                f.write(dumps(row) + "\n")


def _pairs(got: dict[str, tuple[float, int]]) -> dict[str, list[float | int]]:
    return {c: [a, n] for c, (a, n) in got.items()}


def _unpairs(got: dict[str, list[Any]]) -> dict[str, tuple[float, int]]:
    return {str(c): (float(a), int(n)) for c, (a, n) in got.items()}


def weighted_mean(pairs: Iterable[tuple[float, float]]) -> float | None:
    """``sum(w * v) / sum(w)`` over ``(w, v)`` pairs (accuracies weighted by test-set sizes); None
    when there are none or their weights sum to 0."""
    got = list(pairs)
    n = sum(w for w, _ in got)
    return sum(w * v for w, v in got) / n if n else None


def round_(v: float | None, digits: int = 6) -> float | None:
    """``v`` rounded to ``digits``; None for None and for non-finite values."""
    return None if v is None or not math.isfinite(v) else round(float(v), digits)
