"""OpenAtExit: what a run set up on the host is closed at exit, each object whatever the others do."""

from __future__ import annotations

import pytest
from wafl.cli.launch.at_exit import OpenAtExit


class Thing:
    def __init__(self, name: str, fails: bool = False) -> None:
        self.name, self.fails, self.closed = name, fails, 0

    def close(self) -> None:
        self.closed += 1
        if self.fails:
            raise OSError(f"{self.name} is busy")

    def __repr__(self) -> str:
        return self.name


def test_close_all_closes_what_is_still_open_and_goes_on_past_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    reg: OpenAtExit[Thing] = OpenAtExit("things")
    a, b, c = Thing("a"), Thing("b", fails=True), Thing("c")
    for t in (a, b, c):
        reg.add(t)
    reg.discard(c)  # closed by its owner: not closed again
    assert len(reg) == 2
    reg.close_all()
    assert (a.closed, b.closed, c.closed) == (1, 1, 0)
    assert "closing things b failed: b is busy" in capsys.readouterr().err
    for t in (a, b):
        reg.discard(t)  # the registry closes them at this process's exit otherwise
