"""The experiment configs of configs/paper: each validates, states its sources, describes the
setting the seeds report, and runs one round on tiny files in its dataset's real on-disk format.

The round goes through the same path as ``wafl run --config FILE --data-dir DIR``: ``load_config``
reads the TOML, the dataset's file loader reads ``DATA_DIR`` (CIFAR pickle batches, SVHN ``.mat``),
and :func:`wafl.cli.sim.simulate.simulate` trains the real Trainer and aggregates with the server's
code. Only the size of the run is overridden (see ``TINY``); the dataset, algorithm, its
parameters, the partition and its concentration, the optimizer and the batch size stay the file's,
and so does the model except for SCD (see ``TINY_MODEL``).

Files that differ only in overridden fields (FedHKD at 10, 20 and 50 clients; ASD at 100 and 500
clients) give the identical tiny run: it runs once, and the test of each of those files checks it.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from test_datasets import _cifar_rows, _dump  # the CIFAR batch row layout and pickle writer
from wafl.cli.sim.simulate import simulate
from wafl.common.algorithms import registry
from wafl.common.config import load_config
from wafl.common.datasets import load_dataset
from wafl.common.models import build_model

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "paper"

# file -> (dataset, model, algorithm, num_clients, partition, concentration, fraction): the settings
# the seeds report (SCD: 000, FedHKD: 001, ASD: 002), checked against each file.
EXPECTED = {
    "scd-cifar10-alpha0.1-100clients.toml": ("cifar10", "resnet18", "scd", 100, "dirichlet", 0.1, 1.0),
    "scd-cifar100-alpha0.1-50clients.toml": ("cifar100", "resnet34", "scd", 50, "dirichlet", 0.1, 1.0),
    **{
        f"fedhkd-{ds}-beta0.5-{n}clients.toml": (ds, model, "fedhkd", n, "dirichlet-equal", 0.5, 1.0)
        for ds, model in (("svhn", "shufflenetv2"), ("cifar10", "resnet18"), ("cifar100", "resnet18"))
        for n in (10, 20, 50)
    },
    "asd-cifar100-delta0.3-100clients.toml": ("cifar100", "resnet18", "fedavg+asd", 100, "dirichlet-equal", 0.3, 0.1),
    "asd-cifar100-delta0.3-500clients-1pct.toml": (
        "cifar100",
        "resnet18",
        "fedavg+asd",
        500,
        "dirichlet-equal",
        0.3,
        0.01,
    ),
}
FILES = sorted(p.name for p in CONFIG_DIR.glob("*.toml"))

# Overridden for the one-round run, and why:
TINY_CLIENTS = 4
TINY = {
    "rounds": 1,  # one round is enough to run every phase once
    "num_clients": TINY_CLIENTS,  # the tiny data set is split among 4 clients instead of 10..500
    "fraction": 0.5,  # 2 of the 4 train: aggregation over more than one upload, half the CPU time
    "local_epochs": 1,  # the files' 5 epochs of ResNet on the CPU would only repeat the same code
}
# pm_epochs is capped at 1 where a file sets more (SCD's 5): one PM epoch exercises the PM phase.
# SCD's spectral terms take a DFT of the whole weight vector (and its gradient) at every step: for
# ResNet-18/34 (11M/21M weights, lengths with large prime factors) that is tens of seconds per step
# on two CPU cores, so SCD's tiny round trains ShuffleNetV2 (1.3M weights) at the same input shape,
# for that reason only. The file's own model is still built at its dataset's shape and run forward.
TINY_MODEL = {"scd": "shufflenetv2"}


def test_every_expected_config_exists_and_nothing_else() -> None:
    assert FILES == sorted(EXPECTED)


@pytest.mark.parametrize("name", FILES)
def test_config_validates_and_is_the_seed_setting(name: str) -> None:
    cfg = load_config(CONFIG_DIR / name)
    dataset, model, algorithm, clients, partition, concentration, fraction = EXPECTED[name]
    assert (
        cfg.data.dataset,
        cfg.training.model,
        cfg.training.algorithm,
        cfg.federation.num_clients,
        cfg.data.partition,
        cfg.federation.fraction,
    ) == (
        dataset,
        model,
        algorithm,
        clients,
        partition,
        fraction,
    )
    assert (cfg.data.alpha if partition == "dirichlet" else cfg.data.delta) == concentration
    assert cfg.training.device == "auto"
    assert cfg.data.data_dir is None  # given on the command line (--data-dir)
    # the parameters are the algorithm's own (validate() fills in any default the file left out)
    raw = tomllib.loads((CONFIG_DIR / name).read_text())
    assert set(raw["params"]) == set(registry.resolve(cfg.training.algorithm).params)
    if algorithm == "scd":
        assert cfg.client.protocol == "wait-free"


@pytest.mark.parametrize("name", FILES)
def test_every_value_cites_its_source(name: str) -> None:
    """Each ``key = value`` line carries a comment saying where the value comes from."""
    lines = (CONFIG_DIR / name).read_text().splitlines()
    assignments = [ln for ln in lines if re.match(r"^[A-Za-z_]+\s*=", ln)]
    assert len(assignments) >= 20
    for ln in assignments:
        value, _, comment = ln.partition("#")
        assert comment.strip(), f"{name}: no source comment on {value.strip()!r}"
        assert re.search(r"paper|not stated|ALGORITHMS\.md", comment), f"{name}: comment names no source: {ln!r}"


# ---------------------------------------------------------------------------------------------
# Tiny files in each dataset's real format, with every class present.

N_TRAIN = 80  # 20 per client: the per-class Dirichlet split wants >= 10 per client
N_TEST = 20


def _labels(n: int, num_classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % num_classes)


def write_tiny_cifar10(data_dir: Path) -> int:
    folder = data_dir / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    labels = _labels(N_TRAIN, 10, 1)
    per = N_TRAIN // 5
    for b in range(5):
        part = labels[b * per : (b + 1) * per].tolist()
        _dump(
            folder / f"data_batch_{b + 1}",
            {b"batch_label": f"training batch {b + 1} of 5".encode(), b"labels": part, b"data": _cifar_rows(rng, per)},
        )
    _dump(
        folder / "test_batch",
        {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": _labels(N_TEST, 10, 2).tolist(),
            b"data": _cifar_rows(rng, N_TEST),
        },
    )
    return N_TRAIN


def write_tiny_cifar100(data_dir: Path, n_train: int) -> int:
    folder = data_dir / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(3)
    for split, n, seed in (("train", n_train, 4), ("test", 100, 5)):
        fine = _labels(n, 100, seed).tolist()
        _dump(
            folder / split,
            {
                b"batch_label": f"{split}ing batch 1 of 1".encode(),
                b"fine_labels": fine,
                b"coarse_labels": [f // 5 for f in fine],
                b"data": _cifar_rows(rng, n),
            },
        )
    return n_train


def write_tiny_svhn(data_dir: Path) -> int:
    from scipy.io import savemat

    folder = data_dir / "svhn"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(6)
    for fname, n, seed in (("train_32x32.mat", N_TRAIN, 7), ("test_32x32.mat", N_TEST, 8)):
        digits = _labels(n, 10, seed)
        y = np.where(digits == 0, 10, digits).astype(np.uint8).reshape(n, 1)  # the files write 0 as 10
        savemat(folder / fname, {"X": rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8), "y": y})
    return N_TRAIN


def tiny_train_size(dataset: str, partition: str) -> int:
    # The per-class Dirichlet split cuts each class at floor(cumsum(p) * n_c): with one CIFAR-100
    # image per class every image would go to the last client, so that split gets two per class.
    return 200 if (dataset, partition) == ("cifar100", "dirichlet") else N_TRAIN


def write_tiny(dataset: str, partition: str, data_dir: Path) -> int:
    """Writes the files of ``dataset`` under ``data_dir``; returns the number of training images."""
    if dataset == "cifar10":
        return write_tiny_cifar10(data_dir)
    if dataset == "svhn":
        return write_tiny_svhn(data_dir)
    if dataset == "cifar100":
        return write_tiny_cifar100(data_dir, tiny_train_size(dataset, partition))
    raise AssertionError(f"no tiny writer for {dataset}")


SETTING = {
    "dataset",
    "algorithm",
    "params",
    "partition",
    "alpha",
    "delta",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "batch_size",
    "protocol",
}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "svhn": 10}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``get(dataset, partition) -> (data_dir, number of training images)``, each written once."""
    made: dict[tuple[str, int], tuple[Path, int]] = {}

    def get(dataset: str, partition: str) -> tuple[Path, int]:
        key = (dataset, tiny_train_size(dataset, partition))
        if key not in made:
            d = tmp_path_factory.mktemp(f"{dataset}-{key[1]}")
            made[key] = (d, write_tiny(dataset, partition, d))
        return made[key]

    return get


