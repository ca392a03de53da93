"""Configuration and start-up mistakes: one precise error each, no silent coercion, retry limits
that hold."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

import pytest
from wafl.cli.main import build_parser, main
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


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", "--rounds", "abc"], "argument --rounds: invalid int value: 'abc'"),
        (["run", "--timeout", "-5"], "argument --timeout: '-5' must be > 0"),
        (["run", "--timeout", "nan"], "argument --timeout: 'nan' must be > 0"),
        (["server", "--threads", "0"], "argument --threads: '0' must be >= 1"),
        (["client", "--index", "-1"], "argument --index: '-1' must be >= 0"),
        (["client", "--index", "0", "--reconnect-s", "-1"], "argument --reconnect-s: '-1' must be >= 0"),
        (["health", "--timeout", "0"], "argument --timeout: '0' must be > 0"),
        (["no-such-command"], "invalid choice: 'no-such-command'"),
    ],
)
def test_command_line_mistakes_are_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and fragment in err and "--help" in err, err


def test_start_up_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dataset whose files are missing, an output folder that cannot be created: exit 2 before any process."""
    cases = [
        (["run", "--dataset", "cifar10", "--out", str(tmp_path / "a")], "--data-dir is required"),
        (["run", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--out", str(tmp_path / "b")], "missing"),
        (["run", "--out", "/proc/no/such/folder"], "--out /proc/no/such/folder cannot be created"),
    ]
    for argv, fragment in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("wafl: ") and fragment in err, err


def test_an_unreachable_server_is_named_within_the_retry_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """--reconnect-s bounds the whole join, its first attempt included, and the error says why."""
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["client", "--index", "0", "--server", f"127.0.0.1:{port}", "--reconnect-s", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Connection refused" in err, err
    given_up = re.search(r"gave up after (\d+) s", err)
    assert given_up and int(given_up.group(1)) < 10, err  # the join's 10 s attempt no longer outlasts the limit


def test_a_run_past_its_timeout_ends_in_one_line(tmp_path: Path) -> None:
    """``wafl run --timeout``: the run's processes are stopped and the command ends with exit status 1 and
    one line naming the limit and the logs, not a traceback."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "wafl.cli.main", "run", "--rounds", "200", "--timeout", "4", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "exceeded --timeout 4 s" in p.stderr and str(out / "logs") in p.stderr
    assert "Traceback" not in p.stderr
