"""``--link-rate``: a federation over tbf-shaped veth links, and the refusal when shaping is unavailable."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from wafl.cli.launch import netns
from wafl.cli.launch.netns import LinkShapingUnavailable
from wafl.cli.main import main

RATE = "20mbit"
RATE_BPS = 20_000_000


def _shaping_unavailable() -> str | None:
    try:
        netns.check_permissions()
    except LinkShapingUnavailable as e:
        return e.message
    return None


def _upload_spans(timelines: dict[str, Any]) -> list[tuple[float, float]]:
    """Every upload phase on one clock: ``(start, end)``."""
    return sorted(
        (tl["client_start_unix"] + e["start_s"], tl["client_start_unix"] + e["end_s"])
        for tl in timelines.values()
        for e in tl["events"]
        if e["phase"] == "upload"
    )


@pytest.mark.system
@pytest.mark.slow
def test_uploads_over_shaped_links_take_bytes_over_rate(tmp_path: Path) -> None:
    reason = _shaping_unavailable()
    if reason:
        pytest.skip(reason)
    from wafl.cli.launch.hosts import parse_hosts
    from wafl.cli.launch.launcher import launch
    from wafl.common.config import load_config

    cfg = load_config(
        None, {"dataset": "digits", "algorithm": "fedavg", "num_clients": 3, "rounds": 2, "local_epochs": 1, "seed": 0}
    )
    summary = launch(
        cfg, tmp_path / "run", hosts=parse_hosts(cfg, link_rate=RATE), show_progress=False, timeout_s=600.0
    )
    assert summary.ok, (tmp_path / "run" / "logs" / "server.log").read_text()[-2000:]
    rows = summary.rows
    assert [r["clients"] for r in rows] == [3, 3]
    per_upload = rows[0]["bytes_up"] / rows[0]["clients"]
    assert 500_000 < per_upload < 800_000  # the digits CNN, ~0.62 MB

    timelines = json.loads((tmp_path / "run" / "timelines.json").read_text())
    assert len(timelines) == 3
    spans = _upload_spans(timelines)
    assert len(spans) == 6
    # Each upload crosses its client's own shaped link (the server's carries the clients' sum, so
    # uploads at once do not queue): none can beat bytes / rate by more than the token bucket
    # allows, and the typical (median) one must agree with it within a factor of 2.
    expected = per_upload * 8 / RATE_BPS
    ratios = []
    for start, end in spans:
        ratios.append((end - start) / expected)
        assert end - start >= expected / 2, (
            f"an upload of {per_upload:.0f} B took {end - start:.3f}s, faster than {RATE} allows ({expected:.3f}s)"
        )
    assert 0.5 <= statistics.median(ratios) <= 2.0, (
        f"measured / (bytes / rate) per upload: {[round(r, 2) for r in ratios]}"
    )


def _as_non_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)


@pytest.mark.parametrize("command", [["run"], ["bench", "protocols"]])
def test_link_rate_without_root_exits_77_with_a_message(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _as_non_root(monkeypatch)
    out = tmp_path / "out"
    code = main(
        [
            *command,
            "--dataset",
            "digits",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--link-rate",
            RATE,
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == LinkShapingUnavailable.exit_code == 77
    err = capsys.readouterr().err
    assert "link shaping unavailable" in err and "root" in err and "--link-rate" in err
    assert not list(out.rglob("results.jsonl"))  # nothing was started


def test_link_rate_when_tc_is_unusable_exits_77(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse() -> None:
        raise LinkShapingUnavailable("link shaping unavailable: tc tbf does not work (sch_tbf missing?)")

    monkeypatch.setattr(netns, "check_permissions", refuse)
    code = main(
        [
            "run",
            "--dataset",
            "digits",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--link-rate",
            RATE,
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    assert code == 77
    assert "sch_tbf" in capsys.readouterr().err
