"""The run-configuration flags every federation command shares (``--config``, ``--dataset``, ...,
``-p``, ``--set``) and the :class:`~wafl.common.config.RunConfig` they resolve to."""

from __future__ import annotations

import argparse
import json
from typing import Any

from wafl.common.choices import Partition
from wafl.common.config import RunConfig, load_config
from wafl.common.contract import PROTOCOLS

# the flags' destinations that are configuration fields of the same name
FIELDS = (
    "dataset",
    "data_dir",
    "partition",
    "alpha",
    "delta",
    "num_clients",
    "rounds",
    "fraction",
    "act_prob",
    "algorithm",
    "protocol",
    "aggregation",
    "concurrency",
    "buffer_size",
    "slowdown",
    "dropout",
    "tensorboard",
    "model",
    "seed",
    "device",
)


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    k, v = text.split("=", 1)
    try:
        value: Any = json.loads(v)
    except ValueError:
        value = v
    return k.strip(), value


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The group of configuration flags on the command ``p``."""
    g = p.add_argument_group("run configuration (defaults <- --config file <- these flags)")
    g.add_argument("--config", help="TOML or JSON file with configuration fields")
    g.add_argument("--dataset")
    g.add_argument("--data-dir", dest="data_dir", help="folder holding the larger datasets")
    g.add_argument("--partition", choices=[p.value for p in Partition])
    g.add_argument("--alpha", type=float, help="per-class Dirichlet concentration")
    g.add_argument("--delta", type=float, help="class-prior concentration of dirichlet-equal")
    g.add_argument("--clients", dest="num_clients", type=int)
    g.add_argument("--rounds", type=int)
    g.add_argument("--fraction", type=float, help="share of clients selected per round")
    g.add_argument("--act-prob", dest="act_prob", type=float, help="independent per-client activation probability")
    g.add_argument("--algorithm", help="e.g. fedavg, scd, ditto, fedhkd, fedproto, fedprox+asd")
    g.add_argument("--protocol", choices=PROTOCOLS)
    g.add_argument("--aggregation", help="sync (lock-step rounds), buffered (FedBuff) or fedasync (FedAsync)")
    g.add_argument("--concurrency", type=int, help="buffered: clients training at once (default: all)")
    g.add_argument("--buffer-size", dest="buffer_size", type=int, help="buffered: updates per new version")
    g.add_argument("--slowdown", help="per-client compute slow-down: none, a list '1,2,4,...' or lognormal:sigma=S")
    g.add_argument("--dropout", type=float, help="probability that a client asked to train goes offline instead")
    g.add_argument("--tensorboard", help="write TensorBoard event files of the run into this folder")
    g.add_argument("--model")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--param",
        "-p",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="algorithm parameter, repeatable",
    )
    g.add_argument(
        "--set",
        action="append",
        type=_kv,
        default=[],
        metavar="FIELD=VALUE",
        help="any configuration field (FIELD or SECTION.FIELD), repeatable",
    )


def resolve_config(a: argparse.Namespace) -> RunConfig:
    """The configuration of the parsed flags ``a``: defaults, then the ``--config`` file, then the flags;
    validated (``RunConfig.validate``), and its aggregation rule checked by the rules
    (:func:`~wafl.server.strategies.check_aggregation`)."""
    from wafl.server.strategies import check_aggregation

    overrides: dict[str, Any] = {n: getattr(a, n) for n in FIELDS if getattr(a, n, None) is not None}
    overrides.update(dict(a.set))
    if a.param:
        overrides["params"] = dict(a.param)
    return check_aggregation(load_config(a.config, overrides))
