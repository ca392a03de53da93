"""A trainer used out of order, or a phase that has nothing to train with, says what is wrong."""

from __future__ import annotations

import pytest
import torch
from algorithm_checks import client, global_payload
from wafl.common.algorithms.base import Phase
from wafl.common.datasets import load_dataset
from wafl.common.errors import InvariantError
from wafl.common.training import train_phase


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_training_before_any_round_is_refused(digits) -> None:
    t = client(digits, "fedavg")
    with pytest.raises(InvariantError, match=r"no round has begun on this trainer \(begin_round was not called\)"):
        t.train_gm()


def test_a_personal_phase_of_an_algorithm_without_one_is_refused(digits) -> None:
    t = client(digits, "fedavg")
    t.begin_round(1, global_payload(t))
    with pytest.raises(InvariantError, match="algorithm 'fedavg' has no personal model and phase to train"):
        t.train_pm(None, 1.0)


def test_a_phase_without_cross_entropy_or_terms_is_refused(digits) -> None:
    t = client(digits, "fedavg")
    ctx = t.begin_round(1, global_payload(t))
    phase = Phase("empty", cross_entropy=False)
    data = iter(
        [(torch.zeros(2, digits.in_channels, digits.image_size, digits.image_size), torch.zeros(2, dtype=torch.long))]
    )
    with pytest.raises(ValueError, match="a phase without cross-entropy needs a loss term"):
        train_phase(t.gm, phase, ctx, data, torch.optim.SGD(t.gm.parameters(), lr=0.1))
