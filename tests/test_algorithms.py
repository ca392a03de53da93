"""Algorithms plugged into the one trainer: exact reductions, composition, client state."""

import copy
from collections import OrderedDict

import pytest
import torch
from wafl.client.trainer import Trainer
from wafl.common.algorithms import registry
from wafl.common.config import load_config
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def one_round(
    digits,
    algorithm: str,
    params: dict | None = None,
    index: int = 0,
    rounds_done: int = 0,
    state_dir=None,
    pm: bool = False,
):
    cfg = load_config(None, {"algorithm": algorithm, "params": params or {}, "local_epochs": 1, "num_clients": 5})
    t = Trainer(cfg, index, state_dir=state_dir, dataset=digits, device="cpu")
    g = OrderedDict((k, v.clone()) for k, v in t.gm.state_dict().items())
    t.begin_round(1 + rounds_done, g)
    t.train_gm()
    if pm:
        t.train_pm(None, 1.0)
    return t


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_scd_with_zero_weights_trains_the_gm_exactly_like_fedavg(digits) -> None:
    a = one_round(digits, "fedavg")
    b = one_round(digits, "scd", {"lambda_g": 0, "lambda_p": 0})
    assert all(torch.equal(x, y) for x, y in zip(weights(a.gm), weights(b.gm)))
    c = one_round(digits, "scd", {"lambda_g": 0.3})
    assert not all(torch.equal(x, y) for x, y in zip(weights(a.gm), weights(c.gm)))


def test_scd_gm_term_pulls_towards_the_pm_spectrum(digits) -> None:
    """With a PM different from the global model, the GM term is non-zero and has a gradient."""
    cfg = load_config(None, {"algorithm": "scd", "local_epochs": 1, "num_clients": 5})
    t = Trainer(cfg, 0, dataset=digits, device="cpu")
    g = OrderedDict((k, v.clone()) for k, v in t.gm.state_dict().items())
    ctx = t.begin_round(1, g)
    with torch.no_grad():  # a scaled copy has the same normalized spectrum: perturb instead
        gen = torch.Generator().manual_seed(0)
        for p in t.pm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    term = t.algorithm.gm_terms[0]
    term.begin(ctx, t.gm)
    x, y = digits.train.tensors[0][:8], digits.train.tensors[1][:8]
    from wafl.common.algorithms.base import Forward

    h, logits = t.gm.forward_split(x)
    loss = term(t.gm, Forward(x, y, h, logits, ctx), ctx)
    assert loss.item() > 0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in t.gm.parameters())


@pytest.mark.parametrize("base", ["fedavg", "fedprox", "feddyn", "fedntd"])
def test_asd_with_zero_lambda_is_exactly_the_base_method(digits, base: str) -> None:
    a = one_round(digits, base)
    b = one_round(digits, f"{base}+asd", {"asd_lambda": 0})
    assert all(torch.equal(x, y) for x, y in zip(weights(a.gm), weights(b.gm)))
    c = one_round(digits, f"{base}+asd", {"asd_lambda": 2.0})
    assert not all(torch.equal(x, y) for x, y in zip(weights(a.gm), weights(c.gm)))


def test_composition_appends_one_term_and_keeps_the_base() -> None:
    base = registry.resolve("fedprox", {"mu": 0.1})
    both = registry.resolve("fedprox+asd", {"mu": 0.1})
    assert [t.name for t in base.gm_terms] == ["proximal"]
    assert [t.name for t in both.gm_terms] == ["proximal", "asd"]
    dyn = registry.resolve("feddyn+asd", {}, {"num_clients": 7})
    assert type(dyn.server).__name__ == "FedDynUpdate" and dyn.server.num_clients == 7


def test_ditto_pm_is_trained_and_gm_is_plain(digits) -> None:
    a = one_round(digits, "fedavg")
    d = one_round(digits, "ditto", pm=True)
    assert all(torch.equal(x, y) for x, y in zip(weights(a.gm), weights(d.gm)))
    assert not all(torch.equal(x, y) for x, y in zip(weights(d.gm), weights(d.pm)))


