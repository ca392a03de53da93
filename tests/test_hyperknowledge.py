"""FedHKD hyper-knowledge and FedProto prototypes against slow per-sample re-computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from wafl.common.algorithms.hyperknowledge import extract_knowledge, fedhkd_loss_terms
from wafl.common.algorithms.prototypes import extract_prototypes, fedproto_term
from wafl.common.knowledge import ClassKnowledge, KnowledgeAccumulator, aggregate_knowledge, validate_knowledge
from wafl.common.models.base import SplitModel

C = 3
D_IN = 5


def make_model(code_len: int = 4, scale: float = 1.0, seed: int = 0) -> SplitModel:
    torch.manual_seed(seed)
    lin = nn.Linear(D_IN, code_len)
    with torch.no_grad():
        lin.weight.mul_(scale)
    # Dropout makes train-mode outputs differ from eval-mode ones.
    return SplitModel(nn.Sequential(lin, nn.Dropout(0.5)), code_len, C)


def make_data(counts: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.full((n,), j, dtype=torch.int64) for j, n in enumerate(counts)])
    y = y[torch.randperm(len(y), generator=g)]
    x = torch.randn(len(y), D_IN, generator=g)
    return x, y


def batches(
    x: torch.Tensor, y: torch.Tensor, sizes: tuple[int, ...] = (7, 3, 11)
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, i, k = [], 0, 0
    while i < len(y):
        s = sizes[k % len(sizes)]
        out.append((x[i : i + s], y[i : i + s]))
        i, k = i + s, k + 1
    return out


def slow_knowledge(
    model: SplitModel, x, y, zeta: float | None, temperature: float
) -> dict[int, tuple[int, list, list]]:
    """Per-sample python loop: counts, mean clipped rep, mean softmax(logits(unclipped h) / T)."""
    model.eval()
    acc: dict[int, list] = {}
    with torch.no_grad():
        for i in range(len(y)):
            h = model.features(x[i : i + 1])[0]
            z = model.classifier(h)
            e = [math.exp(float(v) / temperature) for v in z]
            soft = [v / sum(e) for v in e]
            rep = [min(max(float(v), -zeta), zeta) if zeta is not None else float(v) for v in h]
            entry = acc.setdefault(int(y[i]), [0, [0.0] * len(rep), [0.0] * C])
            entry[0] += 1
            entry[1] = [a + b for a, b in zip(entry[1], rep)]
            entry[2] = [a + b for a, b in zip(entry[2], soft)]
    return {j: (n, [v / n for v in r], [v / n for v in s]) for j, (n, r, s) in acc.items()}


def test_extract_matches_slow_loop_and_restores_mode():
    model = make_model(scale=3.0)
    model.train()
    x, y = make_data([9, 12, 6])
    zeta, temp = 0.8, 0.5
    k = extract_knowledge(model, batches(x, y), C, nu=0.0, zeta=zeta, sigma=0.0, temperature=temp, generator=None)
    assert model.training and all(m.training for m in model.modules())
    slow = slow_knowledge(model, x, y, zeta, temp)
    assert sorted(k) == sorted(slow) == [0, 1, 2]
    for j, (n, rep, soft) in slow.items():
        assert k[j].class_id == j and k[j].count == n
        assert torch.allclose(k[j].rep, torch.tensor(rep), atol=1e-5)
        assert torch.allclose(k[j].soft, torch.tensor(soft), atol=1e-5)
    # clipping must actually be active for the test to say anything about where it applies
    model.eval()
    with torch.no_grad():
        assert bool((model.features(x).abs() > zeta).any())
    validate_knowledge(k, C, 4)


def test_soft_uses_unclipped_representation():
    model = make_model(scale=5.0)
    x, y = make_data([10, 10, 10])
    k = extract_knowledge(model, batches(x, y), C, nu=0.0, zeta=0.1, sigma=0.0, temperature=1.0, generator=None)
    unclipped = slow_knowledge(model, x, y, None, 1.0)
    for j in k:
        assert torch.allclose(k[j].soft, torch.tensor(unclipped[j][2]), atol=1e-5)


def test_threshold_nu_excludes_rare_classes_and_keeps_boundary():
    model = make_model()
    x, y = make_data([22, 10, 8])  # N = 40, nu * N = 10
    k = extract_knowledge(model, batches(x, y), C, nu=0.25, zeta=5.0, sigma=0.0, temperature=0.5, generator=None)
    assert sorted(k) == [0, 1]
    assert k[0].count == 22 and k[1].count == 10


def test_absent_class_not_shared_even_with_nu_zero():
    model = make_model()
    x, y = make_data([5, 0, 7])
    k = extract_knowledge(model, batches(x, y), C, nu=0.0, zeta=5.0, sigma=0.0, temperature=0.5, generator=None)
    assert sorted(k) == [0, 2]


def test_clip_bound_holds():
    model = make_model(scale=20.0)
    x, y = make_data([1, 1, 1])  # single samples: the mean is the clipped representation itself
    zeta = 0.3
    k = extract_knowledge(model, batches(x, y), C, nu=0.0, zeta=zeta, sigma=0.0, temperature=0.5, generator=None)
    reps = torch.stack([ck.rep for ck in k.values()])
    assert bool((reps.abs() <= zeta + 1e-7).all())
    assert bool((reps.abs() >= zeta - 1e-7).any())  # the bound is reached, so clipping happened


def test_noise_std_and_independence():
    code_len = 1000
    model = make_model(code_len=code_len)
    x, y = make_data([4, 8, 0])
    zeta, sigma = 2.0, 7.0
    clean = extract_knowledge(model, batches(x, y), C, nu=0.0, zeta=zeta, sigma=0.0, temperature=0.5, generator=None)
    g = torch.Generator().manual_seed(123)
    noise = {0: [], 1: []}
    for _ in range(20):  # 20 x 1000 = 20000 draws per class
        k = extract_knowledge(model, batches(x, y), C, nu=0.0, zeta=zeta, sigma=sigma, temperature=0.5, generator=g)
        for j in (0, 1):
            noise[j].append(k[j].rep.double() - clean[j].rep.double())
            assert torch.equal(k[j].soft, clean[j].soft)  # soft is never noised
    for j, n_j in ((0, 4), (1, 8)):
        d = torch.cat(noise[j])
        expected = sigma * 2 * zeta / n_j
        assert abs(float(d.std()) / expected - 1) < 0.05
        assert abs(float(d.mean())) < 0.05 * expected
    a, b = torch.cat(noise[0]), torch.cat(noise[1])
    corr = float(((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std()))
    assert abs(corr) < 0.05  # one independent draw per class, not a shared vector


def test_noise_reproducible_with_generator():
    model = make_model()
    x, y = make_data([6, 6, 6])
    args = dict(nu=0.0, zeta=1.0, sigma=3.0, temperature=0.5)
    k1 = extract_knowledge(model, batches(x, y), C, generator=torch.Generator().manual_seed(5), **args)
    k2 = extract_knowledge(model, batches(x, y), C, generator=torch.Generator().manual_seed(5), **args)
    k3 = extract_knowledge(model, batches(x, y), C, generator=torch.Generator().manual_seed(6), **args)
    assert all(torch.equal(k1[j].rep, k2[j].rep) for j in k1)
    assert not torch.equal(k1[0].rep, k3[0].rep)


def test_extract_rejects_bad_labels_and_params():
    model = make_model()
    x, y = make_data([3, 3, 3])
    with pytest.raises(ValueError, match="labels"):
        extract_knowledge(model, [(x, y + 1)], C, nu=0.0, zeta=1.0, sigma=0.0, temperature=0.5, generator=None)
    with pytest.raises(ValueError, match="zeta"):
        extract_knowledge(model, [(x, y)], C, nu=0.0, zeta=0.0, sigma=0.0, temperature=0.5, generator=None)
    with pytest.raises(ValueError, match="sigma"):
        extract_knowledge(model, [(x, y)], C, nu=0.0, zeta=1.0, sigma=-1.0, temperature=0.5, generator=None)


def ck(j: int, n: int, rep: list[float], soft: list[float]) -> ClassKnowledge:
    return ClassKnowledge(j, n, torch.tensor(rep), torch.tensor(soft))


def test_aggregation_weights_by_hand():
    a = {0: ck(0, 2, [1.0, 0.0], [1.0, 0.0, 0.0]), 1: ck(1, 5, [2.0, 2.0], [0.0, 1.0, 0.0])}
    b = {0: ck(0, 6, [0.0, 1.0], [0.0, 0.5, 0.5])}
    c = {0: ck(0, 2, [-1.0, 3.0], [0.2, 0.2, 0.6]), 1: ck(1, 15, [6.0, -2.0], [0.5, 0.5, 0.0])}
    before = {j: v.rep.clone() for j, v in a.items()}
    g = aggregate_knowledge([a, b, c], num_classes=4)
    assert sorted(g) == [0, 1]  # classes 2 and 3: nobody shared them
    # class 0: weights 2/10, 6/10, 2/10
    assert g[0].count == 10
    assert torch.allclose(g[0].rep, torch.tensor([0.2 * 1 + 0.6 * 0 + 0.2 * -1, 0.2 * 0 + 0.6 * 1 + 0.2 * 3]))
    assert torch.allclose(g[0].soft, torch.tensor([0.2 + 0.04, 0.3 + 0.04, 0.3 + 0.12]))
    # class 1: weights 5/20, 15/20
    assert g[1].count == 20
    assert torch.allclose(g[1].rep, torch.tensor([0.25 * 2 + 0.75 * 6, 0.25 * 2 - 0.75 * 2]))
    assert torch.allclose(g[1].soft, torch.tensor([0.375, 0.25 + 0.375, 0.0]))
    assert all(torch.equal(a[j].rep, before[j]) for j in a)  # inputs untouched

    acc = KnowledgeAccumulator(4)
    for k in (a, b, c):
        acc.add(k)
    s = acc.result()
    assert sorted(s) == sorted(g)
    for j in g:
        assert s[j].count == g[j].count and torch.equal(s[j].rep, g[j].rep) and torch.equal(s[j].soft, g[j].soft)
    assert aggregate_knowledge([], 4) == {}


def test_aggregation_rejects_out_of_range_class():
    with pytest.raises(ValueError, match="class 4"):
        aggregate_knowledge([{4: ck(4, 1, [0.0], [1.0])}], num_classes=4)


def random_knowledge(ids: list[int], code_len: int, g: torch.Generator) -> dict[int, ClassKnowledge]:
    return {
        j: ClassKnowledge(j, 3, torch.randn(code_len, generator=g), torch.softmax(torch.randn(C, generator=g), 0))
        for j in ids
    }


def test_loss_terms_match_slow_loop():
    g = torch.Generator().manual_seed(7)
    code_len, temp = 4, 0.5
    classifier = nn.Linear(code_len, C)
    know = random_knowledge([0, 2], code_len, g)  # class 1 empty
    h = torch.randn(6, code_len, generator=g, requires_grad=True)
    y = torch.tensor([0, 1, 2, 2, 1, 0])
    t1, t2 = fedhkd_loss_terms(h, y, classifier, know, temp)

    slow1 = 0.0
    with torch.no_grad():
        logits = {j: classifier(k.rep) for j, k in know.items()}
    for j, k in know.items():
        z = [float(v) / temp for v in logits[j]]
        e = [math.exp(v) for v in z]
        p = [v / sum(e) for v in e]
        slow1 += math.sqrt(sum((pi - float(qi)) ** 2 for pi, qi in zip(p, k.soft)))
    slow1 /= len(know)
    slow2 = 0.0
    for b in range(len(y)):
        j = int(y[b])
        if j in know:
            slow2 += math.sqrt(sum((float(h.detach()[b, d]) - float(know[j].rep[d])) ** 2 for d in range(code_len)))
    slow2 /= len(y)  # skipped samples still count in B
    assert t1.item() == pytest.approx(slow1, rel=1e-5)
    assert t2.item() == pytest.approx(slow2, rel=1e-5)

    (t1 + t2).backward()
    assert classifier.weight.grad is not None and classifier.weight.grad.abs().sum() > 0
    assert h.grad is not None
    assert torch.all(h.grad[1] == 0) and torch.all(h.grad[4] == 0)  # class 1 samples skipped
    assert h.grad[0].abs().sum() > 0


def test_loss_terms_empty_knowledge_are_zero_with_graph():
    classifier = nn.Linear(4, C)
    h = torch.randn(5, 4, requires_grad=True)
    t1, t2 = fedhkd_loss_terms(h, torch.zeros(5, dtype=torch.int64), classifier, {}, 0.5)
    assert t1.item() == 0.0 and t2.item() == 0.0
    assert t1.requires_grad and t2.requires_grad
    (t1 + t2).backward()
    assert torch.all(h.grad == 0)
    # knowledge present but no sample of a covered class: term2 is zero, term1 is not
    know = random_knowledge([2], 4, torch.Generator().manual_seed(0))
    t1, t2 = fedhkd_loss_terms(h, torch.zeros(5, dtype=torch.int64), classifier, know, 0.5)
    assert t1.item() > 0 and t2.item() == 0.0 and t2.requires_grad


def good(**over) -> dict[int, ClassKnowledge]:
    fields = dict(class_id=1, count=4, rep=torch.zeros(4), soft=torch.tensor([0.2, 0.3, 0.5]))
    fields.update(over)
    return {fields.pop("key", fields["class_id"]): ClassKnowledge(**fields)}


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (good(class_id=5), r"class 5: class id out of range"),
        (good(class_id=-1), r"class -1: class id out of range"),
        (good(key=2), r"class 1: stored under key 2"),
        (good(count=0), r"class 1: count 0 must be a positive"),
        (good(count=-3), r"class 1: count -3 must be a positive"),
        (good(rep=torch.zeros(5)), r"class 1: rep length \(5,\) must be \(4,\)"),
        (good(rep=torch.zeros(2, 2)), r"class 1: rep length"),
        (good(soft=torch.tensor([0.5, 0.5])), r"class 1: soft length \(2,\) must be \(3,\)"),
        (good(rep=torch.tensor([0.0, float("nan"), 0.0, 0.0])), r"class 1: rep has non-finite"),
        (good(soft=torch.tensor([float("inf"), 0.0, 0.0])), r"class 1: soft has non-finite"),
        (good(soft=torch.tensor([0.2, 0.3, 0.6])), r"class 1: soft sums to 1.1"),
        (good(soft=torch.tensor([1.2, -0.2, 0.0])), r"class 1: soft has negative"),
    ],
)
def test_validate_knowledge_rejects(bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_knowledge(bad, C, 4)


def test_validate_knowledge_names_the_class_that_breaks_a_rule_among_many():
    """The values of every class are checked at once; the error still names the (first) bad class."""
    k = {j: ClassKnowledge(j, 2, torch.zeros(4), torch.tensor([0.2, 0.3, 0.5])) for j in range(C)}
    validate_knowledge(k, C, 4)
    k[2] = ClassKnowledge(2, 2, torch.tensor([0.0, float("inf"), 0.0, 0.0]), torch.tensor([0.2, 0.3, 0.5]))
    with pytest.raises(ValueError, match=r"^class 2: rep has non-finite"):
        validate_knowledge(k, C, 4)
    k[1] = ClassKnowledge(1, 2, torch.zeros(4), torch.tensor([0.6, 0.3, 0.5]))
    with pytest.raises(ValueError, match=r"^class 1: soft sums to 1.4"):
        validate_knowledge(k, C, 4)


def test_validate_knowledge_accepts_within_tol():
    validate_knowledge(good(soft=torch.tensor([0.2, 0.3, 0.5005])), C, 4)
    with pytest.raises(ValueError):
        validate_knowledge(good(soft=torch.tensor([0.2, 0.3, 0.5005])), C, 4, tol=1e-4)


def test_prototypes_match_slow_loop():
    model = make_model(scale=4.0)
    model.train()
    x, y = make_data([9, 0, 3])
    k = extract_prototypes(model, batches(x, y), C)
    assert model.training
    slow = slow_knowledge(model, x, y, None, 1.0)
    assert sorted(k) == sorted(slow) == [0, 2]
    for j, (n, rep, soft) in slow.items():
        assert k[j].count == n
        assert torch.allclose(k[j].rep, torch.tensor(rep), atol=1e-5)
        assert torch.allclose(k[j].soft, torch.tensor(soft), atol=1e-5)
    validate_knowledge(k, C, 4)


def test_fedproto_term_matches_slow_loop():
    g = torch.Generator().manual_seed(3)
    know = random_knowledge([0, 2], 4, g)
    h = torch.randn(5, 4, generator=g, requires_grad=True)
    y = torch.tensor([1, 0, 2, 1, 2])
    out = fedproto_term(h, y, know)
    sq, n = 0.0, 0
    for b in range(5):
        j = int(y[b])
        if j in know:
            for d in range(4):
                sq += (float(h.detach()[b, d]) - float(know[j].rep[d])) ** 2
                n += 1
    assert out.item() == pytest.approx(sq / n, rel=1e-5)
    out.backward()
    assert torch.all(h.grad[0] == 0) and h.grad[1].abs().sum() > 0
    z = fedproto_term(h, torch.tensor([1, 1, 1, 1, 1]), know)
    assert z.item() == 0.0 and z.requires_grad
    assert fedproto_term(h, y, {}).item() == 0.0
