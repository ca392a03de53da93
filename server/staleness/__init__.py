"""Staleness functions, one file each: an asynchronous rule's weight ``s(k)`` of an update by its age ``k`` in
versions (the run's ``staleness`` names one; ``staleness_a`` and ``staleness_b`` are its settings).

* ``base.py``: :class:`~wafl.server.staleness.base.StalenessFunction`, the registry
  :data:`~wafl.server.staleness.base.STALENESS` and :func:`~wafl.server.staleness.base.staleness_function`;
* ``sqrt.py``: FedBuff's ``1/sqrt(1+k)`` (the default);
* ``constant.py``, ``poly.py``, ``hinge.py``: FedAsync's (Xie et al. 2019) ``1``, ``(1+k)^-a`` and
  ``1`` up to ``b``, then ``1/(a(k-b)+1)``.

A new staleness function is one file of this package (and its test): a
:class:`~wafl.server.staleness.base.StalenessFunction` subclass decorated with ``@STALENESS.register("name")``
whose ``__call__`` gives the weight. The registry imports every module of the package the first time it is
read, so ``staleness = "name"`` works at once for every asynchronous rule (``buffered``, ``fedasync``), which
checks the name through it.
"""

from __future__ import annotations

from wafl.server.staleness.base import STALENESS, StalenessFunction, staleness_function

__all__ = ["STALENESS", "StalenessFunction", "staleness_function"]
