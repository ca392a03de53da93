"""``--device auto|cpu|cuda[:N]``: parsing and validation, what ``auto`` resolves to, the device a
client reports in ``Join``, and, on a machine with CUDA, the PM phase on its own stream and batches
staged through pinned memory (those two are skipped where there is no CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import wafl.client.trainer as trainer_module
from independent_client import server_command
from wafl.cli.config_flags import resolve_config as _resolve_config
from wafl.cli.main import build_parser, main
from wafl.client.trainer import Trainer, resolve_device
from wafl.common.config import ConfigError, load_config
from wafl.common.datasets import load_dataset
from wafl.common.training import batches

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")


# ----------------------------------------------------------------------------- parsing, validation


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_device_flag_reaches_the_run_configuration(device: str) -> None:
    for command in (["run"], ["server"]):
        args = build_parser().parse_args([*command, "--device", device])
        assert _resolve_config(args).training.device == device


def test_client_device_flag_is_parsed() -> None:
    args = build_parser().parse_args(["client", "--index", "0", "--device", "cuda:1"])
    assert args.device == "cuda:1"


@pytest.mark.parametrize("bad", ["cuda:abc", "cuda:", "cuda:-1", "gpu", "CPU", "cuda:0:1", "mps"])
def test_malformed_device_is_rejected_by_validation(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"device=") as e:
        load_config(None, {"device": bad})
    assert repr(bad) in str(e.value)


def test_cli_reports_a_malformed_device_as_a_configuration_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--device", "cuda:abc"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and "device='cuda:abc'" in err


# ----------------------------------------------------------------------------- resolution


def test_auto_resolves_to_the_available_device() -> None:
    assert resolve_device("auto") == torch.device("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@needs_no_cuda
def test_auto_is_cpu_here_and_the_trainer_has_no_cuda_stream() -> None:
    assert resolve_device("auto").type == "cpu"
    cfg = load_config(None, {"num_clients": 2, "algorithm": "scd", "device": "auto"})
    t = Trainer(cfg, 0)
    assert t.device.type == "cpu"
    assert t.pm_stream is None
    assert next(t.gm.parameters()).device.type == "cpu" and next(t.pm.parameters()).device.type == "cpu"


@needs_no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error_naming_device(device: str) -> None:
    with pytest.raises(ValueError) as e:
        resolve_device(device)
    msg = str(e.value)
    assert f"device={device!r}" in msg and "CUDA is not available" in msg


@needs_no_cuda
def test_trainer_refuses_cuda_without_cuda() -> None:
    cfg = load_config(None, {"num_clients": 2, "device": "cuda"})  # well-formed: validation passes
    with pytest.raises(ValueError, match=r"device='cuda'.*CUDA is not available"):
        Trainer(cfg, 0)


def test_cpu_batches_are_not_pinned_and_stay_on_the_cpu() -> None:
    data = load_dataset("digits")
    out = list(batches(data.train, np.arange(40), 16, False, device=torch.device("cpu")))
    assert [len(y) for _, y in out] == [16, 16, 8]
    for x, y in out:
        assert x.device.type == "cpu" and y.device.type == "cpu"
        assert not x.is_pinned()


# ----------------------------------------------------------------------------- Join carries the device


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait_ready(ready: Path, server: subprocess.Popen[bytes], timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            return int(json.loads(ready.read_text())["port"])
        if server.poll() is not None:
            raise AssertionError(f"server exited with {server.returncode} before listening")
        time.sleep(0.1)
    raise AssertionError("server did not write its ready file in time")


def test_client_reports_its_device_in_join(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "num_clients": 1,
                "rounds": 1,
                "local_epochs": 1,
                "join_timeout_s": 120,
                "round_deadline_s": 120,
                "checkpoint": False,
            }
        )
    )
    out = tmp_path / "out"
    ready = out / "server.json"
    server = subprocess.Popen(
        server_command(cfg, out, ready_file=ready),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        port = _wait_ready(ready, server)
        client = [
            sys.executable,
            "-m",
            "wafl.cli.main",
            "client",
            "--server",
            f"127.0.0.1:{port}",
            "--index",
            "0",
            "--quiet",
        ]
        # The run's device is "auto": the client resolves it and reports the device it uses.
        good = subprocess.run(client, env=_env(), capture_output=True, text=True, timeout=240)
        assert good.returncode == 0, good.stderr[-2000:]
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    events = [json.loads(line) for line in (out / "logs" / "server.jsonl").read_text().splitlines() if line.strip()]
    joins = [e for e in events if e.get("event") == "client.join"]
    assert joins, "no client.join in the server log"
    expected = str(resolve_device("auto"))
    assert expected == ("cuda" if HAS_CUDA else "cpu")
    assert {e["device"] for e in joins} == {expected}
    assert all(e["client"] == "client-0" and e["samples"] > 0 for e in joins)


# ----------------------------------------------------------------------------- CUDA only


def _cuda_trainer() -> Trainer:
    cfg = load_config(
        None,
        {
            "dataset": "synthetic-cifar10",
            "model": "cnn",
            "algorithm": "scd",
            "num_clients": 2,
            "local_epochs": 1,
            "batch_size": 32,
            "device": "cuda",
        },
    )
    return Trainer(cfg, 0)


@needs_cuda
def test_pm_phase_runs_on_its_own_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _cuda_trainer()
    assert t.pm_stream is not None
    default = torch.cuda.default_stream(t.device)
    assert t.pm_stream != default
    seen: list[tuple[str, torch.cuda.Stream]] = []
    real = trainer_module.run_phase

    def spy(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("pm" if model is t.pm else "gm", torch.cuda.current_stream(t.device)))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "run_phase", spy)
    t.begin_round(1, {k: v.detach().cpu() for k, v in t.gm.state_dict().items()})
    gm_stats = t.train_gm()
    pm_stats = t.train_pm(None, 0.5)
    assert gm_stats.steps > 0 and pm_stats.steps > 0
    assert [phase for phase, _ in seen] == ["gm", "pm"]
    assert seen[0][1] == default
    assert seen[1][1] == t.pm_stream and seen[1][1] != default
    assert all(p.is_cuda for p in t.pm.parameters())


@needs_cuda
def test_cuda_batches_are_staged_in_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[bool] = []
    real = torch.Tensor.pin_memory

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(self, *args, **kwargs)
        pinned.append(out.is_pinned())
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", spy)
    data = load_dataset("synthetic-cifar10")
    out = list(batches(data.train, np.arange(64), 32, False, device=torch.device("cuda")))
    assert len(out) == 2 and all(x.is_cuda and y.is_cuda for x, y in out)
    assert len(pinned) == 4 and all(pinned)  # x and y of each batch
