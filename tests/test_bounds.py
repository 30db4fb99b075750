"""Every load, store and atomic of the Triton kernels stays inside the tensors of the call.

Runs under the CPU interpreter only: its memory operations are wrapped to check that every
address a mask lets through lies inside one of the tensors handed to or allocated by the
launcher (``torch.empty`` and ``torch.zeros`` are recorded while the test runs). A read past
the last page of a batch faults on the GPU only when that page ends an allocation, so the GPU
tests can miss it; this check cannot. (It found the compressor reading past the page after a
window skip.)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from pages import file_pages, run_pages  # noqa: E402

from torch_pagecomp.kernels import lz4_compress as lc  # noqa: E402
from torch_pagecomp.kernels import lz4_decompress as D  # noqa: E402
from torch_pagecomp.kernels.pack import pack_pages  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter tests")
P = 4096


@pytest.fixture
def bounds(monkeypatch):
    """Record tensors (``bounds(t)``, any ``torch.empty`` or ``torch.zeros``); fail on an access
    outside them."""
    import triton.runtime.interpreter as interp

    ranges: list[tuple[int, int]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t

    empty, zeros = torch.empty, torch.zeros
    monkeypatch.setattr(torch, "empty", lambda *a, **k: keep(empty(*a, **k)))
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: keep(zeros(*a, **k)))

    def check(ptrs, mask, itemsize: int, what: str) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64)
        on = np.broadcast_to(np.asarray(mask.data).astype(bool), addr.shape)
        a = addr[on]
        if a.size == 0:
            return
        first, last = int(a.min()), int(a.max()) + itemsize
        if any(lo <= first and last <= hi for lo, hi in ranges):
            return  # the common case: one tensor holds every address of the access
        a = np.unique(a)
        inside = np.zeros(a.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (a >= np.uint64(lo)) & (a + np.uint64(itemsize) <= np.uint64(hi))
        if not inside.all():
            at = int(a[~inside][0])
            raise AssertionError(f"{what} outside every tensor of the call at {at:#x}")

    b = interp.InterpreterBuilder
    load, store, rmw = b.create_masked_load, b.create_masked_store, b.create_atomic_rmw

    def checked_load(self, ptrs, mask, other, *rest):
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        check(ptrs, mask, size, "load")
        return load(self, ptrs, mask, other, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, value.data.dtype.itemsize, "store")
        return store(self, ptrs, value, mask, *rest)

    def checked_rmw(self, op, ptr, val, mask, *rest):
        check(ptr, mask, val.data.dtype.itemsize, "atomic")
        return rmw(self, op, ptr, val, mask, *rest)

    monkeypatch.setattr(b, "create_masked_load", checked_load)
    monkeypatch.setattr(b, "create_masked_store", checked_store)
    monkeypatch.setattr(b, "create_atomic_rmw", checked_rmw)
    return keep


@triton.jit
def _copy_first(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


@pytest.mark.parametrize("past", ["load", "store"])
def test_the_check_catches_an_access_past_a_tensor(bounds, past):
    """The check itself: one byte past a tensor of the call fails, though the memory there is
    valid (the rest of an unrecorded buffer), as it is on the GPU when a batch is not the end
    of its allocation."""
    base = torch.arange(64, dtype=torch.uint8)  # not recorded: only its slices are
    src, dst = bounds(base[:16]), bounds(base[32:48])
    _copy_first[(1,)](src, dst, 16, BLOCK=16)  # in bounds: passes
    assert torch.equal(dst, src)
    from triton.runtime.errors import InterpreterError  # what the interpreter raises it as

    with pytest.raises(InterpreterError, match=f"{past} outside every tensor"):
        if past == "load":
            _copy_first[(1,)](src, bounds(torch.empty(32, dtype=torch.uint8)), 17, BLOCK=32)
        else:
            _copy_first[(1,)](bounds(torch.empty(32, dtype=torch.uint8)), dst, 17, BLOCK=32)


@triton.jit
def _add_to_first(src, dst, k, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i) + k)


def test_interpreter_overflow_check_is_dead(monkeypatch):
    """conftest.py turns the interpreter's int32 overflow check (``sanitize_overflow``) off as
    dead work: under Triton's own interpreter options (the check on, ``debug`` off) an int32 add
    that wraps goes unreported, as on the GPU without debug; with ``debug`` on the same launch
    reports it. If the first ever reports it, the check is live and conftest must leave it on."""
    import dataclasses

    import triton.runtime.interpreter as interp

    own = interp.InterpreterOptions()
    assert own.sanitize_overflow and not own.debug
    x = torch.tensor([2**31 - 1, 5], dtype=torch.int32)
    y = torch.empty(2, dtype=torch.int32)
    monkeypatch.setattr(interp.interpreter_builder, "options", own)
    _add_to_first[(1,)](x, y, 1, BLOCK=2)
    assert y.tolist() == [-2**31, 6]
    monkeypatch.setattr(interp.interpreter_builder, "options",
                        dataclasses.replace(own, debug=True))
    with pytest.raises(Exception, match="int32 overflow detected"):
        _add_to_first[(1,)](x, y, 1, BLOCK=2)


def _relu_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 ReLU activations viewed as bytes: zero runs of every length, long matches."""
    x = torch.randn(n * P // 2, generator=gen).relu().to(torch.bfloat16)
    return x.view(torch.uint8).view(n, P).contiguous()


def _late_window_page(gen: torch.Generator) -> torch.Tensor:
    """Random bytes around a long zero run that ends ~46 bytes before the page end: the match
    over the run ends there, and the compressor's next window starts past ``P - 64``."""
    page = torch.randint(1, 256, (1, P), generator=gen, dtype=torch.uint8)
    page[0, 1000:P - 46] = 0
    return page


@pytest.mark.parametrize("e, wide", [  # wide: the bit-shuffle from 64-bit loads (8-aligned)
    (1, True), pytest.param(2, True, marks=pytest.mark.slow),
    pytest.param(2, False, marks=pytest.mark.slow), (4, False),
    pytest.param(4, True, marks=pytest.mark.slow)])  # 2 and 4: one kernel, other constants
def test_compress_pack_and_decode_stay_in_bounds(bounds, gen, e, wide):
    # one ReLU page: a second one ran no line of the compressor, pack or decoder that one
    # does not (the lines run compared over seeds), for a third of the test's time
    pages = torch.cat([file_pages("text", 1, P, gen), run_pages(1, P, gen),
                       _relu_bytes(1, gen), _late_window_page(gen)])  # the last page
    n = pages.shape[0]
    if not wide:  # a view 4 bytes into its storage: not 8-byte aligned, so byte loads
        pages = bounds(torch.zeros(n * P + 4, dtype=torch.uint8))[4:].view(n, P).copy_(pages)
    else:
        pages = bounds(pages)
    payload, sizes, kinds = lc.compress_pages(pages, e)
    packed, _ = pack_pages(payload, sizes)
    assert packed.numel() == payload.numel()
    offsets = bounds(torch.arange(n, dtype=torch.int64) * P)
    status = bounds(torch.full((n,), -1, dtype=torch.int32))
    # output rows 4-byte aligned (word-tile unshuffle) or not; plain pages (e == 1) take only
    # the plain kernel, which has no path that depends on the rows' alignment: misaligned rows
    # would just move its accesses by a byte (and the aligned rows leave no slack byte before
    # the first row for an access to hide in)
    for misalign in (0, 1) if e > 1 else (0,):
        buf = bounds(torch.full((n * P + misalign,), 0xA5, dtype=torch.uint8))
        out = buf[misalign:].view(n, P)
        D.decompress_into(payload.view(-1), offsets, sizes, kinds, out, status)
        assert not status.any()
        if e == 1:
            assert torch.equal(out, pages)


def test_exp_codec_stays_in_bounds(bounds, gen, monkeypatch):
    """The exponent codec (``kernels/exp_codec.py``): the encoder on pages of every exponent
    shape in aligned and odd rows, the decoder on valid and hostile pages (offsets and sizes
    outside the payload, escapes disagreeing with the size) into aligned and odd rows."""
    from test_exp_codec import float_pages, hostile_batch

    from torch_pagecomp.kernels import exp_codec as X

    empty_like = torch.empty_like  # the launcher's outputs count as the call's tensors too
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: bounds(empty_like(*a, **k)))

    for dtype in (torch.bfloat16, torch.float16):
        pages = float_pages(gen, P, dtype)
        n = pages.shape[0]
        for shift in (0, 1):
            src = bounds(torch.zeros(n * P + shift, dtype=torch.uint8))[shift:].view(n, P)
            src.copy_(pages)
            X.compress_exp_pages(src, dtype == torch.float16)
    payload, offsets, sizes, kinds = (bounds(t.clone()) for t in hostile_batch(gen))
    n = sizes.shape[0]
    status = bounds(torch.full((n,), -1, dtype=torch.int32))
    for misalign in (0, 1):
        buf = bounds(torch.full((n * P + misalign,), 0xA5, dtype=torch.uint8))
        X.decompress_exp_into(payload, offsets, sizes, kinds, buf[misalign:].view(n, P), status)
        assert (status == 0).any() and (status != 0).any()
