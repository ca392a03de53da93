"""Partitions: deterministic from the seed, disjoint, the skew they promise, local test sets."""

import numpy as np
import pytest
from wafl.common.datasets import load_dataset
from wafl.common.partition import (
    client_shard,
    dirichlet_equal_partition,
    dirichlet_partition,
    iid_partition,
    local_test_indices,
    partition,
)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_digits_split_is_fixed_and_balanced(digits) -> None:
    assert len(digits.train_labels) + len(digits.test_labels) == 1797
    again = load_dataset("digits")
    assert np.array_equal(digits.test_labels, again.test_labels)
    counts = np.bincount(digits.test_labels)
    assert counts.min() >= 35 and counts.max() <= 37


@pytest.mark.parametrize("kind", ["dirichlet", "dirichlet-equal", "iid"])
def test_partition_is_deterministic_and_disjoint(digits, kind: str) -> None:
    a = partition(digits.train_labels, 10, kind, 0.5, 0.3, seed=3)
    b = partition(digits.train_labels, 10, kind, 0.5, 0.3, seed=3)
    c = partition(digits.train_labels, 10, kind, 0.5, 0.3, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    flat = np.concatenate(a)
    assert len(flat) == len(np.unique(flat))


def test_dirichlet_covers_everything_and_skews_with_alpha(digits) -> None:
    y = digits.train_labels

    def mean_max_share(alpha: float) -> float:
        shards = dirichlet_partition(y, 10, alpha, seed=0)
        assert sorted(np.concatenate(shards).tolist()) == list(range(len(y)))
        return float(np.mean([np.bincount(y[s], minlength=10).max() / len(s) for s in shards]))

    # a client's largest class share grows as alpha shrinks; IID-like is ~0.1-0.2
    assert mean_max_share(0.1) > mean_max_share(0.5) > mean_max_share(100.0)
    assert mean_max_share(100.0) < 0.2
    assert mean_max_share(0.1) > 0.5


def test_every_dirichlet_client_gets_min_size(digits) -> None:
    shards = dirichlet_partition(digits.train_labels, 20, 0.1, seed=1, min_size=10)
    assert min(len(s) for s in shards) >= 10


def test_dirichlet_equal_sizes_and_prior_skew(digits) -> None:
    y = digits.train_labels
    shards = dirichlet_equal_partition(y, 20, 0.3, seed=0)
    assert {len(s) for s in shards} == {len(y) // 20}
    shares = [np.bincount(y[s], minlength=10).max() / len(s) for s in shards]
    assert np.mean(shares) > 0.35  # Dir(0.3) priors concentrate on few classes


def test_iid_sizes() -> None:
    shards = iid_partition(103, 10, seed=0)
    assert sorted(len(s) for s in shards) == [10] * 7 + [11] * 3


def test_local_test_set_follows_train_proportions(digits) -> None:
    train_labels = np.array([0] * 60 + [3] * 30 + [7] * 10)
    idx = local_test_indices(digits.test_labels, train_labels, 0.25, seed=0, client_index=2)
    got = np.bincount(digits.test_labels[idx], minlength=10)
    assert got[0] == 15 and got[3] == 8 and got[7] == 2 or (got[0], got[3], got[7]) == (15, 7, 3)
    assert got.sum() == 25 and got[[1, 2, 4, 5, 6, 8, 9]].sum() == 0
    assert len(np.unique(idx)) == len(idx)


def test_client_shard_rebuilds_identically_in_any_process(digits) -> None:
    a = client_shard(digits.train_labels, digits.test_labels, 10, "dirichlet", 0.5, 0.3, 0, 4, 0.25)
    b = client_shard(digits.train_labels, digits.test_labels, 10, "dirichlet", 0.5, 0.3, 0, 4, 0.25)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
    with pytest.raises(ValueError, match="client index 10"):
        client_shard(digits.train_labels, digits.test_labels, 10, "dirichlet", 0.5, 0.3, 0, 10, 0.25)


def test_many_dirichlet_clients_get_the_draw_with_the_largest_smallest_shard(digits) -> None:
    y = digits.train_labels  # 200 clients: about 7 images each, no draw gives all of them 7
    shards = dirichlet_partition(y, 200, 0.5, seed=0, max_tries=50)
    assert sorted(np.concatenate(shards).tolist()) == list(range(len(y)))
    assert min(len(s) for s in shards) >= 1
    assert all(np.array_equal(a, b) for a, b in zip(shards, dirichlet_partition(y, 200, 0.5, seed=0, max_tries=50)))
    with pytest.raises(ValueError, match="fewer clients, a larger alpha, or partition iid"):
        dirichlet_partition(y[:100], 90, 0.05, seed=0, max_tries=5)  # some client gets no sample at all


def test_a_split_is_computed_once_and_shared_read_only(digits, monkeypatch) -> None:
    import wafl.common.partition as P

    calls = []
    real = P.dirichlet_partition
    monkeypatch.setattr(P, "dirichlet_partition", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = (digits.train_labels, 13, "dirichlet", 0.37, 0.3, 5)
    first, again = P.partition(*args), P.partition(*args)
    assert len(calls) == 1 and all(a is b for a, b in zip(first, again))
    assert not first[0].flags.writeable
    assert P.partition(digits.train_labels, 13, "dirichlet", 0.37, 0.3, 6) is not None and len(calls) == 2


def test_equal_split_with_a_fixed_client_size(digits):
    y = digits.train_labels
    for n in (5, 10, 20):
        shards = dirichlet_equal_partition(y, n, 0.5, seed=0, size=60)
        assert [len(s) for s in shards] == [60] * n  # the same local size whatever the client count
        allocated = np.concatenate(shards)
        assert len(np.unique(allocated)) == 60 * n  # disjoint; the rest of the split is left out
    assert partition(y, 10, "dirichlet-equal", 0.1, 0.5, 0, 60)[3].tolist() == shards_of(y, 10, 60)[3].tolist()
    shard = client_shard(y, digits.test_labels, 10, "dirichlet-equal", 0.1, 0.5, 0, 3, 0.25, 60)
    assert len(shard.train) == 60 and len(shard.test) == 15
    with pytest.raises(ValueError, match=r"client_size=100 for 20 clients needs 2000 samples"):
        dirichlet_equal_partition(y, 20, 0.5, seed=0, size=100)


def shards_of(y, n, size):
    return dirichlet_equal_partition(y, n, 0.5, seed=0, size=size)


def test_client_size_needs_the_equal_split():
    from wafl.common.config import ConfigError, load_config

    assert load_config(None, {"partition": "dirichlet-equal", "client_size": 50}).data.client_size == 50
    with pytest.raises(ConfigError, match="client_size=50 needs partition='dirichlet-equal'"):
        load_config(None, {"partition": "dirichlet", "client_size": 50})
    with pytest.raises(ConfigError, match="client_size=0"):
        load_config(None, {"partition": "dirichlet-equal", "client_size": 0})


def test_dirichlet_partition_refuses_no_tries(digits) -> None:
    with pytest.raises(ValueError, match="max_tries=0 must be at least 1"):
        dirichlet_partition(digits.train_labels, 4, 0.5, seed=0, max_tries=0)


def _dirichlet_by_lists(labels: np.ndarray, num_clients: int, alpha: float, seed: int, max_tries: int) -> list:
    """The split as first written (every try builds its shards as lists): the slow recomputation."""
    classes = np.unique(labels)
    rng = np.random.default_rng([seed, 2])
    min_size = min(10, len(labels) // num_clients)
    best = None
    for _ in range(max_tries):
        shards: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            for k, part in enumerate(np.split(idx, (np.cumsum(p) * len(idx)).astype(int)[:-1])):
                shards[k].extend(part.tolist())
        if best is None or min(map(len, shards)) > min(map(len, best)):
            best = shards
        if min(map(len, shards)) >= min_size:
            break
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in best]


@pytest.mark.parametrize(
    ("clients", "alpha", "seed", "tries"),
    [(10, 0.5, 0, 1000), (20, 0.1, 1, 1000), (100, 0.5, 0, 40), (100, 0.1, 3, 40), (7, 0.01, 2, 1000)],
)
def test_dirichlet_split_equals_the_list_building_one(digits, clients, alpha, seed, tries) -> None:
    y = digits.train_labels
    fast = dirichlet_partition(y, clients, alpha, seed=seed, max_tries=tries)
    slow = _dirichlet_by_lists(y, clients, alpha, seed, tries)
    assert len(fast) == len(slow) == clients
    assert all(a.dtype == np.int64 and np.array_equal(a, b) for a, b in zip(fast, slow))
