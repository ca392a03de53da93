"""Gradient clipping of local steps: the run option ``grad_clip`` (every step of every method, as the code of
FedDyn and of ASD clips at 10) and FedHKD's and FedProto's ``knowledge_clip`` (the rounds with global
knowledge, as FedHKD's code clips at 1.1), each against a slow re-computation of the clipped steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload, with_variates
from wafl.common.algorithms.hyperknowledge import fedhkd_loss_terms
from wafl.common.algorithms.registry import resolve
from wafl.common.config import ConfigError, load_config
from wafl.common.datasets import load_dataset
from wafl.common.training import clip_before_step


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def slow_clip(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """``grads`` scaled by ``min(1, max_norm / (||g|| + 1e-6))``, the norm over all of them, in float64."""
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    scale = min(1.0, max_norm / (norm + 1e-6))
    return [g * scale for g in grads]


def test_clip_before_step_scales_the_gradient_the_optimizer_steps_with() -> None:
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    for max_norm in (0.01, 1e6):
        fast, slow = copy.deepcopy(model), copy.deepcopy(model)
        opt = clip_before_step(torch.optim.SGD(fast.parameters(), lr=0.5), max_norm)
        F.cross_entropy(fast(x), y).backward()
        grads = [p.grad.clone() for p in fast.parameters()]
        opt.step()
        with torch.no_grad():
            for p, g in zip(slow.parameters(), slow_clip(grads, max_norm)):
                p.sub_(0.5 * g.float())
        assert close(fast, slow, atol=1e-7)
        pairs = zip(fast.parameters(), model.parameters())
        moved = math.sqrt(sum(float(((a.detach() - b.detach()) ** 2).sum()) for a, b in pairs))
        if max_norm < 1:
            assert moved == pytest.approx(0.5 * max_norm, rel=1e-4)  # the step is lr x the bound
        else:  # a bound above the gradient: the same bits as an optimizer without it
            plain = copy.deepcopy(model)
            F.cross_entropy(plain(x), y).backward()
            torch.optim.SGD(plain.parameters(), lr=0.5).step()
            assert all(torch.equal(a, b) for a, b in zip(fast.parameters(), plain.parameters()))


def test_grad_clip_zero_leaves_the_optimizer_as_it_is() -> None:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert clip_before_step(opt, 0.0) is opt and not opt._optimizer_step_pre_hooks


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_grad_clip_must_be_a_finite_non_negative_number(value: float) -> None:
    with pytest.raises(ConfigError, match=r"grad_clip=.* must lie in \[0.0, inf\]"):
        load_config(None, {"grad_clip": value})


def test_the_run_option_clips_every_local_step(digits) -> None:
    t = client(digits, "fedavg", grad_clip=0.05)
    t.begin_round(1, global_payload(t))
    slow = copy.deepcopy(t.gm)
    (batches,) = future_batches(t, 1)
    for xb, yb in batches:
        grads = torch.autograd.grad(F.cross_entropy(slow(xb), yb), list(slow.parameters()))
        with torch.no_grad():
            for p, g in zip(slow.parameters(), slow_clip(list(grads), 0.05)):
                p.sub_(0.05 * g.float())
    t.train_gm()
    assert close(t.gm, slow)


def test_scaffold_clips_the_corrected_gradient(digits) -> None:
    """ASD's code clips SCAFFOLD's step after the correction (the linear term is in its loss): so does the option."""
    t = client(digits, "scaffold", grad_clip=0.05)
    g, c, c_i = with_variates(t, 0.5)
    names = [n for n, _ in t.gm.named_parameters()]
    t.begin_round(1, g)
    slow = copy.deepcopy(t.gm)
    (batches,) = future_batches(t, 1)
    for xb, yb in batches:
        grads = torch.autograd.grad(F.cross_entropy(slow(xb), yb), list(slow.parameters()))
        corrected = [gr - c_i[n] + c[n] for n, gr in zip(names, grads)]
        with torch.no_grad():
            for p, gr in zip(slow.parameters(), slow_clip(corrected, 0.05)):
                p.sub_(0.05 * gr.float())
    t.train_gm()
    assert close(t.gm, slow)


def hkd_steps(t, batches, knowledge, max_norm: float | None) -> torch.nn.Module:
    """FedHKD's local steps by hand: CE + lambda t1 + gamma t2 (the defaults), clipped to ``max_norm``."""
    p = t.algorithm.params
    slow = copy.deepcopy(t.gm)
    for xb, yb in batches:
        h, z = slow.forward_split(xb)
        t1, t2 = fedhkd_loss_terms(h, yb, slow.classifier, knowledge, p["temperature"])
        loss = F.cross_entropy(z, yb) + p["lambda"] * t1 + p["gamma"] * t2
        grads = list(torch.autograd.grad(loss, list(slow.parameters())))
        if max_norm is not None:
            grads = slow_clip(grads, max_norm)
        with torch.no_grad():
            for w, gr in zip(slow.parameters(), grads):
                w.sub_(0.05 * gr.float())
    return slow


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fedhkd_clips_the_rounds_with_knowledge_only(digits, clip: float) -> None:
    first = client(digits, "fedhkd", {"knowledge_clip": clip, "sigma": 0.0})
    first.begin_round(1, global_payload(first))
    (batches,) = future_batches(first, 1)
    slow = hkd_steps(first, batches, {}, None)  # round 1: no knowledge, no clip (the authors' update_weights)
    first.train_gm()
    assert close(first.gm, slow)
    knowledge = first.knowledge()
    assert knowledge

    t = client(digits, "fedhkd", {"knowledge_clip": clip, "sigma": 0.0}, index=1)
    g = global_payload(t)
    t.begin_round(2, g, knowledge)
    (batches,) = future_batches(t, 1)
    slow = hkd_steps(t, batches, knowledge, clip or None)
    unclipped = hkd_steps(t, batches, knowledge, None)
    t.train_gm()
    assert close(t.gm, slow)
    assert close(t.gm, unclipped) == (clip == 0)  # the clip is active at 0.05


def test_the_knowledge_clip_defaults_to_the_authors_code() -> None:
    assert resolve("fedhkd", {}).params["knowledge_clip"] == 1.1
    assert resolve("fedproto-avg", {}).params["knowledge_clip"] == 1.1
    assert "knowledge_clip" not in resolve("fedproto", {}).params  # FedProto's own paper and code: no clip


def test_a_client_whose_training_diverges_stops_with_one_line_instead_of_uploading(digits, tmp_path) -> None:
    """NaN weights are not uploaded (the server would refuse them as malformed): the client names the round and
    the tensor; in process the run ends with that error, and grad_clip keeps the same steps finite."""
    from wafl.cli.sim.simulate import simulate
    from wafl.common.errors import TrainingDiverged

    t = client(digits, "fedavg", lr=1e30)
    t.begin_round(3, global_payload(t))
    with pytest.raises(TrainingDiverged, match=r"client 0, round 3: local training diverged, \d+ tensor\(s\)"):
        t.gm_round()
    cfg = {"num_clients": 2, "rounds": 2, "lr": 1e30, "local_epochs": 1, "protocol": "compute-and-wait"}
    with pytest.raises(TrainingDiverged, match="round 1: local training diverged"):
        simulate(load_config(None, cfg), tmp_path / "a")
    clipped = client(digits, "fedavg", lr=1e30, grad_clip=1e-30)
    clipped.begin_round(3, global_payload(clipped))
    assert all(bool(torch.isfinite(v).all()) for v in clipped.gm_round().state.values())
