"""FedGen: the server's generator objective, its exact recovery of each client's head and counts,
one generator step by hand, and the client's generative term."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, global_payload
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import extra_name
from wafl.common.algorithms.fedgen import (
    COUNTS,
    GEN,
    HEADS,
    MARK,
    diversity_loss,
    generate,
    load_generator,
    teacher_loss,
)
from wafl.common.config import ConfigError, load_config
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def slow_teacher(h, y, heads, counts) -> float:
    total = 0.0
    for i, (w, b) in enumerate(heads):
        for k in range(len(y)):
            yk = int(y[k])
            share = float(counts[i, yk]) / float(counts[:, yk].sum())
            logits = [float(w[c] @ h[k] + b[c]) for c in range(w.shape[0])]
            lse = math.log(sum(math.exp(v) for v in logits))
            total += share * (lse - logits[yk]) / len(y)
    return total


def slow_diversity(h, z) -> float:
    n = len(h)
    acc = 0.0
    for a in range(n):
        for b in range(n):
            acc += float((h[a] - h[b]).abs().mean()) * float(((z[a] - z[b]) ** 2).mean())
    return math.exp(-acc / (n * n))


def test_generator_objective_matches_slow_loops() -> None:
    gen = torch.Generator().manual_seed(0)
    h, z = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
    y = torch.tensor([0, 1, 2, 1, 0, 2])
    heads = [(torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)) for _ in range(2)]
    counts = torch.tensor([[5.0, 0.0, 2.0], [1.0, 3.0, 2.0]])
    assert teacher_loss(h, y, heads, counts).item() == pytest.approx(slow_teacher(h, y, heads, counts), rel=1e-5)
    assert diversity_loss(h, z).item() == pytest.approx(slow_diversity(h, z), rel=1e-5)


def test_server_recovers_heads_and_takes_a_generator_step(digits) -> None:
    p = {"gen_steps": 1, "gen_batch": 5, "gen_lr": 0.01, "eta": 0.5, "noise_dim": 4}
    algo = registry.resolve("fedgen", p, {"num_clients": 3, "seed": 7})
    t = client(digits, "fedgen", p, num_clients=3, seed=7)
    prev = dict(algo.payload(t.gm))
    gen = torch.Generator().manual_seed(1)
    # two of three clients upload, with weights 100 and 300 (sample counts)
    heads = {0: torch.randn(10, 33, generator=gen), 2: torch.randn(10, 33, generator=gen)}
    counts = {0: torch.tensor([4.0, 0, 0, 1, 0, 0, 0, 0, 0, 0]), 2: torch.tensor([0.0, 2, 0, 3, 0, 0, 0, 0, 0, 0])}
    weights = {0: 100.0, 2: 300.0}
    mean = {}
    for k, v in prev.items():
        mean[k] = sum(weights[i] * v for i in weights) / 400.0
    mean[extra_name(HEADS)] = torch.zeros(3, 10, 33)
    mean[extra_name(COUNTS)] = torch.zeros(3, 10)
    mean[extra_name(MARK)] = torch.zeros(3)
    for i, w in weights.items():
        mean[extra_name(HEADS)][i] = w / 400 * heads[i]
        mean[extra_name(COUNTS)][i] = w / 400 * counts[i]
        mean[extra_name(MARK)][i] = w / 400
    out = algo.server.finalize(prev, mean, participants=2)
    # one Adam step (first step: lr * g / (|g| + eps)) on the slow objective, same samples
    g0 = load_generator({k[len(extra_name("")) :]: v for k, v in prev.items() if k.startswith(extra_name(GEN))}, 4, 10)
    sampler = torch.Generator().manual_seed(7 * 1000 + 1)
    held = [0, 1, 3]
    y = torch.tensor(held)[torch.randint(3, (5,), generator=sampler)]
    zz = torch.randn(5, 4, generator=sampler)
    params = list(g0.parameters())
    hh = generate(g0, zz, y, 10)
    wb = [(heads[i][:, :-1], heads[i][:, -1]) for i in (0, 2)]
    loss = teacher_loss(hh, y, wb, torch.stack([counts[0], counts[2]])) + 0.5 * diversity_loss(hh, zz)
    assert loss.item() == pytest.approx(
        slow_teacher(hh.detach(), y, wb, torch.stack([counts[0], counts[2]])) + 0.5 * slow_diversity(hh.detach(), zz),
        rel=1e-5,
    )
    grads = torch.autograd.grad(loss, params)
    for (name, _), p0, g in zip(g0.named_parameters(), params, grads):
        want = p0.detach() - 0.01 * g / (g.abs() + 1e-8)
        assert torch.allclose(out[extra_name(GEN + name)], want, atol=1e-6)
    got_counts = out[extra_name(COUNTS)]
    assert torch.equal(got_counts[:2], torch.stack([counts[0], counts[2]]))  # recovered exactly


def test_client_term_and_upload_rows(digits) -> None:
    t = client(digits, "fedgen", {"alpha": 0.7, "noise_dim": 4}, index=1, num_clients=3)
    g = global_payload(t)
    t.begin_round(1, g)
    up = t.gm_upload_state()
    assert torch.equal(up[extra_name(MARK)], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(up[extra_name(HEADS)][1, :, :32], t.gm.classifier.weight.detach())
    assert torch.equal(up[extra_name(COUNTS)][1], t.label_counts)
    # with label counts in the broadcast the term is on: alpha * CE(head(G(z, y^)), y^), y^ ~ p(y)
    g[extra_name(COUNTS)] = torch.zeros(3, 10)
    g[extra_name(COUNTS)][0] = torch.arange(10, dtype=torch.float32)
    ctx = t.begin_round(2, g)
    term = t.algorithm.gm_terms[0]
    term.begin(ctx, t.gm)
    x = torch.as_tensor(digits.train.tensors[0][:8])
    h, logits = t.gm.forward_split(x)
    from wafl.common.algorithms.base import Forward

    value = term(t.gm, Forward(x, torch.zeros(8, dtype=torch.int64), h, logits, ctx), ctx)
    rng = np.random.default_rng([2, 1, 21])
    prior = np.arange(10) / 45.0
    torch_gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    yy = torch.as_tensor(rng.choice(10, size=8, p=prior))
    zz = torch.randn(8, 4, generator=torch_gen)
    gen = load_generator({k[len(extra_name("")) :]: v for k, v in g.items() if k.startswith(extra_name(GEN))}, 4, 10)
    want = 0.7 * F.cross_entropy(t.gm.classifier(generate(gen, zz, yy, 10)), yy)
    assert value.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_a_robust_center_is_refused_at_start(aggregator: str) -> None:
    """A coordinate-wise center of the per-client rows is zero: the first aggregation would find no head."""
    with pytest.raises(ConfigError, match=rf"algorithm='fedgen' with aggregator='{aggregator}'"):
        load_config(overrides={"algorithm": "fedgen", "aggregator": aggregator, "num_clients": 20})
