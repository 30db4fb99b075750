"""Review 91 of the CPU codec path and the format module: defects found and fixed.

- ``format.CorruptPageError`` did not survive pickle or copy (its ``__init__`` takes the pages
  and reasons, the default reduction passes the message alone): a worker process that raised
  it broke its whole ``ProcessPoolExecutor`` instead of naming the corrupt pages.
- A numpy integer ``element_size`` of a narrow type (``np.uint8(2)``) passed the argument
  check and then overflowed in the CPU path's arithmetic (``4096 % (64 * element_size)``).
- ``shuffle.bitshuffle`` / ``bitunshuffle`` of a tensor that is not ``uint8`` took each
  element for a byte: an ``int32`` page came back silently cut to its low bytes.
- The CPU codec's Python worker pool (the path without the C loops' own threads) could be
  replaced by another thread (a larger batch growing it, or ``shutdown_pool``) between a batch
  getting it and submitting to it: that batch failed with "cannot schedule new futures after
  shutdown".

Every test draws fresh pages (the ``gen`` fixture).
"""

from __future__ import annotations

import copy
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from pages import mixed_pages

import torch_pagecomp as pc
from torch_pagecomp import cpu_codec, shuffle
from torch_pagecomp import format as fmt


@pytest.fixture(params=["native", "python-lz4"])
def cpu_loops(request, monkeypatch):
    """The C loops (where built) and python-lz4 page by page, in turn."""
    if request.param == "native" and cpu_codec._native is None:
        pytest.skip("torch_pagecomp._native is not built here")
    if request.param == "python-lz4":
        monkeypatch.setattr(cpu_codec, "_native", None)
    return request.param


def _corrupt_error(gen: torch.Generator) -> fmt.CorruptPageError:
    """The error ``decompress`` raises for a packed container with two pages broken (one by
    its size, one by its kind)."""
    pages = mixed_pages(8, 4096, gen)
    c = pc.pack(pc.compress(pages, backend="cpu"))
    sizes, kinds = c.sizes.clone(), c.kinds.clone()
    sizes[2] = 0
    kinds[5] = 0x0F
    bad = fmt.CompressedPages(c.payload, sizes, kinds, c.page_size, c.offsets)
    with pytest.raises(fmt.CorruptPageError) as info:
        pc.decompress(bad, backend="cpu")
    return info.value


def test_a_corrupt_page_error_survives_pickle_and_copy(gen):
    """What a worker process sends back (pickle) and ``copy.copy`` give the same error: its
    pages, reasons, message and any note added to it."""
    err = _corrupt_error(gen)
    assert err.pages == [2, 5]
    err.add_note("while restoring batch 3")
    for again in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
        assert type(again) is fmt.CorruptPageError
        assert again.pages == err.pages and again.reasons == err.reasons
        assert str(again) == str(err) and again.__notes__ == err.__notes__
    # one built with its own message (the offloaders' way) too
    own = fmt.CorruptPageError([], [], "3 offloaded page(s) failed to decode")
    again = pickle.loads(pickle.dumps(own))
    assert str(again) == str(own) and again.pages == [] and again.reasons == []


@pytest.mark.parametrize("np_type", [np.uint8, np.int8, np.uint16])
@pytest.mark.parametrize("element_size", [2, 4])
def test_numpy_integer_element_sizes_compress_as_their_int(np_type, element_size, gen,
                                                           cpu_loops):
    """``element_size=np.uint8(4)`` passes the check (an integer 1, 2 or 4) and compresses
    as ``4`` does, bit for bit, on both CPU loops (it overflowed there: ``OverflowError``)."""
    pages = mixed_pages(14, 8192, gen)
    got = pc.compress(pages, element_size=np_type(element_size), backend="cpu")
    want = pc.compress(pages, element_size=element_size, backend="cpu")
    for a, b in ((got.payload, want.payload), (got.sizes, want.sizes),
                 (got.kinds, want.kinds)):
        assert torch.equal(a, b)
    assert torch.equal(pc.decompress(got, backend="cpu"), pages)
    shuffled = shuffle.bitshuffle(pages, np_type(element_size))
    assert torch.equal(shuffled, shuffle.bitshuffle(pages, element_size))
    assert torch.equal(shuffle.bitunshuffle(shuffled, np_type(element_size)), pages)


@pytest.mark.parametrize("element_size", [2, 4])
def test_numpy_integer_element_sizes_through_the_kernels(element_size, gen):
    """The same through the Triton kernels (the interpreter on the CPU; the GPU where there
    is one): ``compress`` overflowed computing the kernels' sizes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pages = mixed_pages(3, 4096, gen).to(device)
    got = pc.compress(pages, element_size=np.uint8(element_size), backend="triton")
    want = pc.compress(pages, element_size=element_size, backend="triton")
    for a, b in ((got.payload, want.payload), (got.sizes, want.sizes),
                 (got.kinds, want.kinds)):
        assert torch.equal(a, b)
    assert torch.equal(pc.decompress(got, backend="triton"), pages)


@pytest.mark.parametrize("fn", [shuffle.bitshuffle, shuffle.bitunshuffle])
@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_the_torch_shuffles_refuse_what_is_not_uint8_pages(fn, element_size, gen):
    """``uint8 [N, P]`` only, ``P`` a multiple of ``8 * element_size``, by name: an ``int32``
    page came back cut to its low bytes (``uint8``, the input's shape) without a word."""
    pages = mixed_pages(7, 4096, gen)
    wide = torch.randint(-2**31, 2**31 - 1, (3, 4096), dtype=torch.int32, generator=gen)
    for bad in (wide, wide.to(torch.int16), pages.float(), pages.view(-1),
                pages.view(7, 2, 2048)):
        with pytest.raises(fmt.PageCompError, match="expected uint8 \\[N, P\\] pages"):
            fn(bad, element_size)
    if element_size > 1:
        with pytest.raises(fmt.PageCompError, match="not a multiple of"):
            fn(pages[:, :8 * element_size + 8].contiguous(), element_size)
    # what they take is unchanged: the bytes of the wide pages, as uint8 rows
    rows = wide.view(torch.uint8).view(-1, 4096)
    assert torch.equal(shuffle.bitunshuffle(shuffle.bitshuffle(rows, element_size),
                                            element_size), rows)


def test_a_pool_stopped_by_another_thread_mid_batch_still_takes_the_batch(gen, monkeypatch):
    """The Python threads' path (no C loops): another thread stops the shared pool
    (``shutdown_pool``; a larger batch growing it does the same) just as a batch submits its
    ranges. The batch runs all the same, bit-exact (it raised "cannot schedule new futures
    after shutdown")."""
    monkeypatch.setattr(cpu_codec, "_native", None)
    monkeypatch.setattr(cpu_codec, "_threads", 4)
    cpu_codec.shutdown_pool()  # the next batch makes a pool of the class below
    others: list[threading.Thread] = []

    class Pool(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            if not others:  # the first submission: another thread stops the pool now
                other = threading.Thread(target=cpu_codec.shutdown_pool)
                others.append(other)
                other.start()
                other.join(timeout=1.0)  # (it waits for the pool's lock where that is held)
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setattr(cpu_codec, "ThreadPoolExecutor", Pool)
    pages = mixed_pages(4 * cpu_codec.MIN_THREADED_PAGES, 4096, gen)
    try:
        c = pc.compress(pages, backend="cpu")
        assert others, "the batch did not use the pool"
        out, status = pc.decompress(c, backend="cpu", return_status=True)
        assert not status.any() and torch.equal(out, pages)
    finally:
        for other in others:
            other.join()
        cpu_codec.shutdown_pool()