def test_feddyn_client_state_persists_across_a_restart(digits, tmp_path) -> None:
    t = one_round(digits, "feddyn", {"alpha": 0.1}, state_dir=tmp_path)
    g_k = [g.clone() for g in t.client_state["feddyn_grad"]]
    assert any(g.abs().sum() > 0 for g in g_k)
    # g_k = -alpha (w_k - w_g) after the first round (g starts at 0)
    w_g = [p.detach() for p in t.ctx.teacher.parameters()]
    for g, wk, wg in zip(g_k, t.gm.parameters(), w_g):
        assert torch.allclose(g, -0.1 * (wk.detach() - wg), atol=1e-6)
    cfg = copy.deepcopy(t.cfg)
    restarted = Trainer(cfg, 0, state_dir=tmp_path, dataset=digits, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(restarted.client_state["feddyn_grad"], g_k))


def test_pm_persists_across_a_restart(digits, tmp_path) -> None:
    t = one_round(digits, "scd", state_dir=tmp_path, pm=True)
    again = Trainer(copy.deepcopy(t.cfg), 0, state_dir=tmp_path, dataset=digits, device="cpu")
    assert again.pm_initialized
    assert all(torch.equal(a, b) for a, b in zip(weights(t.pm), weights(again.pm)))
    other = Trainer(
        load_config(None, {"algorithm": "scd", "seed": 9, "num_clients": 5}),
        0,
        state_dir=tmp_path,
        dataset=digits,
        device="cpu",
    )
    assert not other.pm_initialized  # another run's state is not picked up


def test_fedhkd_shares_knowledge_and_reports_privacy(digits) -> None:
    t = one_round(digits, "fedhkd", {"sigma": 0.0})
    k = t.knowledge()
    assert k and all(len(c.rep) == t.cfg.training.code_len and abs(float(c.soft.sum()) - 1) < 1e-4 for c in k.values())
    counts = torch.bincount(torch.as_tensor(digits.train_labels[t.train_idx]), minlength=10)
    assert {c.class_id for c in k.values()} == {j for j in range(10) if counts[j] >= 0.25 * counts.sum()}
    noisy = registry.resolve("fedhkd", {"sigma": 7.0})
    one, run = noisy.privacy(1), noisy.privacy(30)
    assert 0 < one["epsilon_per_release"] < run["epsilon_per_run"]
    assert registry.resolve("fedhkd", {"sigma": 0.0}).privacy(3)["epsilon_per_run"] is None


def test_training_on_digits_beats_chance(digits) -> None:
    t = one_round(digits, "fedavg")
    for _ in range(3):
        t.train_gm()
    acc, n = t.evaluate_local(t.gm)
    assert n > 0 and acc > 0.5


def test_a_step_rule_sees_each_batch_in_one_frozen_step_context(digits) -> None:
    """The trainer hands a rule the phase's model, trained parameters and optimizer, and each batch's
    closure and ``(x, y)``; the closure is the batch's loss (here plain cross-entropy)."""
    import dataclasses

    import torch.nn.functional as F
    from wafl.common.algorithms.base import RoundContext, StepContext, StepRule
    from wafl.common.models import build_model
    from wafl.common.training import run_phase

    seen: list[StepContext] = []

    class Spy(StepRule):
        def step(self, ctx: StepContext) -> torch.Tensor:
            seen.append(ctx)
            with pytest.raises(dataclasses.FrozenInstanceError):
                ctx.batch = ctx.batch  # type: ignore[misc]  # the assignment is what the test checks
            x, y = ctx.batch
            assert torch.equal(ctx.closure(), F.cross_entropy(ctx.model(x), y))
            return super().step(ctx)

    torch.manual_seed(0)
    model = build_model("cnn", digits.num_classes, digits.in_channels, digits.image_size)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    data = [(torch.stack([digits.train[i][0] for i in range(j, j + 8)]), torch.arange(j, j + 8) % 10) for j in (0, 8)]
    rctx = RoundContext(1, model.state_dict(), model, None, torch.ones(10) / 10, {})
    stats = run_phase(model, [], rctx, iter(data), opt, step=Spy(), params=params)
    assert stats.steps == 2 and len(seen) == 2
    for ctx, (x, y) in zip(seen, data):
        assert ctx.model is model and ctx.optimizer is opt and ctx.params == params
        assert ctx.batch[0] is x and ctx.batch[1] is y


