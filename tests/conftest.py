"""Shared test set-up.

Without CUDA, Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1), set here before
anything imports triton. With CUDA, the same kernels run on the GPU and interpreter-only tests
skip themselves.
"""

import os
import shlex

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

POISON = 0xA5


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "fuzz: long mutation fuzz (GPU)")


def _seed(request) -> int:
    """``PAGECOMP_SEED`` when set (to replay a failure), else a fresh one; printed with the
    exact command that replays this test with it."""
    env = os.environ.get("PAGECOMP_SEED")
    s = int(env) if env else int.from_bytes(os.urandom(4), "little")
    print(f"seed={s} (replay: PAGECOMP_SEED={s} pytest {shlex.quote(request.node.nodeid)})")
    return s


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a fresh seed every run (or ``PAGECOMP_SEED``), printed for replay."""
    return torch.Generator().manual_seed(_seed(request))


@pytest.fixture
def seed(request) -> int:
    """Seeds torch's global generator afresh every run (or from ``PAGECOMP_SEED``, printed);
    for tests of whole models."""
    s = _seed(request)
    torch.manual_seed(s)
    return s


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")
