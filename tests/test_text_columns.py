"""The benches' text summaries: one column per run, one line per key, missing values as the formatter says."""

from __future__ import annotations

from typing import Any

from wafl.cli.report.text_columns import key_lines


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def test_key_lines_put_each_run_in_a_right_aligned_column_under_its_name() -> None:
    runs = {"sync": {"total_s": 12.5, "versions": 10}, "buffered": {"total_s": 3.25}}
    lines = key_lines(runs, ["versions", "total_s"], _fmt, 9, 10)
    assert lines == [
        " " * 9 + "      sync  buffered",
        "versions " + "        10" + "         -",
        "total_s  " + "     12.50" + "      3.25",
    ]
