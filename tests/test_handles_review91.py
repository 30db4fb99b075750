"""``compressed()`` of the kernel-only store's handles against a free from another thread
(review, session 91).

Session 90 made ``OffloadHandle.compressed()`` raise for a handle freed while the store read
it. The store's read itself had no hold on what it read: a placed slice's sizes and kinds are
views of the arena's host memory (raw addresses, which keep no chunk alive), and
``DirectPath.compressed`` concatenated them after it let the path's lock go, where a free
could give the chunk back (to be overwritten by a later offload) or, the compressor closed,
unmap it: the process crashed before the handle's check could run. And a stored tensor
freed before the read was read all the same (an empty container, or a block given back).
Now the lock is the read's hold (a free meanwhile waits in the sink until the read is
done), every byte is copied under it, and a freed stored tensor is refused there.

The kernel-only store's tests run on the CPU with the Triton interpreter (the ``direct``
fixture of ``conftest.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from torch_pagecomp import format as fmt
from torch_pagecomp._direct import DirectStorage, SmallStorage
from torch_pagecomp.format import PageCompError

POISON = 0xA5


def _data(gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A random tensor of two to four pages (one batch of the ``direct`` fixture's
    compressors), its last page partial: compressible small ints, or bf16 normals."""
    if dtype == torch.bfloat16:
        n = int(torch.randint(2049, 8192, (1,), generator=gen))
        return torch.randn(n, generator=gen).to(torch.bfloat16)
    n = int(torch.randint(1025, 4096, (1,), generator=gen))
    return torch.randint(0, 3, (n,), dtype=dtype, generator=gen)


