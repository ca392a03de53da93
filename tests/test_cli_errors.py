"""Configuration and start-up mistakes: one precise error each, no silent coercion, retry limits
that hold."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from wafl.cli.main import build_parser
from wafl.client.session import Backoff
from wafl.common.config import ConfigError, load_config


@pytest.mark.parametrize(
    "text, match",
    [
        ('rounds = "5"\n', "rounds='5' is not a valid int"),
        ("fraction = true\n", "fraction=True is not a valid float"),
        ("checkpoint = 1\n", "checkpoint=1 is not a valid bool"),
        ("num_clients = 2.5\n", "num_clients=2.5 is not a valid int"),
        ("dataset = 3\n", "dataset=3 is not a valid str"),
        ("weight_decay = inf\n", "weight_decay=inf must lie in"),
    ],
)
def test_values_of_the_wrong_type_are_refused(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(f)


def test_files_that_are_not_configurations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe rounds = 1")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a table of fields"):
        load_config(lst)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)  # a folder


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_ports_out_of_range_are_refused(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["server", "--port", port])
    assert e.value.code == 2
    assert "--port" in capsys.readouterr().err.strip().splitlines()[-1]


def test_retry_limit_counts_from_the_first_failure() -> None:
    async def go() -> float:
        b = Backoff(base_s=0.01, cap_s=0.02, deadline_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="gave up after"):
            while True:
                await asyncio.sleep(0.05)  # the attempt itself takes time too
                await b.wait("test")
        return time.monotonic() - t0

    assert asyncio.run(go()) >= 0.2
