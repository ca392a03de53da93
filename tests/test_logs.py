"""The logging set-up: JSON lines to a file, events below the level dropped before any processing."""

import json
import logging
from pathlib import Path

import pytest
import structlog
from wafl.common.logs import configure_logging


@pytest.fixture(autouse=True)
def _restore_logging():
    """configure_logging replaces the root logger's handlers and level: put them back for the next tests."""
    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        if h not in handlers:
            h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    structlog.configure(**config)


def test_events_at_the_level_reach_the_file_as_json(tmp_path: Path) -> None:
    configure_logging("server", tmp_path / "server.log", level="INFO", console=False)
    structlog.get_logger("server").info("upload.accepted", round=3, bytes=618000)
    line = json.loads((tmp_path / "server.log").read_text().splitlines()[-1])
    assert line["event"] == "upload.accepted" and line["round"] == 3 and line["level"] == "info"
    assert line["timestamp"].endswith("Z")


def test_events_below_the_level_are_dropped_before_they_are_stamped(tmp_path: Path, monkeypatch) -> None:
    stamped: list[str] = []
    real = structlog.processors.TimeStamper.__call__

    def spy(self, logger, name, event_dict):  # type: ignore[no-untyped-def]
        stamped.append(event_dict["event"])
        return real(self, logger, name, event_dict)

    monkeypatch.setattr(structlog.processors.TimeStamper, "__call__", spy)
    configure_logging("client", tmp_path / "client.log", level="WARNING", console=False)
    log = structlog.get_logger("client")
    log.info("gm.trained", round=1)
    log.warning("upload.refused", round=1)
    assert stamped == ["upload.refused"]
    assert [json.loads(x)["event"] for x in (tmp_path / "client.log").read_text().splitlines()] == ["upload.refused"]
