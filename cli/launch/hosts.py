"""Where a run's processes live, parsed once: each client's link rate (``--link-rate``), the CPU share of
every host (``--host-cpus``) and the worker processes (``--workers``, a count by now).

``wafl run``'s preflight (:mod:`wafl.cli.commands.preflight`) builds a :class:`Hosts` with
:func:`parse_hosts` and hands it to :func:`wafl.cli.launch.launcher.launch`, which reads the parsed values
and parses no string; programmatic callers build theirs with the same :func:`parse_hosts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from wafl.cli.launch import cgroups
from wafl.common.config import ConfigError, RunConfig
from wafl.common.heterogeneity import host_cpus as _host_cpus
from wafl.common.heterogeneity import link_rates as _link_rates
from wafl.common.rates import parse_rate


@dataclass(frozen=True)
class Hosts:
    """A run's hosts, parsed. The default: every process on loopback, sharing every core, one process per
    client (what :func:`parse_hosts` gives without flags)."""

    link_rate: str | None = None  # ``--link-rate`` as given (None: loopback, no namespaces)
    rates: tuple[str, ...] = ()  # each client's tc rate (``20mbit``), from ``link_rate`` and the seed
    rate_bits: tuple[int, ...] = ()  # the same in bits/s
    host_cpus: str | None = None  # ``--host-cpus`` as given (None: ``auto`` with links, else ``none``)
    cpu_spec: str = "none"  # the share spec in force (``host_cpus.json``'s ``spec``)
    machine_cpus: float = 0.0  # the cores the shares were drawn against (0: not looked up, no shares)
    shares: tuple[float, tuple[float, ...]] | None = None  # the server's and each client's cores; None: shared
    quota_optional: bool = False  # quotas that cannot be set up here only warn (then every core is shared)
    workers: int | None = None  # worker processes hosting the clients; None: one process per client

    @property
    def per_client(self) -> bool:
        """Whether the flags ask for per-client links or CPU shares (a namespace or a control group per process)."""
        return bool(self.link_rate or (self.host_cpus or "none") != "none")


def parse_hosts(
    cfg: RunConfig,
    link_rate: str | None = None,
    host_cpus: str | None = None,
    workers: int | None = None,
    quota_optional: bool | None = None,
) -> Hosts:
    """``link_rate`` and ``host_cpus`` (as :func:`wafl.cli.launch.launcher.launch` documents them) parsed for
    the run ``cfg``; a :class:`ConfigError` naming the flag where a spec does not fit it. ``quota_optional``
    None: quotas are optional exactly when ``host_cpus`` is None."""
    rates: tuple[str, ...] = ()
    bits: tuple[int, ...] = ()
    cpu_spec = host_cpus or ("auto" if link_rate else "none")
    cores = 0.0
    try:
        if link_rate:
            rates = tuple(_link_rates(link_rate, cfg.federation.num_clients, cfg.federation.seed))
            bits = tuple(map(parse_rate, rates))
        if cpu_spec.strip() not in ("", "none"):
            cores = cgroups.machine_cpus()
        shares = _host_cpus(cpu_spec, cfg.federation.num_clients, cfg.federation.seed, cores)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Hosts(
        link_rate=link_rate,
        rates=rates,
        rate_bits=bits,
        host_cpus=host_cpus,
        cpu_spec=cpu_spec,
        machine_cpus=cores,
        shares=None if shares is None else (shares[0], tuple(shares[1])),
        quota_optional=host_cpus is None if quota_optional is None else quota_optional,
        workers=workers,
    )
