"""Helpers for the algorithm tests: a client on digits, the batches it will draw, plain SGD by hand.

The slow re-computations in the tests use only these and torch's autograd on the model's
forward pass: no optimizer, no phase machinery of wafl.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from wafl.client.trainer import Trainer
from wafl.common.algorithms.base import extra_name
from wafl.common.algorithms.scaffold import PREFIX
from wafl.common.algorithms.scaffold import STATE_KEY as SCAFFOLD_STATE
from wafl.common.config import load_config
from wafl.common.training import epochs


def client(digits, algorithm: str, params: dict | None = None, index: int = 0, state_dir=None, **fields) -> Trainer:
    """Client ``index`` of a 5-client digits run with plain SGD (no momentum, no weight decay)."""
    data = {
        "algorithm": algorithm,
        "params": params or {},
        "local_epochs": 1,
        "num_clients": 5,
        "optimizer": "sgd",
        "lr": 0.05,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "batch_size": 64,
        **fields,
    }
    return Trainer(load_config(None, data), index, state_dir=state_dir, dataset=digits, device="cpu")


def global_payload(t: Trainer) -> dict[str, torch.Tensor]:
    """What the server would send first: the algorithm's payload of the initial model."""
    return dict(t.algorithm.payload(t.gm))


def future_batches(t: Trainer, *phase_epochs: float) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The batches the trainer's next phases (of ``phase_epochs`` epochs each) will draw; its RNG is
    not advanced."""
    rng = copy.deepcopy(t.rng)
    return [list(epochs(t.data.train, t.train_idx, t.cfg.training.batch_size, rng, n)) for n in phase_epochs]


def sgd_steps(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    lr: float,
) -> None:
    """``w <- w - lr * d loss / d w`` for ``params`` only, batch after batch."""
    model.train()
    for x, y in batches:
        loss = loss_fn(model, x, y)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is not None:
                    p.sub_(lr * g)


def close(a: torch.nn.Module | list[torch.Tensor], b: torch.nn.Module | list[torch.Tensor], atol: float = 1e-5) -> bool:
    pa = [p.detach() for p in (a.parameters() if isinstance(a, torch.nn.Module) else a)]
    pb = [p.detach() for p in (b.parameters() if isinstance(b, torch.nn.Module) else b)]
    return len(pa) == len(pb) and all(torch.allclose(x, y, atol=atol, rtol=1e-4) for x, y in zip(pa, pb))


def with_variates(t: Trainer, scale: float) -> tuple[dict, dict, dict]:
    """SCAFFOLD: random server and client control variates (``scale`` x N(0, 1)) put in the first payload and
    the client's state; returns ``(payload, c, c_i)``."""
    g = global_payload(t)
    names = [n for n, _ in t.gm.named_parameters()]
    assert [k for k in g if k.startswith("extra.")] == [extra_name(PREFIX + n) for n in names]
    gen = torch.Generator().manual_seed(0)
    c = {n: scale * torch.randn(p.shape, generator=gen) for n, p in t.gm.named_parameters()}
    c_i = {n: scale * torch.randn(p.shape, generator=gen) for n, p in t.gm.named_parameters()}
    for n in names:
        g[extra_name(PREFIX + n)] = c[n]
    t.client_state[SCAFFOLD_STATE] = {n: v.clone() for n, v in c_i.items()}
    return g, c, c_i
