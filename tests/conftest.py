"""Shared test set-up.

Without CUDA, Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1), set here before
anything imports triton. With CUDA, the same kernels run on the GPU and interpreter-only tests
skip themselves.
"""

import os
import shlex
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

POISON = 0xA5


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` (``_patch_lang``) at each kernel launch,
    restoring it afterwards, and again at every call of a ``@triton.jit`` helper inside the
    launch (a few ms each; a quarter of the time of the compressor's interpreter tests), with
    the same patches on the same modules, never restored. Inside a launch, a helper whose
    language modules that launch already patched skips the repeat; anything else (another
    thread's launch, other modules, another Triton without these names) goes to Triton as is."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    real = getattr(ti, "_patch_lang", None)
    if real is None or not all(hasattr(ti, n) for n in ("tl", "_LangPatchScope")):
        return
    if getattr(real, "_pagecomp_once", False):
        return
    active: dict[int, frozenset] = {}  # per thread: the modules its running launch patched

    def patch_lang(fn):
        tl, me = ti.tl, threading.get_ident()
        mods = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if me in active and mods <= active[me]:
            return ti._LangPatchScope()  # nothing to undo: the launch's own scope restores
        scope = real(fn)
        if me in active:  # a helper that sees other modules: patched for the rest of the launch
            active[me] = active[me] | mods
            return scope
        active[me] = mods
        restore = scope.restore

        def end_of_launch() -> None:
            active.pop(me, None)
            restore()

        scope.restore = end_of_launch
        return scope

    patch_lang._pagecomp_once = True
    ti._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "fuzz: long mutation fuzz (GPU)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test` runs one xdist worker per core: a torch pool per worker would put several
        # threads on each core (tests that measure threads set the CPU codec's own count).
        torch.set_num_threads(1)


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
