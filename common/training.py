"""The one local trainer every algorithm runs, plus batching and evaluation.

``run_phase`` trains a model on a stream of batches with cross-entropy plus the algorithm's
loss terms (or the terms alone), one batch at a time through the phase's step rule (plain
``zero_grad, backward, step`` unless the algorithm brings its own, e.g. SAM), stopping early
when ``should_stop()`` turns true (checked between batches: the wait-free PM loop stops within
one batch of a broadcast). ``train_phase`` runs one declared :class:`~wafl.common.algorithms.base.Phase`:
it freezes what the phase does not train, then calls ``run_phase``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from wafl.common.algorithms.base import (
    Forward,
    LossTerm,
    Phase,
    RoundContext,
    StepContext,
    StepRule,
    cross_entropy,
    parameters_of,
)
from wafl.common.choices import Optimizer
from wafl.common.models.base import SplitModel

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(
    dataset: Dataset[Any],
    indices: np.ndarray,
    batch_size: int,
    shuffle: bool,
    generator: np.random.Generator | None = None,
    device: torch.device | None = None,
) -> Iterator[Batch]:
    """One pass over ``dataset[indices]``. Tensor datasets are sliced directly (no per-sample collate)."""
    idx = np.asarray(indices)
    if shuffle:
        idx = (generator or np.random.default_rng()).permutation(idx)
    tensors = getattr(dataset, "tensors", None)
    # one copy of the pass's order as a tensor (``indices`` may be a read-only array, which Torch does not wrap)
    order = torch.tensor(idx) if tensors is not None else None
    pin = device is not None and device.type == "cuda"
    for start in range(0, len(idx), batch_size):
        if order is not None and tensors is not None:  # both set or both None
            t = order[start : start + batch_size]
            x, y = tensors[0][t], tensors[1][t]
        else:
            items = [dataset[int(i)] for i in idx[start : start + batch_size]]
            x = torch.stack([it[0] for it in items])
            y = torch.as_tensor([int(it[1]) for it in items], dtype=torch.int64)
        if device is not None and device.type != "cpu":
            if pin:
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        yield x, y


def epochs(
    dataset: Dataset[Any],
    indices: np.ndarray,
    batch_size: int,
    generator: np.random.Generator,
    num_epochs: float | None,
    device: torch.device | None = None,
) -> Iterator[Batch]:
    """Shuffled passes over the data: ``num_epochs`` of them (fractions allowed), or forever when None."""
    per_epoch = max(1, math.ceil(len(indices) / batch_size))
    limit = None if num_epochs is None else max(1, int(round(num_epochs * per_epoch)))
    n = 0
    while True:
        for b in batches(dataset, indices, batch_size, True, generator, device):
            if limit is not None and n >= limit:
                return
            yield b
            n += 1


def make_optimizer(
    name: str, params: Sequence[nn.Parameter] | Iterator[nn.Parameter], lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    if name == Optimizer.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == Optimizer.ADAM:
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={str(name)!r} is not one of {[o.value for o in Optimizer]}")


def clip_before_step(opt: torch.optim.Optimizer, max_norm: float) -> torch.optim.Optimizer:
    """``opt``, whose every step first scales the gradients of all its parameters together to an L2 norm of at most
    ``max_norm`` (``torch.nn.utils.clip_grad_norm_``, in a step pre-hook: the gradient the optimizer steps with,
    after any step rule's correction such as SCAFFOLD's); ``max_norm = 0`` leaves it as it is (the same bits).
    The run option ``grad_clip``: the code of FedDyn and of the methods built on it (ASD's) clips every local
    step of every method at 10."""
    if max_norm > 0:
        params = [p for group in opt.param_groups for p in group["params"]]

        def clip(*_: Any) -> None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)

        opt.register_step_pre_hook(clip)
    return opt


_BASE_LR = "wafl_base_lr"  # a param group's learning rate before decay_lr scaled it


def decay_lr(opt: torch.optim.Optimizer, decay: float, round: int) -> torch.optim.Optimizer:
    """``opt`` with each param group's learning rate set to its first one times ``decay ** (round - 1)``: the run
    option ``lr_decay``, round 1 at the configured rate (the code of FedDyn and of the methods built on it, ASD's,
    decays every client's rate by 0.998 a round). An optimizer kept across rounds (a PM's) is set anew each round
    from the rate it had first; ``decay = 1`` leaves it as it is (the same bits)."""
    if decay != 1.0:
        factor = decay ** (round - 1)
        for group in opt.param_groups:
            group["lr"] = group.setdefault(_BASE_LR, group["lr"]) * factor
    return opt


@dataclass
class PhaseStats:
    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    stopped_early: bool = False

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else float("nan")

    def add(self, other: PhaseStats) -> PhaseStats:
        """Both phases' totals (a client's phases of one round)."""
        return PhaseStats(
            self.steps + other.steps,
            self.samples + other.samples,
            self.loss_sum + other.loss_sum,
            self.seconds + other.seconds,
            self.stopped_early or other.stopped_early,
        )


DEFAULT_STEP = StepRule()


def run_phase(
    model: SplitModel,
    terms: Sequence[LossTerm],
    ctx: RoundContext,
    data: Iterator[Batch],
    optimizer: torch.optim.Optimizer,
    should_stop: Callable[[], bool] | None = None,
    min_steps: int = 0,
    on_step: Callable[[int], None] | None = None,
    step: StepRule | None = None,
    params: list[nn.Parameter] | None = None,
    use_cross_entropy: bool = True,
    forward: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> PhaseStats:
    """Trains ``model`` on ``data`` with ``CE + sum(terms)`` (``sum(terms)`` without cross-entropy);
    see the module docstring. ``params`` are the trained parameters the step rule sees (default:
    every parameter that requires a gradient); ``forward`` replaces ``model.forward_split``."""
    stats = PhaseStats()
    t0 = time.perf_counter()
    rule = step or DEFAULT_STEP
    trained = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    fwd = forward or model.forward_split
    for term in terms:
        term.begin(ctx, model)
    rule.begin(ctx, model, trained)
    model.train()
    for x, y in data:
        if should_stop is not None and stats.steps >= min_steps and should_stop():
            stats.stopped_early = True
            break

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            h, logits = fwd(x)
            out = Forward(x, y, h, logits, ctx)
            loss = cross_entropy(out) if use_cross_entropy else None
            for term in terms:
                loss = term(model, out, ctx) if loss is None else loss + term(model, out, ctx)
            if loss is None:
                raise ValueError("a phase without cross-entropy needs a loss term")
            return loss

        loss = rule.step(StepContext(model, trained, closure, optimizer, (x, y)))
        stats.steps += 1
        stats.samples += len(y)
        stats.loss_sum += float(loss.detach())
        if on_step is not None:
            on_step(stats.steps)
    rule.end(ctx, model, trained)
    for term in terms:
        term.end(ctx, model)
    stats.seconds = time.perf_counter() - t0
    return stats


@contextmanager
def frozen_except(model: nn.Module, trained: Sequence[nn.Parameter]) -> Iterator[None]:
    """Within the block only ``trained`` require gradients; the previous flags come back after."""
    keep = {id(p) for p in trained}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        if id(p) not in keep:
            p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


def train_phase(
    model: SplitModel,
    phase: Phase,
    ctx: RoundContext,
    data: Iterator[Batch],
    optimizer: torch.optim.Optimizer,
    should_stop: Callable[[], bool] | None = None,
    min_steps: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> PhaseStats:
    """Runs one declared phase: its parameters train, the others are frozen, its step rule steps."""
    trained = parameters_of(model, phase.params)
    with frozen_except(model, trained):
        return run_phase(
            model,
            phase.terms,
            ctx,
            data,
            optimizer,
            should_stop,
            min_steps,
            on_step,
            step=phase.step,
            params=trained,
            use_cross_entropy=phase.cross_entropy,
            forward=phase.forward(model) if phase.forward is not None else None,
        )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset[Any],
    indices: np.ndarray,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> tuple[float, int, float]:
    """``(accuracy, num_samples, mean_loss)`` of ``model`` on ``dataset[indices]``."""
    was_training = model.training
    model.eval()
    correct = 0
    total = 0
    loss = 0.0
    for x, y in batches(dataset, indices, batch_size, False, device=device):
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        total += len(y)
    model.train(was_training)
    if total == 0:
        return float("nan"), 0, float("nan")
    return correct / total, total, loss / total