def _same(got: fmt.CompressedPages, want: fmt.CompressedPages) -> None:
    for name in ("payload", "sizes", "kinds", "offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.page_size, got.codec) == (want.page_size, want.codec)


@pytest.mark.parametrize("codec,dtype,checksum", [("lz4", torch.int32, False),
                                                  ("exp", torch.bfloat16, True)])
def test_the_kernel_only_stores_read_is_copied_before_a_free_gives_its_chunk_back(
        direct, gen, monkeypatch, codec, dtype, checksum):
    """``DirectPath.compressed`` copied the pages under the path's lock, but its slices'
    sizes and kinds (views of the arena) were concatenated after it: another thread's free
    in between gave their bytes back, and what the next owner wrote there (poisoned here; on
    a GPU the copy engine writes it) came back as this tensor's sizes and kinds.
    (``checksum``: the exponent codec's pages through the paged store, not the small one.)"""
    pc = direct(codec=codec, checksum=checksum)
    x = _data(gen, dtype)
    h = pc.offload(x)
    storage = h._storage
    assert type(storage) is DirectStorage and storage.stored.slices
    want = h.compressed()
    arena = storage.path.store.arena
    held = [v for sl in storage.stored.slices for _, v in arena.pieces(sl.base, sl.total)]
    packed_pages = fmt.packed_pages
    seen = []

    def a_free_then_the_bytes_reused(*args, **kwargs):
        if not seen:
            seen.append(True)
            freer = threading.Thread(target=h.free)  # another thread frees the handle
            freer.start()
            freer.join()
            assert storage.stored.freed  # (given back at once: the read let the lock go)
            assert arena.backed  # (their chunk still mapped: the bytes may be written)
            for v in held:  # the next owner of the bytes writes them
                v.fill_(POISON)
        return packed_pages(*args, **kwargs)

    monkeypatch.setattr(fmt, "packed_pages", a_free_then_the_bytes_reused)
    got = storage.compressed(h.page_size)
    assert seen
    _same(got, want)
    y = _data(gen, dtype)  # the store still works: a new tensor restores
    assert torch.equal(pc.restore(pc.offload(y)).view(torch.uint8), y.view(torch.uint8))


_CLOSED_THEN_FREED = textwrap.dedent("""
    import sys, threading
    import torch
    from torch_pagecomp import format as fmt
    from torch_pagecomp.module import PageCompressor

    PageCompressor._takes_direct = (  # the ``direct`` fixture's rule
        lambda self, flat, nbytes: 0 < nbytes <= self.batch_pages * self.page_size)
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    n = int(torch.randint(1025, 4096, (1,), generator=gen))
    x = torch.randint(0, 3, (n,), dtype=torch.int32, generator=gen)
    pc = PageCompressor(device="cpu", batch_pages=4, codec="lz4")
    h = pc.offload(x)
    assert type(h._storage).__name__ == "DirectStorage"
    want = h.compressed()
    pc.close()  # the handle stays readable; a free now gives its chunk up at once
    packed_pages = fmt.packed_pages

    def freed_by_another_thread(*args, **kwargs):
        freer = threading.Thread(target=h.free)
        freer.start()
        freer.join()
        return packed_pages(*args, **kwargs)

    fmt.packed_pages = freed_by_another_thread
    try:
        h.compressed()
    except fmt.PageCompError as exc:
        assert "freed" in str(exc), exc
    else:
        raise AssertionError("a handle freed while it was read gave its pages")
    print("refused")
""")


def test_a_closed_compressors_handle_freed_while_read_is_refused_not_a_crash(gen):
    """A closed compressor gives a freed handle's chunks up at once (unmapped: nothing will
    reuse them). Freed by another thread just after ``DirectPath.compressed`` let its lock
    go, the sizes and kinds it concatenated then were views of unmapped memory: the process
    crashed (SIGSEGV) before the handle could check it was freed. Run in a child process."""
    from torch_pagecomp.kernels.launch import interpreting

    if not interpreting():
        pytest.skip("the store's pack kernel needs the Triton interpreter on the CPU")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    run = subprocess.run([sys.executable, "-c", _CLOSED_THEN_FREED, str(seed)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "refused" in run.stdout, (run.returncode, run.stderr[-3000:])


def _stored_of(pc, gen, store: str):
    """A handle of ``store`` ("paged" or "small") and what its ``compressed()`` gave."""
    dtype = torch.bfloat16 if store == "small" else torch.int32
    h = pc.offload(_data(gen, dtype))
    assert type(h._storage) is (SmallStorage if store == "small" else DirectStorage)
    return h, h.compressed()


@pytest.mark.parametrize("store,how", [("paged", "at once"), ("paged", "from the sink"),
                                       ("small", "at once"), ("small", "from the sink")])
def test_the_kernel_only_stores_read_of_a_freed_tensor_is_refused(direct, gen, store, how):
    """Freed before the store read it (another thread, after the handle's check): the paged
    store read the emptied stored tensor (an empty container), the small store a block given
    back, which a new offload had taken. "from the sink": freed while the path's lock was
    held, the free waited in the sink, and the read went on as if it had not come. Now the
    read drains the sink and refuses a freed tensor, as a restore does."""
    pc = direct(codec="exp", checksum=store == "paged")  # (no small store with checksums)
    h, _ = _stored_of(pc, gen, store)
    storage = h._storage
    if how == "at once":
        h.free()
        assert storage.stored.freed
        others = [_stored_of(pc, gen, store)]  # may take what was given back
    else:
        with storage.path._lock:  # another thread's call in the store's bookkeeping
            h.free()
        assert not storage.stored.freed and storage.path._sink
        others = []  # (an offload would drain the sink)
    with pytest.raises(PageCompError, match="this handle was freed"):
        storage.compressed(h.page_size)
    assert storage.stored.freed and not storage.path._sink
    others.append(_stored_of(pc, gen, store))
    for other, pages in others:
        _same(other.compressed(), pages)


def test_the_paged_stores_read_after_the_exit_close_is_refused_by_name(direct, gen):
    """After the interpreter-exit close released every chunk, the paged store's read looked
    the slice's chunk up among none and raised a KeyError; it is refused by name, as a
    restore is."""
    pc = direct(codec="lz4")
    h, _ = _stored_of(pc, gen, "paged")
    pc._direct.close(final=True)
    with pytest.raises(PageCompError, match="interpreter exit"):
        h.compressed()
    h.free()  # (safe: the sink is not drained after the close)
