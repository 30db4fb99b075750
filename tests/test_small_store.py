"""The small store's lifetimes and error paths (``offload/_small_store.py``, under
``PageCompressor``'s kernel-only path): what happens when a handle is freed before its offload
is seen done, when an offload fails between its launches, and when a handle is restored after
another thread freed it or after the exit-time close.

On the CPU every offload completes before it returns; :func:`in_flight` makes the small
store's offloads look as they do on a GPU (not done until the test says so), through a
stand-in for their completion event. Outputs are poisoned before every restore.
"""

from __future__ import annotations

import pytest
import torch
from test_direct import _floats
from test_small_tensor import _bits, _warm

from torch_pagecomp.format import PageCompError
from torch_pagecomp.kernels import host_pack
from torch_pagecomp.offload import _small_store


class _Pending:
    """A completion event that is not done until ``done`` is set (a GPU still working)."""

    done = False

    def query(self) -> bool:
        return _Pending.done

    def synchronize(self) -> None:
        _Pending.done = True


@pytest.fixture
def in_flight(monkeypatch):
    """The small store's offloads look in flight (their size unread, their event pending)
    until ``_Pending.done`` is set; the fixture gives ``_Pending``."""
    real = _small_store.SmallStore.offload

    def offload(self, src, fp16, producer):
        stored = real(self, src, fp16, producer)  # (the CPU: done and settled on return)
        if stored is not None:
            stored.pages_bytes, stored.done = None, _Pending()
            self._untrimmed.append(stored)
        return stored

    monkeypatch.setattr(_small_store.SmallStore, "offload", offload)
    _Pending.done = True
    yield _Pending
    _Pending.done = True


def _restored(pc, h, like):
    return pc.restore(h, out=torch.full_like(like, 7))


def test_a_handle_freed_before_its_offload_is_seen_done_is_counted(direct, gen, in_flight):
    """Offload, restore and free back to back (a KV cache's or a benchmark's cycle): the
    offload is not seen done before its handle goes. Its block is given back once done and
    its bytes are counted; the path's queue of unsettled offloads empties. (It used to stay
    blocked on that offload for good: every later offload queued behind it, uncounted, their
    blocks kept, and the queue past its bound made every offload poll both stores.)"""
    pc = direct(codec="exp")
    _warm(pc)
    d, small = pc._direct, pc._direct.small
    base_in = d.bytes_in
    x = _floats(gen, 3 * 2048 + 5, torch.bfloat16)
    in_flight.done = False
    h = pc.offload(x)
    assert torch.equal(_bits(_restored(pc, h, x)), _bits(x))
    h.free()
    in_flight.done = True
    keep = [pc.offload(_floats(gen, 2048, torch.float16)) for _ in range(70)]
    st = pc.stats()["direct"]  # (settles what is done)
    assert len(d._unsettled) == 0
    assert st["bytes_in"] - base_in == (3 + 70) * 4096
    for k in keep:
        k.free()
    pc.synchronize()
    assert small.arena.stats()["used_bytes"] == 0


def test_a_freed_block_waits_for_its_offload(direct, gen, in_flight):
    """A handle freed while its offload is in flight keeps its block until the offload is
    done (the copy kernel may still write it)."""
    pc = direct(codec="exp")
    _warm(pc)
    small = pc._direct.small
    in_flight.done = False
    h = pc.offload(_floats(gen, 2048, torch.bfloat16))
    used = small.arena.stats()["used_bytes"]
    h.free()
    pc._direct._settle()
    assert small.arena.stats()["used_bytes"] == used > 0
    in_flight.done = True
    pc._direct._settle()
    assert small.arena.stats()["used_bytes"] == 0


