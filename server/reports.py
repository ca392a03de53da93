"""The clients' reports: each one checked (run, round, declared metrics, timeline) and recorded in the
run's results; the final ones (``final`` = 1) counted, since the run ends once every client sent its own."""

from __future__ import annotations

import asyncio
import math

from wafl.common import metrics as M
from wafl.common.config import RunConfig
from wafl.common.errors import Code, Refused
from wafl.common.proto import federation_pb2 as pb
from wafl.server.results import ResultsLog
from wafl.server.roster import Roster


class Reports:
    """Takes the reports of joined clients into ``results``; ``final_reported`` is set once every joined
    client sent its final report."""

    def __init__(self, cfg: RunConfig, roster: Roster, results: ResultsLog, run_id: str) -> None:
        self.cfg = cfg
        self.roster = roster
        self.results = results
        self.run_id = run_id
        self.final_reports: set[str] = set()
        self.final_reported = asyncio.Event()

    def report(self, req: pb.ReportRequest, credential: str = "") -> None:
        """Records one report; raises :class:`Refused` for a caller that is not that joined client or a
        report that does not fit this run."""
        self.roster.authorize(req.client_id, credential)
        if req.run_id != self.run_id:
            raise Refused(f"run_id {req.run_id[:64]!r} is not this run ({self.run_id!r})", Code.FAILED_PRECONDITION)
        if not 1 <= req.round <= self.cfg.federation.rounds:
            raise Refused(f"report round {req.round} is outside 1..{self.cfg.federation.rounds}")
        M.check(req.metrics, M.REPORT, "report")
        new = req.client_id in self.roster.new_clients
        wrong = M.PM_ACCURACY if new else M.NEW_CLIENT_ACCURACY
        if wrong in req.metrics:
            kind = "a new client (new_clients), which has no PM" if new else "a training client, not a new one"
            raise Refused(f"report metric {wrong!r}: client {req.client_id!r} is {kind}")
        _check_timeline(req, self.cfg.federation.rounds)
        timeline = [{"phase": e.phase, "round": e.round, "start_s": e.start_s, "end_s": e.end_s} for e in req.timeline]
        self.results.add_report(req.client_id, req.round, dict(req.metrics), timeline, req.client_start_unix or None)
        if req.metrics.get(M.FINAL, 0.0) == 1.0 and req.client_id not in self.final_reports:
            self.final_reports.add(req.client_id)
            if len(self.final_reports) >= len(self.roster.clients):
                self.final_reported.set()


def _check_timeline(req: pb.ReportRequest, rounds: int) -> None:
    """A report's timeline: known phases, rounds of this run, finite times; raises :class:`Refused`."""
    if not math.isfinite(req.client_start_unix) or req.client_start_unix < 0:
        raise Refused("client_start_unix must be a finite, non-negative number")
    for e in req.timeline:
        if e.phase not in M.PHASES:
            raise Refused(f"timeline phase {e.phase[:32]!r} is not one of {', '.join(M.PHASES)}")
        if not 0 <= e.round <= rounds + 1:
            raise Refused(f"timeline round {e.round} is outside 0..{rounds + 1}")
        if not (math.isfinite(e.start_s) and math.isfinite(e.end_s) and 0 <= e.start_s <= e.end_s):
            raise Refused("timeline times must be finite with 0 <= start_s <= end_s")
