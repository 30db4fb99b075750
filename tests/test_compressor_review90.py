"""``PageCompressor``'s handles against other threads and odd outputs (review, session 90):
a handle whose offload ends while ``close()`` joins the workers, a handle freed by another
thread while ``compressed()`` reads it, and ``out`` tensors whose bits read back changed.

The kernel-only store's tests run on the CPU with the Triton interpreter (the ``direct``
fixture of ``conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

from torch_pagecomp import PageCompError
from torch_pagecomp.module import PageCompressor


def _ints(gen: torch.Generator, n: int, lo: int = 0, hi: int = 3) -> torch.Tensor:
    return torch.randint(lo, hi, (n,), dtype=torch.int32, generator=gen)


@pytest.mark.usefixtures("through_the_workers")
def test_a_handle_stored_while_close_joins_the_workers_restores(gen, hold_issuer):
    """``wait()`` polls the pipeline while the batches are pending. When the last batch
    finished after a poll's wait timed out and ``close()`` (another thread) joined the
    workers before its check, the check saw a closed pipeline without threads and raised
    "closed before the offload finished": the stored tensor's restore failed, as if lost."""
    pc = PageCompressor(device="cpu", batch_pages=4)
    gate = hold_issuer(pc)  # the issuer stores nothing until the gate opens
    check_alive = pc.pipeline.check_alive
    seen = []

    def check_alive_after_a_close():  # the waiter's check, run after all this happened
        if not seen:
            seen.append(True)
            gate.set()
            pc.close()  # drains the batches, then joins the workers
        check_alive()

    pc.pipeline.check_alive = check_alive_after_a_close  # (read by the handle's storage)
    try:
        x = _ints(gen, 2 * 4096 + 5)  # 3 batches of up to 4 pages: no wait for a slot
        h = pc.offload(x)
        assert h.state == "pending"
        assert torch.equal(pc.restore(h), x)
        assert seen and h.state == "ready"
        h.free()
        assert pc.stats()["bytes_held_host"] == 0
    finally:
        gate.set()
        pc.close()


@pytest.mark.parametrize("codec,dtype", [("exp", torch.bfloat16), ("lz4", torch.int32)])
def test_compressed_of_a_kernel_only_handle_freed_meanwhile_raises(direct, gen, codec,
                                                                   dtype):
    """``compressed()`` checked the handle before it waited and read: freed by another thread
    in between, the kernel-only store (and its small store) gave the block back, a new
    offload took it, and ``compressed()`` returned that tensor's pages as this handle's."""
    pc = direct(codec=codec)
    x = _ints(gen, 3000, 0, 3).to(torch.int16 if dtype == torch.bfloat16 else dtype)
    y = _ints(gen, 3000, 5, 9).to(x.dtype)
    x, y = x.view(dtype), y.view(dtype)
    h = pc.offload(x)
    kind = type(h._storage)
    assert h._storage.direct
    before = h.compressed()
    wait = kind.wait
    others = []

    def wait_then_another_thread_frees(storage):
        wait(storage)
        if not others:
            h.free()
            others.append(pc.offload(y))  # takes the block given back

    kind.wait = wait_then_another_thread_frees
    try:
        with pytest.raises(PageCompError, match="freed"):
            got = h.compressed()
            assert torch.equal(got.payload, before.payload), "another tensor's pages"
    finally:
        kind.wait = wait
    assert others and torch.equal(pc.restore(others[0]).view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("how", ["ring", "direct", "small"])
def test_restore_into_a_conjugate_or_negative_view_is_refused_by_name(direct, gen, how):
    """An ``out`` with the conjugate or negative bit: the decode writes bytes, and torch
    refused the byte view with a RuntimeError naming no argument (after the restore was
    counted); ``out`` is now refused up front, by name."""
    pc = direct(codec="exp") if how != "ring" else PageCompressor(device="cpu", batch_pages=4)
    try:
        n = 3000 if how != "ring" else 9 * 4096
        real_dtype = torch.bfloat16 if how == "small" else torch.float32
        x = torch.randn(n, generator=gen).to(real_dtype)
        h = pc.offload(x)
        assert (type(h._storage).__name__ == "SmallStorage") == (how == "small")
        assert h._storage.direct == (how != "ring")
        restores = pc.counts["restores"]
        out = torch._neg_view(torch.zeros_like(x))
        with pytest.raises(PageCompError, match="out must not be a negative view"):
            pc.restore(h, out=out)
        c = torch.randn(n // 2, dtype=torch.complex64, generator=gen)
        hc = pc.offload(c)
        with pytest.raises(PageCompError, match="out must not be a conjugate view"):
            pc.restore(hc, out=torch.zeros_like(c).conj())
        assert pc.counts["restores"] == restores
        got = torch.zeros_like(x)
        assert pc.restore(h, out=got) is got
        assert torch.equal(got.view(torch.uint8), x.view(torch.uint8))
        assert torch.equal(pc.restore(hc, out=torch.zeros_like(c)), c)
    finally:
        pc.close()


@pytest.mark.parametrize("bad", [None, "handle", torch.zeros(2, 3)])
def test_restore_blocks_refuses_what_is_not_a_handle_by_name(bad):
    """``restore_blocks`` read the handle's shape before ``restore`` checked its type: an
    AttributeError naming no argument (a tensor passed for it: a shape mismatch, or
    ``restore``'s error), where ``restore`` names the argument."""
    with PageCompressor(device="cpu") as pc:
        cache = torch.zeros(4, 3)
        with pytest.raises(PageCompError, match="restore_blocks takes an OffloadHandle"):
            pc.restore_blocks(bad, cache, [0, 1])
        h = pc.offload_blocks(torch.arange(12.0).view(4, 3), [2, 0])
        pc.restore_blocks(h, cache, [0, 1])
        assert torch.equal(cache[:2], torch.tensor([[6.0, 7, 8], [0, 1, 2]]))
