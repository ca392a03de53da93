"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020), option II control variates.

Global model ``x`` and server control variate ``c`` travel to the clients; client ``i`` keeps
its own ``c_i`` (zero at first, client state that persists across rounds and restarts). Local
steps from ``y = x``: ``y <- y - eta (g_i(y) - c_i + c)`` (the corrected gradient goes through
the run's optimizer; with plain SGD without weight decay this is the paper's step). After ``K``
steps, option II

    c_i+ = c_i - c + (x - y) / (K eta)  =  (1/K) sum_k g_i(y_k)         (plain SGD, no weight decay)

is computed as the right-hand side, the mean of the ``K`` uncorrected mini-batch gradients: the
same value under plain SGD without weight decay (with weight decay ``wd`` the step also
subtracts ``eta wd y_k``, so the left-hand side would add ``wd`` times the mean iterate), and
still an estimate of the client's gradient under an optimizer whose step is not ``eta`` times
the gradient (Adam, momentum), where ``(x - y) / (K eta)`` is not (with Adam it is about 1 per
coordinate, the variates swamp the gradients and the model diverges). The client uploads ``y``
and ``dc_i = c_i+ - c_i`` (an extra tensor per trained parameter);
``c_i <- c_i+``. The server, with the uniform mean over the ``|S|`` clients of the round as in
the paper's Algorithm 1 (global step size ``eta_g = 1``): ``x <- mean(y_i)``,
``c <- c + (|S| / N) mean(dc_i)``, ``N`` = all clients that train: with ``new_clients = K`` held
out of training, ``num_clients - K`` (:func:`~wafl.common.algorithms.server_updates.training_clients`;
``c`` is the mean of the ``N`` variates ``c_i``, and a held-out client has none). Only trained parameters get control
variates; buffers (none in the digits CNN) are averaged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from wafl.common.algorithms.base import (
    Algorithm,
    ClientHooks,
    Phase,
    RoundContext,
    ServerUpdate,
    StepContext,
    StepRule,
    backward,
    extra_name,
)
from wafl.common.algorithms.params import NoParams
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.server_updates import training_clients
from wafl.common.models.base import SplitModel

STATE_KEY = "scaffold_c_i"
PREFIX = "c."


def control_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


class CorrectedStep(StepRule):
    """``g - c_i + c`` into the optimizer; counts the steps and keeps ``x`` for the variate update."""

    def __init__(self) -> None:
        self.correction: list[torch.Tensor] = []

    def begin(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        names = control_names(model)
        c = [ctx.extras[PREFIX + n] for n in names]
        c_i = self._c_i(ctx, names, c)
        self.correction = [cg - ci.to(cg.device) for cg, ci in zip(c, c_i)]
        self.grad_sum = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        self.steps = 0

    def _c_i(self, ctx: RoundContext, names: list[str], like: list[torch.Tensor]) -> list[torch.Tensor]:
        saved = ctx.client_state.get(STATE_KEY)
        return [saved[n] for n in names] if saved is not None else [torch.zeros_like(t) for t in like]

    def step(self, ctx: StepContext) -> torch.Tensor:
        loss = backward(ctx.closure, ctx.optimizer)
        with torch.no_grad():
            for p, corr, total in zip(ctx.params, self.correction, self.grad_sum):
                if p.grad is not None:
                    total.add_(p.grad)  # g_i(y_k), before the correction
                    p.grad.add_(corr)
        ctx.optimizer.step()
        self.steps += 1
        return loss

    def end(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        names = control_names(model)
        c = [ctx.extras[PREFIX + n] for n in names]
        c_i = self._c_i(ctx, names, c)
        k = max(1, self.steps)
        new = [(total / k).to(p.dtype).cpu() for total, p in zip(self.grad_sum, params)]
        ctx.client_state["scaffold_delta"] = {n: nc - ci.cpu() for n, nc, ci in zip(names, new, c_i)}
        ctx.client_state[STATE_KEY] = dict(zip(names, new))


class Hooks(ClientHooks):
    def upload(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        delta = ctx.client_state.get("scaffold_delta")
        if delta is None:  # nothing trained (cannot happen for an upload): no change
            return {k: torch.zeros_like(v) for k, v in ctx.extras.items()}
        return {PREFIX + n: d for n, d in delta.items()}


class ScaffoldServer(ServerUpdate):
    """Uniform mean of the models; ``c <- c + (|S|/N) mean(dc)``."""

    buffered_ok = False

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def weight(self, num_samples: int, metrics: Mapping[str, float] | None = None) -> float:
        return 1.0

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        out = dict(mean)
        for k, c in prev.items():
            if k.startswith(extra_name(PREFIX)):
                out[k] = c + (participants / self.num_clients) * mean[k].to(c.dtype)
        return out


def build(p: NoParams, run: Mapping[str, Any]) -> Algorithm:
    def controls(model: SplitModel) -> dict[str, torch.Tensor]:
        return {PREFIX + n: torch.zeros_like(t) for n, t in model.named_parameters() if t.requires_grad}

    return Algorithm(
        "scaffold",
        phases=[Phase("gm", step=CorrectedStep())],
        extras=controls,
        hooks=Hooks(),
        server=ScaffoldServer(training_clients(run)),
    )


register("scaffold", NoParams, build)