@pytest.mark.parametrize("fails", ["encode", "pack"])
def test_an_offload_that_fails_between_launches_leaves_the_store_usable(
        direct, gen, monkeypatch, fails):
    """An error after the block is taken (the encoder's or the copy kernel's launch) raises
    to the caller, gives the block back and zeroes the encoder's counters: the next offloads
    of both parities lay their pages from the scratch's start and restore exactly. (Before,
    the block leaked, and after a failed copy the next offload of the other parity laid its
    pages past its block from the failed one's count.)"""
    pc = direct(codec="exp")
    _warm(pc)
    small = pc._direct.small
    for _ in range(2):  # both parities used before
        pc.offload(_floats(gen, 2 * 2048, torch.bfloat16)).free()
    pc.synchronize()
    used = small.arena.stats()["used_bytes"]
    name = {"encode": "compress_exp_placed", "pack": "pack_small"}[fails]
    if fails == "encode":
        from torch_pagecomp.kernels import exp_codec as module
    else:
        module = host_pack
    real = getattr(module, name)
    calls = {"n": 0}

    def once(*args, **kwargs):
        calls["n"] += 1
        if fails == "pack":  # the encoder ran: its counter holds this offload's bytes
            real(*args, **kwargs)
        raise RuntimeError(f"simulated {fails} launch failure")

    monkeypatch.setattr(module, name, once)
    with pytest.raises(RuntimeError, match="simulated"):
        pc.offload(_floats(gen, 4 * 2048, torch.bfloat16))
    monkeypatch.setattr(module, name, real)
    assert calls["n"] == 1
    assert small.arena.stats()["used_bytes"] == used
    assert small.ends is not None and int(small.ends.abs().sum()) == 0
    for n in (4 * 2048, 3 * 2048 + 11, 2048, 4 * 2048):
        x = _floats(gen, n, torch.bfloat16)
        h = pc.offload(x)
        assert h._storage.stored.pages_bytes <= (n * 2 // 4096) * 4096
        assert torch.equal(_bits(_restored(pc, h, x)), _bits(x))
        h.free()


def test_a_handle_freed_by_another_thread_is_not_decoded(direct, gen):
    """A restore that reaches the store after its handle was freed (the caller's check
    passed, then another thread's free gave the block back) raises by name instead of
    decoding a block a new offload may rewrite."""
    pc = direct(codec="exp")
    _warm(pc)
    d = pc._direct
    x = _floats(gen, 2 * 2048, torch.bfloat16)
    h = pc.offload(x)
    storage = h._storage
    h.free()  # (its block given back at once: the lock was free)
    with pytest.raises(PageCompError, match="freed"):
        d.restore_small(storage.stored, torch.empty_like(x), None)
    y = _floats(gen, 4 * 2048, torch.bfloat16)  # the arena store's path: the same check
    h2 = pc.offload(y, element_size=2)
    storage2 = h2._storage
    h2.free()
    with pytest.raises(PageCompError, match="freed"):
        d.restore_into(storage2, torch.empty(y.numel() * 2, dtype=torch.uint8))


def test_handles_after_the_exit_close_raise_by_name(direct, gen):
    """After the interpreter-exit close unpinned every chunk, a restore raises by name (a
    decode would read host memory the GPU no longer addresses); an ordinary close leaves
    handles restorable (test_small_tensor.py)."""
    pc = direct(codec="exp")
    _warm(pc)
    x = _floats(gen, 2048, torch.bfloat16)
    h = pc.offload(x)
    pc._direct.close(final=True)
    with pytest.raises(PageCompError, match="interpreter exit"):
        pc.restore(h)
    h.free()  # (safe: the sink is not drained after the close)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_handles_freed_while_their_offloads_run_are_counted(gen):
    """On a GPU: offloads queued behind a busy stream, restored and freed before they ran
    (a KV cache's cycle); once the GPU is done the path's unsettled queue empties and every
    offload's bytes are counted; the restores are exact."""
    from torch_pagecomp.module import PageCompressor

    with PageCompressor(batch_pages=2048) as pc:
        _warm(pc)
        d = pc._direct
        wants = [_floats(gen, 4 * 2048, torch.bfloat16).cuda() for _ in range(8)]
        # this size's kernels compiled first, for both parities of the store's counters
        # (Triton specialises an integer 1): compiling one took seconds on a GPU host, and
        # the stall below ended before the loop's first offload was queued
        for want in wants[:2]:
            pc.restore(pc.offload(want)).sum().item()
        base = pc.stats()["direct"]["bytes_in"]
        torch.cuda._sleep(200_000_000)  # the offloads below queue behind this (~0.1 s)
        got = []
        for want in wants:
            h = pc.offload(want)
            got.append(pc.restore(h))
            h.free()
        assert not d.small._untrimmed[-1].source_read()  # (still queued when freed)
        torch.cuda.synchronize()
        st = pc.stats()["direct"]
        assert len(d._unsettled) == 0
        assert st["bytes_in"] - base == 8 * 4 * 4096
        assert all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, wants))
        assert pc.failed_restores(wait=True) == 0
        assert d.small.arena.stats()["used_bytes"] == 0


def test_empty_chunks_stay_pinned_until_released(direct, gen, monkeypatch):
    """Cycles of more than a few chunks' worth of small tensors, each cycle freed: the chunks
    made in the first cycle serve the next ones (none dropped and made again: on a GPU that
    was an unregister, which waits for the whole device, inside an offload or free, and a
    new registration); ``empty_cache()`` gives them back."""
    monkeypatch.setattr(_small_store, "CHUNK_BYTES", 64 << 10)  # (read when the store is made)
    pc = direct(codec="exp")
    _warm(pc)
    arena = pc._direct.small.arena
    made = []
    for _ in range(3):
        hs = [pc.offload(_floats(gen, 4 * 2048, torch.bfloat16)) for _ in range(12)]
        for h in hs:
            h.free()
        pc.synchronize()
        made.append(arena.stats()["misses"])
    assert arena.stats()["chunks"] >= 3 and made[0] == made[1] == made[2]
    assert arena.stats()["used_bytes"] == 0
    assert pc.empty_cache() > 0 and arena.stats()["chunks"] == 0


def test_a_poll_interrupted_while_giving_blocks_back_gives_each_back_once(monkeypatch):
    """A poll that raises midway through the freed blocks (an interrupt, an event's query)
    gives each block back once: those given back before the error leave the list of blocks
    to free, the rest go at the next poll. (The list was replaced only at the end: the next
    poll gave the first ones back again, and two offloads were carved the same bytes.)"""

    class Event:
        done = False

        def query(self):
            return Event.done

    store = _small_store.SmallStore(torch.device("cpu"), 4096, None)
    stored = []
    for _ in range(3):
        s = _small_store.SmallStored(4096, 4096, store.arena.alloc(1024), Event())
        s.pages_bytes = 0  # (its size read: settle reads nothing)
        store.free(s)  # kept: its offload is not done
        stored.append(s)
    assert len(store._freeing) == 3
    Event.done = True
    real, calls = store.arena.free, []

    def free(block):
        calls.append(block)
        real(block)
        if len(calls) == 2:  # an interrupt once the second block is back
            raise RuntimeError("simulated interrupt")

    monkeypatch.setattr(store.arena, "free", free)
    with pytest.raises(RuntimeError, match="simulated"):
        store.poll()
    monkeypatch.setattr(store.arena, "free", real)
    store.poll()
    a = store.arena
    assert a.frees == 3 and a.used_bytes == 0 and not store._freeing
    assert [c.free for c in a._chunks] == [[[0, a._chunks[0].mem.nbytes]]]
