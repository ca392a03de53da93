"""Client shards: Dirichlet label skew, equal-size Dirichlet (FedDyn/ASD style), IID.

Every partition is a pure function of ``(labels, num_clients, concentration, seed)``, so each
process (server or client) rebuilds the same split by itself and takes its own index; nothing
is shipped between processes. A client's local test set is drawn from the global test split
with the same class proportions as its local train set.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from wafl.common.choices import Partition

PARTITIONS = tuple(p.value for p in Partition)


class PartitionData(Protocol):
    """The data section's fields a partition is built from (a :class:`~wafl.common.config.DataSection`)."""

    @property
    def partition(self) -> str: ...
    @property
    def alpha(self) -> float: ...
    @property
    def delta(self) -> float: ...
    @property
    def client_size(self) -> int | None: ...


class PartitionFederation(Protocol):
    """The federation section's fields a partition is built from (a
    :class:`~wafl.common.config.FederationSection`)."""

    @property
    def num_clients(self) -> int: ...
    @property
    def seed(self) -> int: ...


class PartitionSettings(Protocol):
    """The sections of the run configuration a run's partition is built from (a
    :class:`~wafl.common.config.RunConfig` has them)."""

    @property
    def data(self) -> PartitionData: ...
    @property
    def federation(self) -> PartitionFederation: ...


