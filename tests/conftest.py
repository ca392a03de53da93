import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def stubs(tmp_path_factory: pytest.TempPathFactory):
    """The protobuf and gRPC modules generated from the .proto (``independent_client.generate_stubs``)."""
    from independent_client import generate_stubs

    return generate_stubs(tmp_path_factory.mktemp("independent-stubs"))
