"""Heterogeneous clients, reproducible from the seed: compute slow-downs, link rates, dropouts.

A *spread* names one value per client: a single value (every client the same), an explicit
comma-separated list with one value per client, or ``lognormal:...`` drawn from the run's seed:

* slow-downs (``slowdown``): factors >= 1 by which a client's training phases are stretched.
  ``none`` (all 1), ``"1,2,4,8"``, or ``lognormal:sigma=S`` = ``max(1, exp(S z))`` with ``z``
  standard normal, so about half the clients run at full speed and the others are slower;
* link rates (``--link-rate``): tc rates such as ``20mbit``, ``"10mbit,20mbit,..."``, or
  ``lognormal:median=20mbit,sigma=S`` = ``median * exp(S z)``;
* dropouts (``dropout``): the probability that a client asked to train on a model version goes
  offline instead and comes back for the next one; a pure function of (seed, client, version);
* new clients (``new_clients = K``, :func:`new_client_indices`): K clients held out of training.
  They hold a shard of the partition and join like every client, but are never selected and never
  upload; after each round whose global model is evaluated (``eval_every``, and the last) each of
  them adapts that model as its algorithm prescribes (``Trainer.adapt``: a personal phase trains
  the PM from it, otherwise it is fine-tuned) for ``new_client_epochs`` epochs on its local
  training split and tests it on its local test split. A pure function of the configuration, so
  the server, every client process and an in-process run agree on who is new without a message.
"""

from __future__ import annotations

import math
import re

import numpy as np
from wafl.common.rates import parse_rate

_LOGNORMAL = re.compile(r"^lognormal:(.*)$")


def _lognormal_params(spec: str, name: str, allowed: set[str]) -> dict[str, str]:
    m = _LOGNORMAL.match(spec.strip())
    expected = f"{name}={spec!r}: expected lognormal:{','.join(f'{a}=...' for a in sorted(allowed))}"
    if m is None:
        raise ValueError(expected)
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in m.group(1).split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in allowed:
            raise ValueError(expected)
        out[key.strip()] = value.strip()
    missing = allowed - set(out)
    if missing:
        raise ValueError(f"{name}={spec!r}: lognormal needs {', '.join(sorted(missing))}")
    return out


def _normals(seed: int, stream: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, stream]).standard_normal(n)


def _sigma(value: str, name: str, spec: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = float("nan")
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"{name}={spec!r}: sigma must be a number >= 0")
    return s


def _per_client(spec: str, n: int, name: str) -> list[str]:
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) == 1:
        return parts * n
    if len(parts) != n or not all(parts):
        raise ValueError(f"{name}={spec!r}: a list needs exactly one value per client ({n}), got {len(parts)}")
    return parts


def slowdowns(spec: str, num_clients: int, seed: int) -> list[float]:
    """Each client's slow-down factor (>= 1); raises ``ValueError`` naming ``slowdown``."""
    spec = str(spec).strip()
    if spec in ("", "none"):
        return [1.0] * num_clients
    if _LOGNORMAL.match(spec):
        sigma = _sigma(_lognormal_params(spec, "slowdown", {"sigma"})["sigma"], "slowdown", spec)
        return [max(1.0, math.exp(sigma * z)) for z in _normals(seed, 21, num_clients)]
    out = []
    for v in _per_client(spec, num_clients, "slowdown"):
        try:
            f = float(v)
        except ValueError:
            f = float("nan")
        if not (math.isfinite(f) and f >= 1.0):
            raise ValueError(f"slowdown={spec!r}: {v!r} is not a factor >= 1")
        out.append(f)
    return out


def link_rates(spec: str, num_clients: int, seed: int) -> list[str]:
    """Each client's tc rate (e.g. ``20mbit``); raises ``ValueError`` naming ``link-rate``."""
    spec = str(spec).strip()
    if _LOGNORMAL.match(spec):
        p = _lognormal_params(spec, "link-rate", {"median", "sigma"})
        sigma = _sigma(p["sigma"], "link-rate", spec)
        median = parse_rate(p["median"])
        return [f"{max(8_000, round(median * math.exp(sigma * z)))}bit" for z in _normals(seed, 22, num_clients)]
    rates = _per_client(spec, num_clients, "link-rate")
    for r in rates:
        parse_rate(r)  # raises naming the bad rate
    return rates


def drops_out(seed: int, index: int, version: int, probability: float) -> bool:
    """Whether client ``index`` goes offline instead of training on ``version``."""
    if probability <= 0:
        return False
    return bool(np.random.default_rng([seed, 23, index, version]).random() < probability)


MIN_HOST_CPUS = 0.01  # a quota of 1 ms per 100 ms period: the kernel's lower bound


def host_cpus(spec: str, num_clients: int, seed: int, cores: float) -> tuple[float, list[float]] | None:
    """The CPU share (cores) of the server and of each client; ``None`` for ``none``.

    ``spec``: ``auto`` (the ``cores`` split evenly between the server and the clients), one
    value (every host, e.g. ``0.4``), one value per client (``"0.2,0.4,0.4,0.8"``) or
    ``lognormal:median=C,sigma=S`` (client ``i``: ``C * exp(S z_i)``, reproducible from the
    seed). Any of them may carry ``server=C`` (``"0.2,0.4,0.4,0.8,server=0.5"``); otherwise the
    server gets the single value, or the largest client share. Shares lie in
    [``MIN_HOST_CPUS``, ``cores``]; drawn ones are clipped to it. Raises ``ValueError`` naming
    ``host-cpus``.
    """
    spec = str(spec).strip()
    if spec in ("", "none"):
        return None
    if not (math.isfinite(cores) and cores > 0):
        raise ValueError(f"host-cpus={spec!r}: the machine's cores ({cores!r}) must be a number > 0")
    server: float | None = None
    items = []
    for part in (p.strip() for p in spec.split(",")):
        key, sep, value = part.partition("=")
        if sep and key.strip() == "server":
            server = _cpus(value, spec, cores)
        else:
            items.append(part)
    rest = ",".join(items)
    if rest in ("", "auto"):
        if server is None:
            each = cores / (num_clients + 1)
            return each, [each] * num_clients
        if server >= cores:
            raise ValueError(f"host-cpus={spec!r}: server={server:g} leaves no cores for the clients")
        return server, [(cores - server) / num_clients] * num_clients
    if _LOGNORMAL.match(rest):
        p = _lognormal_params(rest, "host-cpus", {"median", "sigma"})
        sigma = _sigma(p["sigma"], "host-cpus", spec)
        median = _cpus(p["median"], spec, cores)
        clients = [
            min(cores, max(MIN_HOST_CPUS, median * math.exp(sigma * z))) for z in _normals(seed, 24, num_clients)
        ]
    else:
        clients = [_cpus(v, spec, cores) for v in _per_client(rest, num_clients, "host-cpus")]
    return (server if server is not None else max(clients)), clients


def _cpus(value: str, spec: str, cores: float) -> float:
    try:
        c = float(value)
    except ValueError:
        c = float("nan")
    if not (math.isfinite(c) and MIN_HOST_CPUS <= c <= cores):
        raise ValueError(f"host-cpus={spec!r}: {value.strip()!r} is not a share of cores in [0.01, {cores:g}]")
    return c


def new_client_indices(num_clients: int, new_clients: int, seed: int) -> frozenset[int]:
    """The ``new_clients`` indices of ``0..num_clients - 1`` held out of training (none for 0)."""
    if new_clients <= 0:
        return frozenset()
    rng = np.random.default_rng([seed, 9])
    return frozenset(int(i) for i in rng.choice(num_clients, size=new_clients, replace=False))