def test_a_part_used_without_its_state_raises_a_named_error() -> None:
    """pFedMe's step without a personal model, and MOON's and SCD's terms before their phase's
    ``begin``, raise AlgorithmStateError naming the method and what is missing (not a bare assert)."""
    from wafl.common.algorithms.base import AlgorithmStateError, RoundContext, StepContext
    from wafl.common.algorithms.moon import ModelContrast
    from wafl.common.algorithms.pfedme import MoreauStep
    from wafl.common.algorithms.scd import SpectralDistillation
    from wafl.common.models import build_model

    model = build_model("cnn", 10, 1, 8)
    rctx = RoundContext(1, model.state_dict(), model, None, torch.ones(10) / 10, {})
    with pytest.raises(AlgorithmStateError, match="pfedme: .*personal model"):
        MoreauStep(15.0, 0.01, 5).begin(rctx, model, list(model.parameters()))
    batch = (torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.int64))
    step = StepContext(
        model, list(model.parameters()), lambda: torch.zeros(()), torch.optim.SGD(model.parameters()), batch
    )
    with pytest.raises(AlgorithmStateError, match="pfedme: .*before its phase began"):
        MoreauStep(15.0, 0.01, 5).step(step)
    with pytest.raises(AlgorithmStateError, match="moon: .*before its phase began"):
        ModelContrast(1.0, 0.5)(model, None, rctx)  # type: ignore[arg-type]  # never reaches the forward pass
    with pytest.raises(AlgorithmStateError, match="scd: the scd_gm term's teacher, the PM, was not built"):
        SpectralDistillation(0.3, "pm", "model", 0.4).begin(rctx, model)
    with pytest.raises(AlgorithmStateError, match="scd: .*before its phase began"):
        SpectralDistillation(0.3, "pm", "model", 0.4)(model, None, rctx)  # type: ignore[arg-type]  # as above


@pytest.mark.parametrize("algorithm, kind", [("fedavg", "local"), ("fedhkd", "pm"), ("scd", None)])
def test_gm_round_is_the_gm_phase_s_calls_in_one(digits, algorithm: str, kind: str | None) -> None:
    """``gm_round`` gives what ``train_gm``, ``knowledge``, the local evaluation and ``gm_upload_state``
    give one after another, from the same start (the same seed): one hop to the training thread or process."""
    cfg = load_config(None, {"algorithm": algorithm, "local_epochs": 1, "num_clients": 5})
    one, two = (Trainer(cfg, 1, dataset=digits, device="cpu") for _ in range(2))
    g = OrderedDict((k, v.clone()) for k, v in one.gm.state_dict().items() if one.algorithm.shares(k))
    for t in (one, two):
        t.begin_round(1, g)
    got = one.gm_round(None, evaluate=True)
    stats, knowledge = two.train_gm(), two.knowledge()
    if kind == "pm":
        evaluated = ("pm", *two.evaluate_personal())
    elif kind == "local":
        evaluated = ("local", *two.evaluate_local(two.gm))
    else:
        evaluated = None
    state = two.gm_upload_state()
    assert (got.stats.steps, got.stats.loss_sum) == (stats.steps, stats.loss_sum) and got.evaluated == evaluated
    assert got.evaluated is None or got.evaluated[2] > 0
    assert list(got.state) == list(state) and all(torch.equal(got.state[k], state[k]) for k in state)
    assert (got.knowledge is None) == (knowledge is None) == (algorithm != "fedhkd")
    if knowledge is not None:
        assert sorted(got.knowledge) == sorted(knowledge)
        assert all(torch.equal(got.knowledge[j].rep, knowledge[j].rep) for j in knowledge)
    assert one.gm_round(None).evaluated is None  # not asked: no evaluation
