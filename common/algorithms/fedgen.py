"""FedGen (Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated
Learning", ICML 2021): data-free knowledge distillation with a generator trained on the server, in
feature space.

The server keeps a conditional generator ``G_w(z, y) -> h`` (``z ~ N(0, I)`` of ``noise_dim``,
``y`` one-hot; two linear layers with a ReLU, no batch norm) and, between rounds, trains it so
that the round's clients' heads ``g_i``, weighted per label by their counts, classify its
output as the label it was asked for, plus the diversity term of the paper:

    min_w  E_{y ~ U(labels held), z} [ sum_i (n_i(y) / sum_k n_k(y)) CE(g_i(G_w(z, y)), y) ]
           + eta * exp( -mean_{b, b'} d1(G(z_b, y_b), G(z_b', y_b')) * d2(z_b, z_b') )

where ``d1`` is the mean absolute and ``d2`` the mean squared difference over the coordinates
(means, as the authors' code computes them, not the sums ``||.||_1``, ``||.||_2^2``, which would
scale the exponent with the feature and noise widths)

for ``gen_steps`` Adam steps (lr ``gen_lr``, batch ``gen_batch``) started from the previous
generator; ``eta`` 1 (the authors' defaults: uniform labels over those held, no student term).
Client ``i`` trains its model with

    L = CE + alpha * (1/B) sum_b CE(g(G(z_b, y^_b)), y^_b),   y^ ~ p(y) = sum_i n_i(y) / sum n

(``G`` frozen on the client; the term is off until a trained generator exists). The model is
averaged as FedAvg; the generator, the label counts and each client's head travel as extra
tensors. A head and its label counts reach the server in a per-client row of a summed tensor
(row ``i`` of the upload is client ``i``'s, the other rows zero, plus a 1 in ``mark[i]``), so the
server recovers each one exactly from the weighted mean: ``head_i = mean[i] / mark[i]``. A robust
center (``aggregator`` median or trimmed mean) would zero those rows, so FedGen runs with the mean only
(refused at start otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.algorithms.base import (
    Algorithm,
    ClientHooks,
    Forward,
    LossTerm,
    RoundContext,
    ServerUpdate,
    extra_name,
)
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.models.base import SplitModel, submodule

GEN = "gen."
HEADS, COUNTS, MARK = "heads", "label_counts", "mark"
HIDDEN = 256


def generator(noise_dim: int, num_classes: int, code_len: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(noise_dim + num_classes, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, code_len))


def load_generator(tensors: Mapping[str, torch.Tensor], noise_dim: int, num_classes: int) -> nn.Sequential:
    w = {k[len(GEN) :]: v for k, v in tensors.items() if k.startswith(GEN)}
    g = generator(noise_dim, num_classes, int(w["2.weight"].shape[0]))
    g.load_state_dict({k: v.detach().float().cpu() for k, v in w.items()})
    return g


def generate(g: nn.Module, z: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.Tensor:
    return g(torch.cat([z, F.one_hot(y, num_classes).to(z.dtype)], dim=1))


def diversity_loss(h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``exp(-mean_{b,b'} d1(h_b, h_b') * d2(z_b, z_b'))``: mean absolute and mean squared differences."""
    dh = (h.unsqueeze(0) - h.unsqueeze(1)).abs().mean(-1)
    dz = ((z.unsqueeze(0) - z.unsqueeze(1)) ** 2).mean(-1)
    return torch.exp(-(dh * dz).mean())


def teacher_loss(
    h: torch.Tensor, y: torch.Tensor, heads: list[tuple[torch.Tensor, torch.Tensor]], counts: torch.Tensor
) -> torch.Tensor:
    """``mean_b sum_i (n_i(y_b) / sum_k n_k(y_b)) CE(W_i h_b + b_i, y_b)``; ``counts`` is ``(clients, C)``."""
    weights = counts[:, y] / counts[:, y].sum(0, keepdim=True).clamp_min(1e-12)  # (clients, B)
    total = h.new_zeros(())
    for (w, b), wi in zip(heads, weights):
        total = total + (wi * F.cross_entropy(h @ w.T + b, y, reduction="none")).mean()
    return total


class GenerativeTeacher(LossTerm):
    name = "fedgen"

    def __init__(self, alpha: float, noise_dim: int) -> None:
        self.alpha, self.noise_dim = alpha, noise_dim
        self.gen: nn.Module | None = None

    def begin(self, ctx: RoundContext, model: nn.Module) -> None:
        counts = ctx.extras[COUNTS].sum(0).double().cpu()
        self.gen = None
        if float(counts.sum()) <= 0:
            return  # no generator has been trained yet
        c = model.num_classes
        if not isinstance(c, int):
            raise TypeError(f"fedgen needs a model with an int num_classes, got {type(c).__name__}")
        self.gen = load_generator(ctx.extras, self.noise_dim, c).to(ctx.label_freq.device).eval()
        for p in self.gen.parameters():
            p.requires_grad_(False)
        self.prior = (counts / counts.sum()).numpy()
        self.rng = np.random.default_rng([ctx.round, ctx.index, 21])
        self.torch_gen = torch.Generator().manual_seed(int(self.rng.integers(2**31)))

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        if self.gen is None:
            return out.logits.new_zeros(())
        c = out.logits.shape[1]
        y = torch.as_tensor(self.rng.choice(c, size=len(out.y), p=self.prior), device=out.logits.device)
        z = torch.randn(len(y), self.noise_dim, generator=self.torch_gen).to(out.logits.device)
        with torch.no_grad():
            h = generate(self.gen, z, y, c)
        return self.alpha * F.cross_entropy(submodule(model, "classifier")(h), y)


