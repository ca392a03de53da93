"""What every piece of the transport benchmark shares: the repository root, the unit, the log line."""

from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "transport.json"
MB = 1e6


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