_ROUNDS: dict[str, list[dict]] = {}  # tiny configuration (JSON) -> simulate()'s rows


@pytest.mark.parametrize("name", FILES)
def test_config_runs_one_round_on_tiny_files(name: str, tiny_data) -> None:  # type: ignore[no-untyped-def]
    path = CONFIG_DIR / name
    full = load_config(path)
    data_dir, n_train = tiny_data(full.data.dataset, full.data.partition)
    overrides = {**TINY, "data_dir": str(data_dir), "pm_epochs": min(full.client.pm_epochs, 1)}
    if full.training.algorithm in TINY_MODEL:
        overrides["model"] = TINY_MODEL[full.training.algorithm]
    cfg = load_config(path, overrides)

    # What defines the setting is the file's, untouched.
    assert not SETTING & overrides.keys()
    kept = {k: v for k, v in full.to_dict().items() if k not in overrides}
    assert kept == {k: cfg.to_dict()[k] for k in kept}
    assert cfg.federation.act_prob is None  # no file uses act_prob: the tiny round selects by fraction
    assert cfg.federation.fraction == 0.5 and cfg.federation.num_clients == TINY_CLIENTS and cfg.federation.rounds == 1

    # The file loader reads the tiny files: the config's dataset, at its real shape.
    data = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    assert (len(data.train_labels), data.num_classes, data.in_channels, data.image_size) == (
        n_train,
        NUM_CLASSES[cfg.data.dataset],
        3,
        32,
    )

    # The file's own model at that shape: a forward pass on two of those images.
    model = build_model(
        full.training.model, data.num_classes, data.in_channels, data.image_size, full.training.code_len
    ).eval()
    x = torch.stack([data.test[i][0] for i in range(2)])
    with torch.no_grad():
        assert model(x).shape == (2, data.num_classes)

    key = cfg.to_json()
    if key not in _ROUNDS:
        _ROUNDS[key] = simulate(cfg)
    rows = _ROUNDS[key]
    assert len(rows) == 1
    row = rows[0]
    assert row["round"] == 1 and row["clients"] == 2
    assert 0.0 <= row["gm_accuracy"] <= 1.0 and math.isfinite(row["gm_loss"])
    algo = registry.resolve(cfg.training.algorithm, cfg.training.params)
    if algo.personalized or algo.local_model_is_personal:  # SCD's PM; FedHKD's local model
        assert row["pm_accuracy"] is not None and 0.0 <= row["pm_accuracy"] <= 1.0
    else:
        assert row["pm_accuracy"] is None
