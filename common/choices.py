"""The closed sets of values that run-configuration fields take, one :class:`enum.StrEnum` each.

A member is its string (``Partition.IID == "iid"``, ``str(Partition.IID) == "iid"``, and its ``repr`` is
the string's), so configuration files, sweep files, ``config.json``, every comparison with a string and
every message that quotes a field read as before.
:meth:`wafl.common.config.RunConfig.validate` turns each field's string into its member once, naming
the field and its values when the string is none of them. The client protocol (``protocol``) is
:class:`wafl.common.contract.ClientProtocol`, beside the wire's other agreements. Open sets stay
strings: the aggregation rule (``aggregation``, one file per rule in ``server/strategies/``), the
``aggregator`` (the robust centers registered in ``server/aggregation/robust.py``), the asynchronous rules'
``staleness`` (one file per function in ``server/staleness/``, checked by the rule), the algorithm, the
dataset and the model (their registries).
"""

from __future__ import annotations

import enum


class Choice(enum.StrEnum):
    """A member of a closed set, shown as its string everywhere: ``str``, ``format`` and ``repr``
    (``repr(Partition.IID) == "'iid'"``), so a message that quotes a field with ``!r`` is unchanged."""

    def __repr__(self) -> str:
        return repr(self.value)


class Partition(Choice):
    """``partition``: how the train split is shared out among the clients (:mod:`wafl.common.partition`)."""

    DIRICHLET = "dirichlet"  # per-class Dirichlet(alpha) label skew
    DIRICHLET_EQUAL = "dirichlet-equal"  # equal-size shards, class priors from Dirichlet(delta)
    IID = "iid"


class Optimizer(Choice):
    """``optimizer``: the local optimizer (:func:`wafl.common.training.make_optimizer`)."""

    SGD = "sgd"
    ADAM = "adam"


class PlateauMetric(Choice):
    """``plateau_metric``: the results fields the plateau rule watches (:mod:`wafl.common.plateau`)."""

    AUTO = "auto"  # each of the GM's (where evaluated) and the PM's (where the algorithm has one): all must flatten
    GM_ACCURACY = "gm_accuracy"
    PM_ACCURACY = "pm_accuracy"


class DeviceKind(Choice):
    """The kind of a ``device``: ``auto``, ``cpu``, ``cuda``, or ``cuda:N`` (a CUDA device by its index)."""

    AUTO = "auto"  # CUDA where it is available, else the CPU
    CPU = "cpu"
    CUDA = "cuda"