class Hooks(ClientHooks):
    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def upload(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        head = ctx.gm.classifier
        c, d = head.weight.shape
        heads = torch.zeros(self.num_clients, c, d + 1)
        heads[ctx.index] = torch.cat([head.weight.detach().cpu(), head.bias.detach().cpu().unsqueeze(1)], dim=1)
        counts = torch.zeros(self.num_clients, c)
        counts[ctx.index] = ctx.label_counts.detach().cpu().float()
        mark = torch.zeros(self.num_clients)
        mark[ctx.index] = 1.0
        gen = {k: v.cpu() for k, v in ctx.extras.items() if k.startswith(GEN)}  # the server replaces it
        return {**gen, HEADS: heads, COUNTS: counts, MARK: mark}


class GeneratorServer(ServerUpdate):
    """FedAvg for the model; trains the generator on the round's heads (see the module docstring)."""

    buffered_ok = False

    def __init__(self, p: FedGenParams, seed: int) -> None:
        self.p, self.seed = p, seed
        self.rounds = 0

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        self.rounds += 1
        out = dict(mean)
        ex = {k[len(extra_name("")) :]: v for k, v in mean.items() if k.startswith(extra_name(""))}
        mark = ex[MARK].double()
        rows = [i for i in range(len(mark)) if float(mark[i]) > 0]
        heads = [(ex[HEADS][i].double() / mark[i]).float() for i in rows]
        counts = torch.stack([(ex[COUNTS][i].double() / mark[i]).round().float() for i in rows])
        c = counts.shape[1]
        held = [j for j in range(c) if float(counts[:, j].sum()) > 0]
        g = load_generator(
            {k[len(extra_name("")) :]: v for k, v in prev.items() if k.startswith(extra_name(GEN))},
            self.p.noise_dim,
            c,
        )
        g.train()
        opt = torch.optim.Adam(g.parameters(), lr=self.p.gen_lr)
        gen = torch.Generator().manual_seed(self.seed * 1000 + self.rounds)
        wb = [(h[:, :-1], h[:, -1]) for h in heads]
        for _ in range(self.p.gen_steps):
            y = torch.tensor(held)[torch.randint(len(held), (self.p.gen_batch,), generator=gen)]
            z = torch.randn(len(y), self.p.noise_dim, generator=gen)
            h = generate(g, z, y, c)
            loss = teacher_loss(h, y, wb, counts) + self.p.eta * diversity_loss(h, z)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for k, v in g.state_dict().items():
            out[extra_name(GEN + k)] = v.detach().clone()
        total = torch.zeros_like(prev[extra_name(COUNTS)])
        total[: len(rows)] = counts  # the clients receive the round's label counts (their sum is p(y))
        out[extra_name(COUNTS)] = total
        out[extra_name(HEADS)] = torch.zeros_like(prev[extra_name(HEADS)])
        out[extra_name(MARK)] = torch.zeros_like(prev[extra_name(MARK)])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))


@dataclass(frozen=True)
class FedGenParams:
    alpha: float = param(1.0, ">= 0")
    eta: float = param(1.0, ">= 0")
    noise_dim: int = param(32, "int >= 1")
    gen_steps: int = param(50, "int >= 1")
    gen_batch: int = param(32, "int >= 1")
    gen_lr: float = param(1e-3, "> 0")


def build(p: FedGenParams, run: Mapping[str, Any]) -> Algorithm:
    aggregator = run.get("aggregator", "mean")
    if aggregator != "mean":  # refused at start: the rows below are recovered from the weighted mean only
        raise ValueError(
            f"algorithm='fedgen' with aggregator={aggregator!r}: the server recovers each client's head and "
            "label counts from the weighted mean of per-client rows, and a coordinate-wise median or trimmed "
            "mean of those rows is zero; use aggregator='mean' (the default norm bound still applies)"
        )
    n = int(run.get("num_clients", 1))

    def extras(model: SplitModel) -> dict[str, torch.Tensor]:
        torch_state = torch.random.get_rng_state()
        torch.manual_seed(int(run.get("seed", 0)) + 12345)  # the same initial generator everywhere
        g = generator(p.noise_dim, model.num_classes, model.code_len)
        torch.random.set_rng_state(torch_state)
        c, d = model.num_classes, model.code_len
        return {
            **{GEN + k: v for k, v in g.state_dict().items()},
            HEADS: torch.zeros(n, c, d + 1),
            COUNTS: torch.zeros(n, c),
            MARK: torch.zeros(n),
        }

    return Algorithm(
        "fedgen",
        gm_terms=[GenerativeTeacher(p.alpha, p.noise_dim)],
        extras=extras,
        hooks=Hooks(n),
        server=GeneratorServer(p, int(run.get("seed", 0))),
    )


register("fedgen", FedGenParams, build)
