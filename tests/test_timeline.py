"""The client's phase timeline: the event a phase yields is the one it records."""

from __future__ import annotations

import math
import time

import pytest
from wafl.client.timeline import Timeline


def test_phase_yields_the_recorded_event() -> None:
    tl = Timeline()
    with tl.phase("gm_train", 3) as event:
        assert math.isnan(event.end_s)  # open until the block is left
        time.sleep(0.01)
    assert tl.events == [event]
    assert (event.phase, event.round) == ("gm_train", 3)
    assert event.duration_s == event.end_s - event.start_s >= 0.01


def test_phase_recorded_on_error_and_name_checked() -> None:
    tl = Timeline()
    with pytest.raises(RuntimeError), tl.phase("upload", 1):
        raise RuntimeError("lost")
    assert [e.phase for e in tl.events] == ["upload"] and tl.events[0].end_s >= tl.events[0].start_s
    with pytest.raises(ValueError, match="'train'"), tl.phase("train", 1):
        pass
