"""Reading a run's records: its JSON-lines files (``results.jsonl``, ``reports.jsonl``, the logs),
``timelines.json`` and the training phases its clients logged."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Timelines = Mapping[str, Mapping[str, Any]]  # client id -> its timeline (``events``, ``client_start_unix``)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (``[]`` when missing)."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def read_timelines(path: Path) -> dict[str, Any]:
    """``timelines.json`` of a run (``{}`` when missing)."""
    return json.loads(path.read_text()) if path.exists() else {}


def trained_phases(logs: Path, event: str = "gm.trained") -> list[dict[str, Any]]:
    """Every client's ``gm.trained`` (or ``pm.trained``) log lines: steps, wall-clock and process CPU seconds."""
    return [r for f in sorted(logs.glob("client-*.jsonl")) for r in read_jsonl(f) if r.get("event") == event]


def timeline_events(timeline: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The phase events of one client's timeline in start order."""
    return sorted(timeline.get("events", []), key=lambda e: (e["start_s"], e["end_s"]))
