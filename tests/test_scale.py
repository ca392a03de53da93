"""The scale benchmark's machinery (``benchmarks/scale.py``) at a small size: the load generator
built from the .proto alone against the real server and the bare ``grpc.aio`` server, with
held round-1 uploads at participation 1.0; no errors, every upload and final report arrives,
and at participation 0.2 unselected clients are sent no model (FedAvg trains nothing on it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from independent_client import REPO


def load_scale():
    spec = importlib.util.spec_from_file_location("wafl_bench_scale", REPO / "benchmarks" / "scale.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wafl_bench_scale"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fleet_of_lightweight_clients_finishes_without_errors(tmp_path: Path) -> None:
    scale = load_scale()
    full = scale.fleet(50, 1.0, 2, 2, tmp_path / "full")
    for kind in ("real", "bare"):
        run = full[kind]
        view = run["clients_view"]
        assert run["ok"], run
        assert view["errors"] == 0 and view["codes"] == {}, view
        assert view["uploads"] == view["expected_uploads"] == 100 and view["final_reports"] == 50
        assert run["memory"]["in_flight_uploads"] == 50 and run["memory"]["idle_clients"] == 49
    assert full["real"]["results_clients"] == [50, 50]
    assert full["cost_ratio"] > 0
    sparse = scale.fleet(40, 0.2, 2, 1, tmp_path / "sparse", bare=False)["real"]
    assert sparse["ok"], sparse
    view = sparse["clients_view"]
    assert view["uploads"] == view["expected_uploads"] == 16
    # each selected client got the model it trained on, every client the final one, nobody else anything
    assert view["models"] == 16 + 40
    assert "| 50 | 1.0 | 2 | 0 / 0 | 100 of 100 |" in scale.table([full])
    assert set(full["real"]["cpu"]["per_upload_ms_by_thread"]) == {"event_loop", "grpc_core", "other_threads"}
