"""Shared test set-up.

Without CUDA, Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1), set here before
anything imports triton. With CUDA, the same kernels run on the GPU and interpreter-only tests
skip themselves.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

POISON = 0xA5


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "fuzz: long mutation fuzz (GPU)")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a fresh seed every run; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[{request.node.name}] seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def seed() -> int:
    """Seeds torch's global generator afresh every run (printed); for tests of whole models."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"seed={s}")
    torch.manual_seed(s)
    return s


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")
