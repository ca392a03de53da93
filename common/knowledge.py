"""Knowledge that travels with models: per-class counts, mean representations and soft predictions.

FedHKD's hyper-knowledge and FedProto's prototypes share one shape, :class:`ClassKnowledge`, its
checks, its count-weighted aggregation and its wire form (``ClassKnowledge`` messages).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from wafl.common.proto import federation_pb2 as pb


@dataclass
class ClassKnowledge:
    """The knowledge of one class: sample count, mean representation, mean soft prediction."""

    class_id: int
    count: int
    rep: Tensor  # (code_len,)
    soft: Tensor  # (num_classes,)


Knowledge = dict[int, ClassKnowledge]


class KnowledgeAccumulator:
    """Streaming server aggregation: ``add`` uploads one at a time, ``result`` = :func:`aggregate_knowledge`.

    Keeps per class the count-weighted sums ``sum_i N_i^j h_i^j`` and ``sum_i N_i^j q_i^j``
    (float64) and ``sum_i N_i^j``; dividing at the end gives the weights
    ``p_i = N_i^j / sum_k N_k^j`` exactly.
    """

    def __init__(self, num_classes: int, uniform: bool = False) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes} must be >= 1")
        self.num_classes = num_classes
        self.uniform = uniform  # each holder of a class weighs 1 (FedProto's prototype average), not N_i^j
        self._counts: dict[int, int] = {}
        self._weights: dict[int, int] = {}  # the divisor: the counts' sum, or the number of holders
        self._rep: dict[int, Tensor] = {}
        self._soft: dict[int, Tensor] = {}

    def add(self, k: Knowledge) -> None:
        """Adds one client's knowledge; inputs are not modified."""
        for j, ck in k.items():
            if ck.class_id != j:
                raise ValueError(f"class {j}: key {j} does not match class_id {ck.class_id}")
            if not 0 <= j < self.num_classes:
                raise ValueError(f"class {j}: class id out of range [0, {self.num_classes - 1}]")
            if ck.count <= 0:
                raise ValueError(f"class {j}: count {ck.count} must be positive")
            w = 1 if self.uniform else ck.count
            rep = ck.rep.detach().double().cpu().reshape(-1) * w
            soft = ck.soft.detach().double().cpu().reshape(-1) * w
            if j in self._counts:
                if rep.shape != self._rep[j].shape or soft.shape != self._soft[j].shape:
                    raise ValueError(f"class {j}: rep/soft shapes differ between uploads")
                self._counts[j] += ck.count
                self._weights[j] += w
                self._rep[j] += rep
                self._soft[j] += soft
            else:
                self._counts[j] = ck.count
                self._weights[j] = w
                self._rep[j] = rep
                self._soft[j] = soft

    def result(self) -> Knowledge:
        """The global knowledge so far: float32 on the CPU, classes nobody shared absent."""
        return {
            j: ClassKnowledge(
                j, n, (self._rep[j] / self._weights[j]).float(), (self._soft[j] / self._weights[j]).float()
            )
            for j, n in sorted(self._counts.items())
        }


def aggregate_knowledge(uploads: Iterable[Knowledge], num_classes: int) -> Knowledge:
    """Server step: ``H^j = sum_i p_i h_i^j``, ``Q^j = sum_i p_i q_i^j``, ``p_i = N_i^j / sum_k N_k^j``.

    The sum runs over the clients that shared class ``j``; ``count`` is their total. Classes
    nobody shared are absent from the result.
    """
    acc = KnowledgeAccumulator(num_classes)
    for k in uploads:
        acc.add(k)
    return acc.result()


def validate_knowledge(k: Knowledge, num_classes: int, code_len: int, tol: float = 1e-3) -> None:
    """Checks received knowledge; raises ``ValueError`` naming the class and the rule it breaks.

    Rules: key == class_id, class id in ``[0, num_classes)``, count a positive integer, rep a
    1-D tensor of length ``code_len``, soft a 1-D tensor of length ``num_classes``, finite
    values, soft non-negative and summing to 1 within ``tol``.
    """
    for key, ck in k.items():
        j = ck.class_id
        if key != j:
            raise ValueError(f"class {j}: stored under key {key}, key must equal class_id")
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < num_classes:
            raise ValueError(f"class {j}: class id out of range [0, {num_classes - 1}]")
        if isinstance(ck.count, bool) or not isinstance(ck.count, int) or ck.count <= 0:
            raise ValueError(f"class {j}: count {ck.count!r} must be a positive integer")
        for name, t, n in (("rep", ck.rep, code_len), ("soft", ck.soft, num_classes)):
            if not isinstance(t, Tensor):
                raise ValueError(f"class {j}: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 1 or t.numel() != n:
                raise ValueError(f"class {j}: {name} length {tuple(t.shape)} must be ({n},)")
            if not t.is_floating_point():
                raise ValueError(f"class {j}: {name} must be floating point, got {t.dtype}")
    if not k:
        return
    # the values' rules, every class at once (a handful of tensor operations, not a handful per class)
    reps = torch.stack([ck.rep.detach().cpu() for ck in k.values()]).double()
    softs = torch.stack([ck.soft.detach().cpu() for ck in k.values()]).double()
    bad = ~(torch.isfinite(reps).all(1) & torch.isfinite(softs).all(1))
    bad |= (softs < 0).any(1) | ((softs.sum(1) - 1.0).abs() > tol)
    if not bool(bad.any()):
        return
    ck = list(k.values())[int(bad.nonzero()[0])]  # the first class that breaks a rule: which one, in words
    j = ck.class_id
    for name, t in (("rep", ck.rep), ("soft", ck.soft)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"class {j}: {name} has non-finite values")
    if bool((ck.soft < 0).any()):
        raise ValueError(f"class {j}: soft has negative entries (min {float(ck.soft.min()):.3g})")
    total = float(ck.soft.double().sum())
    raise ValueError(f"class {j}: soft sums to {total:.6g}, must sum to 1 within {tol}")


def to_proto(k: Knowledge) -> list[pb.ClassKnowledge]:
    """Knowledge as wire messages, in class order."""
    return [
        pb.ClassKnowledge(
            class_id=c.class_id, count=c.count, representation=c.rep.tolist(), soft_prediction=c.soft.tolist()
        )
        for _, c in sorted(k.items())
    ]


def from_proto(messages: Iterable[pb.ClassKnowledge]) -> Knowledge:
    """Wire messages as knowledge; raises ``ValueError`` when a class appears twice."""
    out: Knowledge = {}
    for m in messages:
        if m.class_id in out:
            raise ValueError(f"class {m.class_id} appears twice in the knowledge")
        rep = torch.from_numpy(np.array(m.representation, dtype=np.float32))
        soft = torch.from_numpy(np.array(m.soft_prediction, dtype=np.float32))
        out[m.class_id] = ClassKnowledge(m.class_id, m.count, rep, soft)
    return out
