"""Shared test set-up.

Without CUDA, Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1), set here (in
``pytest_configure``) before anything imports triton. With CUDA, the same kernels run on the GPU
and interpreter-only tests skip themselves. The process that hands tests out to xdist workers
runs none and imports no torch (the workers start 3 s sooner).
"""

from __future__ import annotations

import os
import shlex
import threading
import warnings
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

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


def _drop_dead_overflow_checks() -> None:
    """The interpreter builds Triton's int32 overflow check (``sanitize_overflow``) around every
    integer add, sub and mul: the operands again in int64, the operation, two compares and an
    ``and`` (two fifths of the time of the compressor's interpreter tests), all for a
    ``device_assert`` that asserts nothing unless ``options.debug``, which the interpreter never
    sets (as the GPU backends compile it: no check without debug). Off where it is dead; where a
    Triton has debug on, or no such options, it stays as it is.
    ``test_bounds.py::test_interpreter_overflow_check_is_dead`` fails if it ever comes alive."""
    import dataclasses

    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    builder = getattr(ti, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(opts) or getattr(opts, "debug", True):
        return
    if getattr(opts, "sanitize_overflow", False):
        builder.options = dataclasses.replace(opts, sanitize_overflow=False)


def _cache_numpy_dtypes() -> None:
    """The interpreter's ``_get_np_dtype`` (the numpy dtype of a Triton type, at every load,
    store, cast and constant) builds a table of eighteen numpy dtypes at each call (a tenth of
    the time of the kernels' interpreter tests). Its answer depends only on the type's scalar
    type (pointers: uint64), so each scalar type's answer is kept from its first call."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    real = getattr(ti, "_get_np_dtype", None)
    if real is None or getattr(real, "_pagecomp_cached", False):
        return
    known: dict = {}
    u64 = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        scalar = getattr(tt_dtype, "scalar", None)
        if scalar is None:
            return real(tt_dtype)
        if isinstance(scalar, tl.pointer_type):
            return u64
        got = known.get(scalar)
        if got is None:
            got = known[scalar] = real(scalar)
        return got

    get_np_dtype._pagecomp_cached = True
    ti._get_np_dtype = get_np_dtype


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "fuzz: long mutation fuzz (GPU)")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the xdist controller: it runs no test
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_language_once_per_launch()
        _drop_dead_overflow_checks()
        _cache_numpy_dtypes()
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
def hold_issuer():
    """``hold(pc) -> gate``: ``PageCompressor`` ``pc``'s issuer stores nothing (its CPU
    compress waits) until the returned ``threading.Event`` is set; every gate is set at the
    test's end."""
    gates = []

    def hold(pc) -> threading.Event:
        gate, issue = threading.Event(), pc.pipeline._cpu_compress
        gates.append(gate)

        def held(job):
            gate.wait(30)
            issue(job)

        pc.pipeline._cpu_compress = held
        return gate

    yield hold
    for gate in gates:
        gate.set()


@pytest.fixture
def quiet():
    """Warnings off (the offload hooks' "nothing offloaded" warning of tiny passes); a module
    takes it with ``pytestmark = pytest.mark.usefixtures("quiet")``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(autouse=True)
def _stores_whatever_the_gpu_peak(request, monkeypatch):
    """The offload hooks' peak rule off, but for tests marked ``peak_rule``: a due store
    stays held while the GPU's allocation is below the peak the caching allocator has seen
    (``offload._batch.Batcher._over_peak``), so whether a test's storages were stored and
    restored would depend on what ran before it in its process. The tests of stores,
    restores, streams and corruption must store what they test."""
    if request.node.get_closest_marker("peak_rule") is None:
        from torch_pagecomp.offload._batch import Batcher

        monkeypatch.setattr(Batcher, "_over_peak", lambda self, dev: None)


@pytest.fixture
def through_the_workers(monkeypatch):
    """Every ``PageCompressor`` offload through the pipeline's worker threads: a compressor
    without a GPU otherwise stores small tensors on the calling thread
    (``module.INLINE_HOST_BYTES``, tested in test_module.py). For the tests of the workers."""
    from torch_pagecomp import module

    monkeypatch.setattr(module, "INLINE_HOST_BYTES", 0)


@pytest.fixture
def direct(monkeypatch):
    """A CPU compressor whose tensors of one batch or less take the kernel-only path
    (``torch_pagecomp._direct``; test_direct.py, test_small_tensor.py)."""
    from torch_pagecomp.kernels.launch import interpreting
    from torch_pagecomp.module import PageCompressor

    if not interpreting():
        pytest.skip("the store's pack kernel needs the Triton interpreter on the CPU")

    def takes_direct(self, flat, nbytes):
        return 0 < nbytes <= self.batch_pages * self.page_size

    monkeypatch.setattr(PageCompressor, "_takes_direct", takes_direct)
    made = []

    def make(**kwargs):
        pc = PageCompressor(device="cpu", batch_pages=4, **kwargs)
        made.append(pc)
        return pc

    yield make
    for pc in made:
        pc.close()


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator with a fresh seed every run (or ``PAGECOMP_SEED``), printed for replay."""
    import torch

    return torch.Generator().manual_seed(_seed(request))


@pytest.fixture
def seed(request) -> int:
    """Seeds torch's global generator afresh every run (or from ``PAGECOMP_SEED``, printed);
    for tests of whole models."""
    import torch

    s = _seed(request)
    torch.manual_seed(s)
    return s


@pytest.fixture
def cuda() -> torch.device:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")
