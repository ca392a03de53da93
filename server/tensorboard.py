"""TensorBoard event files of a run (``--tensorboard DIR``), readable by a stock ``tensorboard --logdir``.

Per results line (step = its round): every numeric field as a scalar (``gm_accuracy``,
``pm_accuracy``, ``train_loss``, ``bytes_up``, ``round_s``, ``staleness_mean``, ...); once: the
run's hyper-parameters (the HParams plugin) with the final accuracies; at the end: each client's
phase timeline as scalars ``timeline/<client>/<phase>`` = seconds spent in that phase in that
round. Written by the server only; a missing ``tensorboard`` package is a configuration error.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wafl.common.config import ConfigError, RunConfig


class TensorBoardLog:
    def __init__(self, log_dir: str | Path, cfg: RunConfig) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"tensorboard={str(log_dir)!r} needs the tensorboard package (pip install 'wafl[tensorboard]')"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.cfg = cfg
        self.last: dict[str, Any] = {}

    def row(self, row: Mapping[str, Any]) -> None:
        step = int(row["round"])
        for k, v in row.items():
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)
        self.last = dict(row)
        self.writer.flush()

    def timelines(self, timelines: Mapping[str, Mapping[str, Any]]) -> None:
        for client, t in sorted(timelines.items()):
            spent: dict[tuple[str, int], float] = defaultdict(float)
            for e in t.get("events", []):
                spent[(e["phase"], int(e["round"]))] += float(e["end_s"]) - float(e["start_s"])
            for (phase, r), seconds in sorted(spent.items(), key=lambda x: (x[0][1], x[0][0])):
                self.writer.add_scalar(f"timeline/{client}/{phase}", seconds, r)

    def close(self) -> None:
        hparams = {
            k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v, sort_keys=True))
            for k, v in json.loads(self.cfg.to_json()).items()
            if v is not None
        }
        metrics = {
            f"final/{k}": float(self.last[k])
            for k in ("gm_accuracy", "pm_accuracy")
            if isinstance(self.last.get(k), (int, float))
        }
        self.writer.add_hparams(hparams, metrics or {"final/gm_accuracy": float("nan")}, run_name=".")
        self.writer.close()