def iid_partition(num_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 1])
    perm = rng.permutation(num_samples)
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 10, max_tries: int = 1000
) -> list[np.ndarray]:
    """Per-class Dirichlet split: class c's samples go to clients in proportions ~ Dir(alpha).

    Redrawn (deterministically) until every client holds at least ``min_size`` samples (at most
    the mean shard size). With many clients on a small data set no draw may reach that: then the
    draw of the ``max_tries`` whose smallest shard is largest, if that holds at least one sample.
    """
    labels = np.asarray(labels)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    rng = np.random.default_rng([seed, 2])
    min_size = min(min_size, len(labels) // num_clients)
    # A draw is each class's shuffled indices with the bounds of its clients' slices; only its shard sizes
    # are counted per try, and the shards are cut from the draw kept.
    best: tuple[int, list[tuple[np.ndarray, np.ndarray]]] | None = None
    for _ in range(max_tries):
        sizes = np.zeros(num_clients, dtype=np.int64)
        draw = []
        for members in by_class:
            idx = members.copy()
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = np.minimum((np.cumsum(p) * len(idx)).astype(int)[:-1], len(idx))
            bounds = np.concatenate(([0], cuts, [len(idx)]))
            sizes += np.diff(bounds)
            draw.append((idx, bounds))
        smallest = int(sizes.min())
        if best is None or smallest > best[0]:
            best = (smallest, draw)
        if smallest >= min_size:
            break
    if best is None:
        raise ValueError(f"max_tries={max_tries} must be at least 1")
    if best[0] < 1:
        raise ValueError(
            f"alpha={alpha}: no Dirichlet split of {len(labels)} samples gave every one of {num_clients} clients a "
            f"sample in {max_tries} tries; use fewer clients, a larger alpha, or partition iid or dirichlet-equal"
        )
    return [
        np.sort(np.concatenate([idx[b[k] : b[k + 1]] for idx, b in best[1]]).astype(np.int64, copy=False))
        for k in range(num_clients)
    ]


def dirichlet_equal_partition(
    labels: np.ndarray, num_clients: int, delta: float, seed: int, size: int | None = None
) -> list[np.ndarray]:
    """Equal-size clients, each with a class prior ~ Dir(delta) (the FedDyn/ASD papers' split).

    Every client gets ``size`` samples (default: the whole split shared out, ``len // num_clients``);
    a fixed ``size`` keeps the local sets as large whatever the client count, as the FedHKD paper
    does, and leaves the rest of the split unallocated. Each sample slot of a client draws a class
    from that client's prior, renormalized over the classes that still have samples left, and takes
    one sample of it without replacement.
    """
    labels = np.asarray(labels)
    num_classes = int(labels.max()) + 1
    rng = np.random.default_rng([seed, 3])
    priors = rng.dirichlet(np.full(num_classes, delta), size=num_clients)
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    remaining = np.array([len(p) for p in pools], dtype=float)
    if size is None:
        size = len(labels) // num_clients
    elif size * num_clients > len(labels):
        raise ValueError(
            f"client_size={size} for {num_clients} clients needs {size * num_clients} samples, "
            f"the training split has {len(labels)}"
        )
    left = np.full(num_clients, size)
    shards: list[list[int]] = [[] for _ in range(num_clients)]
    while left.sum() > 0:
        k = int(rng.integers(num_clients))
        if left[k] == 0:
            continue
        prior = priors[k] * (remaining > 0)
        if prior.sum() <= 0:  # every class the client favours is used up: fall back to what is left
            prior = (remaining > 0).astype(float)
        c = int(rng.choice(num_classes, p=prior / prior.sum()))
        shards[k].append(int(pools[c].pop()))
        remaining[c] -= 1
        left[k] -= 1
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


def local_test_indices(
    test_labels: np.ndarray, train_labels_of_client: np.ndarray, fraction: float, seed: int, client_index: int
) -> np.ndarray:
    """A local test set of ``round(fraction * n_train)`` samples with the client's train class proportions."""
    test_labels = np.asarray(test_labels)
    num_classes = int(max(test_labels.max(), train_labels_of_client.max() if len(train_labels_of_client) else 0)) + 1
    counts = np.bincount(train_labels_of_client, minlength=num_classes).astype(float)
    total = max(1, int(round(fraction * counts.sum())))
    want = counts / counts.sum() * total
    n = np.floor(want).astype(int)
    for c in np.argsort(-(want - n))[: total - n.sum()]:  # largest remainders
        n[c] += 1
    rng = np.random.default_rng([seed, 4, client_index])
    picked: list[np.ndarray] = []
    for c in range(num_classes):
        if n[c] == 0:
            continue
        pool = np.flatnonzero(test_labels == c)
        picked.append(rng.choice(pool, size=min(n[c], len(pool)), replace=False))
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Shard:
    """One client's indices into the global train and test sets."""

    index: int
    train: np.ndarray
    test: np.ndarray


_CACHE: dict[tuple[Any, ...], list[np.ndarray]] = {}


def partition(
    train_labels: np.ndarray,
    num_clients: int,
    kind: str,
    alpha: float,
    delta: float,
    seed: int,
    size: int | None = None,
) -> list[np.ndarray]:
    """Every client's train indices; the last few splits are kept (a worker builds one per hosted client).
    ``size``: samples per client of ``dirichlet-equal`` (None: the whole split shared out)."""
    labels = np.ascontiguousarray(train_labels)
    key = (hashlib.sha1(labels.tobytes()).hexdigest(), labels.dtype.str, num_clients, kind, alpha, delta, seed, size)
    if key not in _CACHE:
        shards = _partition(labels, num_clients, kind, alpha, delta, seed, size)
        for s in shards:
            s.flags.writeable = False  # shared by every caller
        if len(_CACHE) >= 4:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = shards
    return list(_CACHE[key])


def _partition(
    train_labels: np.ndarray, num_clients: int, kind: str, alpha: float, delta: float, seed: int, size: int | None
) -> list[np.ndarray]:
    if kind == Partition.DIRICHLET:
        return dirichlet_partition(train_labels, num_clients, alpha, seed)
    if kind == Partition.DIRICHLET_EQUAL:
        return dirichlet_equal_partition(train_labels, num_clients, delta, seed, size)
    if kind == Partition.IID:
        return iid_partition(len(train_labels), num_clients, seed)
    raise ValueError(f"partition={str(kind)!r} is not one of {PARTITIONS}")


def federation_shards(
    train_labels: np.ndarray,
    num_clients: int,
    kind: str,
    alpha: float,
    delta: float,
    seed: int,
    size: int | None = None,
    public_size: int = 0,
) -> list[np.ndarray]:
    """Every client's training indices into the whole train split, rebuilt from the seed alone: the
    partition of what a public split of ``public_size`` samples (0: none) leaves.

    The clients build their shards from it, the server their aggregation weights, the analysis
    their union: one rule for all three."""
    labels = np.asarray(train_labels)
    if not public_size:
        return partition(labels, num_clients, kind, alpha, delta, seed, size)
    pool = public_split(labels, public_size, seed)[1]
    return [pool[s] for s in partition(labels[pool], num_clients, kind, alpha, delta, seed, size)]


def run_shards(cfg: PartitionSettings, train_labels: np.ndarray, public_size: int = 0) -> list[np.ndarray]:
    """:func:`federation_shards` with a run's own partition settings (``data``: ``partition``, ``alpha``,
    ``delta``, ``client_size``; ``federation``: ``num_clients``, ``seed``): what the server weighs and the
    analysis measures."""
    data, fed = cfg.data, cfg.federation
    return federation_shards(
        train_labels, fed.num_clients, data.partition, data.alpha, data.delta, fed.seed, data.client_size, public_size
    )


def client_shard(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    kind: str,
    alpha: float,
    delta: float,
    seed: int,
    index: int,
    test_fraction: float,
    size: int | None = None,
    public_size: int = 0,
) -> Shard:
    """Client ``index``'s shard (:func:`federation_shards`) and its local test set, from the seed alone."""
    if not 0 <= index < num_clients:
        raise ValueError(f"client index {index} is outside 0..{num_clients - 1}")
    train = federation_shards(train_labels, num_clients, kind, alpha, delta, seed, size, public_size)[index]
    test = local_test_indices(test_labels, np.asarray(train_labels)[train], test_fraction, seed, index)
    return Shard(index, train, test)


def public_split(labels: np.ndarray, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(public indices, the rest)`` of a train split: ``size`` samples stratified by class
    (each class in proportion, largest remainders first), drawn from the seed alone, sorted.

    Algorithms that use a public data set (FedMD) take it from here, and the clients' partition
    is then built over the rest, so the public split is disjoint from every client's data.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if not 0 < size < n:
        raise ValueError(f"public split size {size} must lie in 1..{n - 1}")
    rng = np.random.default_rng([seed, 14])
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * size / n
    take = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - take), kind="stable")[: size - int(take.sum())]:
        take[i] += 1
    chosen = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take)]
    public = np.sort(np.concatenate(chosen))
    return public, np.setdiff1d(np.arange(n), public)
