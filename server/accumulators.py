"""The running sums the strategy's collections fold uploads into: made once with the run's aggregation rule
(``aggregator``, ``trim_fraction``, ``clip_norm``, the adaptive ``norm_bound``) and its budget of retained
bytes, handed out zeroed, and taken back (zeroed again) after each aggregation."""

from __future__ import annotations

import math

from wafl.common.config import RunConfig
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.norm_bound import NormBound, bounded
from wafl.server.aggregation.rule import Rule
from wafl.server.aggregation.spill import RetainedBytes
from wafl.server.global_model import GlobalModel


class AccumulatorPool:
    """Zeroed :class:`~wafl.server.aggregation.accumulator.Accumulator` objects for the next collection, each
    set up for the global model as it is when it is taken (its reference, the norm bound of this aggregation)."""

    def __init__(self, cfg: RunConfig, model: GlobalModel) -> None:
        self.model = model
        self.free: list[Accumulator] = []  # zeroed sums, ready for the next collection
        adaptive = cfg.security.norm_bound if cfg.security.clip_norm is None else 0.0
        self.rule = Rule(cfg.security.aggregator, cfg.security.trim_fraction, cfg.security.clip_norm, adaptive)
        self.norm_bound = NormBound(self.rule.adaptive)
        # shared by every accumulator
        self.retained = RetainedBytes.of_mb(cfg.federation.rollback_memory_mb, cfg.federation.rollback_upload_mb)

    def take(self, uploads_are_deltas: bool) -> Accumulator:
        """A zeroed accumulator; ``uploads_are_deltas``: the uploads are differences to the model sent (the
        accumulator then has no reference model)."""
        acc = self.free.pop() if self.free else Accumulator(self.model.manifest, rule=self.rule, retained=self.retained)
        acc.set_reference(None if uploads_are_deltas else self.model.state)
        acc.bound = self.norm_bound.bound(self._model_norm()) if self.rule.adaptive else None
        return acc

    def give_back(self, acc: Accumulator) -> None:
        """Takes back an accumulator that was reset, for a later collection."""
        self.free.append(acc)

    def _model_norm(self) -> float:
        """The L2 norm of the global model's floating-point tensors (the first round's norm bound)."""
        return math.sqrt(
            sum(
                float(t.detach().double().pow(2).sum())
                for name, t in self.model.state.items()
                if t.is_floating_point() and bounded(name)
            )
        )
