"""``PageCompressor``'s failure paths and lifetimes: a handle restored through another
compressor, a handle freed by one thread while another reads it, checksums checked on the host.

The kernel-only store's tests run on the CPU with the Triton interpreter (the ``direct``
fixture); the GPU tests at the end skip themselves without CUDA.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torch_pagecomp import PageCompError
from torch_pagecomp.module import INLINE_HOST_BYTES, PageCompressor

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ints(gen: torch.Generator, n: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, 3, (n,), dtype=torch.int32, generator=gen).to(device)


def test_a_kernel_only_handle_restores_through_another_compressor(direct, gen):
    """A handle keeps the store that holds its pages. Restored by a compressor of the same
    page size that never used its kernel-only store, it raised an AttributeError; by one
    that had, that one's store decoded its own arena at the handle's places: another
    tensor's bytes, or garbage, with no error."""
    a, b = direct(), direct()
    x, y = _ints(gen, 3000), _ints(gen, 3000)
    h = a.offload(x)
    assert h._storage.direct
    assert torch.equal(b.restore(h), x)  # b has no kernel-only store yet
    hb = b.offload(y)
    assert hb._storage.direct
    assert torch.equal(b.restore(h), x)
    assert torch.equal(b.restore(h, out=torch.full_like(x, 7), check=True), x)
    assert torch.equal(a.restore(hb), y)
    assert torch.equal(b.restore(hb), y) and torch.equal(a.restore(h), x)


def test_a_small_store_handle_restores_through_another_compressor(direct, gen):
    """The same for the small store's handles (16-bit floats, the exponent codec)."""
    a, b = direct(codec="exp"), direct(codec="exp")
    x = torch.randn(3000, generator=gen).to(torch.bfloat16)
    y = torch.randn(3000, generator=gen).to(torch.bfloat16)
    h = a.offload(x)
    assert type(h._storage).__name__ == "SmallStorage"
    assert torch.equal(b.restore(h).view(torch.int16), x.view(torch.int16))  # b: no store yet
    hb = b.offload(y)
    assert torch.equal(b.restore(h).view(torch.int16), x.view(torch.int16))
    assert torch.equal(a.restore(hb).view(torch.int16), y.view(torch.int16))


def test_compressed_of_a_handle_freed_meanwhile_by_another_thread_raises(gen, hold_issuer):
    """``compressed()`` waits for a pending handle; freed by another thread meanwhile, its
    blocks went back as its batches ended, and the waiter returned an empty or partial
    container (a lie) where it now raises. (A free while it copies: the next test.)"""
    pc = PageCompressor(device="cpu")
    gate = hold_issuer(pc)  # the issuer stores nothing until the gate opens
    try:
        x = torch.randint(0, 4, (INLINE_HOST_BYTES + 4096,), dtype=torch.uint8, generator=gen)
        h = pc.offload(x)  # through the workers: pending until the gate opens
        assert h.state == "pending"
        got: dict = {}

        def read():
            try:
                got["pages"] = h.compressed()
            except Exception as exc:  # noqa: BLE001 - checked below
                got["error"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.3)  # in h.wait()
        h.free()
        gate.set()
        reader.join(30)
        assert not reader.is_alive()
        assert "pages" not in got, f"a freed handle gave {got.get('pages')}"
        assert isinstance(got["error"], PageCompError) and "freed" in str(got["error"])
        assert pc.stats()["bytes_held_host"] == 0
        h2 = pc.offload(x)  # the compressor goes on
        assert torch.equal(pc.restore(h2), x) and h2.compressed().num_pages == 257
    finally:
        gate.set()
        pc.close()


def test_compressed_holds_the_blocks_against_a_free(monkeypatch):
    """A release while ``compressed`` copies waits for it, as it waits for a restore."""
    from torch_pagecomp.pools import HostArena
    from torch_pagecomp.storage import BlobLayout, Storage, StoredBatch

    arena = HostArena(pin=False, chunk_bytes=1 << 16)
    st = Storage(arena)
    lay = BlobLayout.of(1, 4096)
    block = arena.alloc(lay.total)
    block.tensor.zero_()
    lay.views(block.tensor)[2][0] = 4096  # one RAW page of 4096 bytes
    st.batch_stored(st.open_batch(), StoredBatch(block, lay, 0))
    st.batch_finished()
    st.close()
    seen = []
    clone = torch.Tensor.clone

    def clone_then_free(t, *args, **kwargs):  # another thread frees the handle mid-copy
        if not seen:
            seen.append(True)
            st.release()
            seen.append(arena.used_bytes)
        return clone(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone_then_free)
    c = st.compressed(4096)
    monkeypatch.undo()
    assert seen[1] > 0  # still held while copied
    assert c.num_pages == 1 and arena.used_bytes == 0 and st.released
    with pytest.raises(PageCompError, match="freed"):
        st.compressed(4096)


# ----------------------------------------------------------------------------- GPU
@gpu
def test_gpu_handle_restores_through_another_compressor(gen):
    """On a GPU every tensor of up to a batch (8-64 MiB) takes the kernel-only store: a
    handle restored by another compressor decoded that one's arena, without an error."""
    a, b = PageCompressor(), PageCompressor()
    try:
        x, y = _ints(gen, 3000, "cuda"), _ints(gen, 3000, "cuda")
        h = a.offload(x)
        assert h._storage.direct
        assert torch.equal(b.restore(h), x)
        hb = b.offload(y)
        assert torch.equal(b.restore(h), x) and torch.equal(b.restore(h, device="cpu"), x.cpu())
        assert torch.equal(a.restore(hb), y)
        assert b.failed_restores(wait=True) == 0
    finally:
        a.close()
        b.close()


@gpu
def test_gpu_source_checksums_checked_on_a_cpu_restore(gen):
    """A GPU tensor's page checksums stay on the GPU; a restore to the CPU compared them
    with the host's sums through a non-blocking copy queued behind the current stream's
    work, before it landed: pages reported corrupt that were not."""
    pc = PageCompressor(batch_pages=4, checksum=True)
    try:
        x = torch.randint(0, 4, (10 * 4096,), dtype=torch.uint8, generator=gen).cuda()
        h = pc.offload(x)  # more than a batch: the ring, whose handle keeps the sums
        assert not h._storage.direct and h.checksums.is_cuda
        h.wait()
        torch.cuda._sleep(1 << 30)  # the current stream busy (the model's work)
        got = pc.restore(h, device="cpu")
        assert torch.equal(got, x.cpu())
    finally:
        pc.close()
