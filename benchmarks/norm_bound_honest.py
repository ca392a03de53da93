#!/usr/bin/env python
"""Honest runs with and without the default norm bound: the same final model, bit for bit.

Run from the repository root::

    python benchmarks/norm_bound_honest.py                       # the two Fashion-MNIST points below
    python benchmarks/norm_bound_honest.py --point configs/sweeps/asd_fmnist.toml:fedavg:4
    python benchmarks/norm_bound_honest.py --smoke               # digits, 4 clients, 2 rounds

Each point is ``SWEEP_FILE:ALGORITHM:ROUNDS``: the sweep file's ``[base]`` setting with that algorithm, seed 0,
that many rounds, in process, run twice: with ``norm_bound = 10`` (the default: each update clipped to 10 x the
median norm of the updates accepted in the last rounds) and with ``norm_bound = 0`` (no bound). It records each
run's SHA-256 of the final global model (the first 16 hex digits) and per-round GM accuracy, and whether the two
runs are identical: the bound is meant not to touch honest federations. Default points: FedAvg at the ASD
Fashion-MNIST setting (100 clients, 10 a round, 5 local epochs) for 4 rounds and SCD at the SCD setting (100
clients, all every round) for 2 rounds. Writes ``benchmarks/results/security/normbound-fmnist.json`` (the smoke
run: ``normbound-smoke.json``), with the commit measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import torch
from _machine import provenance
from wafl.cli.sim.simulate import simulate
from wafl.common.config import RunConfig
from wafl.common.logs import configure_logging
from wafl.server.checkpoint import load_checkpoint

RESULTS = Path(__file__).resolve().parent / "results" / "security"
POINTS = ("configs/sweeps/asd_fmnist.toml:fedavg:4", "configs/sweeps/scd_fmnist.toml:scd:2")
BOUNDS = (10.0, 0.0)


def model_digest(checkpoint: Path) -> str:
    """The first 16 hex digits of the SHA-256 over the final global model's tensors (sorted by name)."""
    state = load_checkpoint(checkpoint)
    if state is None:
        raise SystemExit(f"{checkpoint}: no checkpoint was written")
    g = state.get("global_state") or state.get("global") or state
    h = hashlib.sha256()
    for k in sorted(g):
        if torch.is_tensor(g[k]):
            h.update(k.encode())
            h.update(g[k].detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def run_point(base: dict[str, Any], label: str) -> dict[str, Any]:
    runs = {}
    for bound in BOUNDS:
        cfg = RunConfig.from_mapping({**base, "norm_bound": bound, "checkpoint": True}).validate()
        with tempfile.TemporaryDirectory() as d:
            rows = simulate(cfg, Path(d))
            runs[str(bound)] = {
                "digest": model_digest(Path(d) / "checkpoint.pt"),
                "gm_accuracy": [r.get("gm_accuracy") for r in rows],
            }
        print(f"{label} norm_bound={bound:g}: {runs[str(bound)]}", flush=True)
    digests = {r["digest"] for r in runs.values()}
    return {"point": label, "runs": runs, "identical": len(digests) == 1}


def parse_point(spec: str) -> tuple[dict[str, Any], str]:
    try:
        path, algorithm, rounds = spec.rsplit(":", 2)
        n = int(rounds)
    except ValueError:
        raise SystemExit(f"--point {spec!r}: expected SWEEP_FILE:ALGORITHM:ROUNDS") from None
    if n < 2:
        raise SystemExit(f"--point {spec!r}: ROUNDS must be at least 2 (the bound starts from round 2's median)")
    with open(path, "rb") as f:
        base = tomllib.load(f)["base"]
    return {**base, "algorithm": algorithm, "rounds": n, "seed": 0}, spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", action="append", help="SWEEP_FILE:ALGORITHM:ROUNDS (repeatable; default: two points)")
    p.add_argument("--smoke", action="store_true", help="digits, fedavg, 4 clients, 2 rounds: checks the script")
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/security/normbound-*.json)")
    a = p.parse_args(argv)
    configure_logging("norm_bound_honest", level="WARNING")
    torch.set_num_threads(1)
    if a.smoke:
        points = [({"algorithm": "fedavg", "num_clients": 4, "rounds": 2, "seed": 0}, "digits:fedavg:2")]
    else:
        points = [parse_point(s) for s in (a.point or POINTS)]
    doc = {"benchmark": "norm_bound_honest", **provenance(), "smoke": a.smoke}
    doc["points"] = [run_point(base, label) for base, label in points]
    out = a.out or RESULTS / ("normbound-smoke.json" if a.smoke else "normbound-fmnist.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(pt["identical"] for pt in doc["points"]) else 1


if __name__ == "__main__":
    sys.exit(main())
