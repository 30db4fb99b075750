"""Review of the host-memory arenas and pools (``pools``, ``offload._arena``,
``offload._copy_arena``), on the CPU: bad sizes refused before anything is carved, a block given
back twice refused even once its bytes were carved again, interrupted waits that lose no chunk
and leave the upload ring where it was, and a CPU output that dies under its pool's lock."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from torch_pagecomp.offload import _arena
from torch_pagecomp.offload._arena import TABLE_SIZE, UploadRing, VirtualArena
from torch_pagecomp.offload._copy_arena import PinnedCopyArena
from torch_pagecomp.pools import (
    HOST_PAGE,
    CpuOutputPool,
    HostArena,
    HostMemory,
    PinnedBufferPool,
)

CHUNK = 16 * HOST_PAGE


def _rand(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


class Interrupted:
    """An event whose first ``synchronize`` raises ``KeyboardInterrupt`` (a Ctrl-C while the
    host waits for the GPU); the next ones complete it."""

    def __init__(self):
        self.calls = 0
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise KeyboardInterrupt
        self.done = True


def _host_arena():
    a = HostArena(pin=False, chunk_bytes=CHUNK)
    return a, a.alloc, a.free, lambda: a.stats()


def _copy_arena():
    a = PinnedCopyArena(pin=False, chunk_bytes=CHUNK)
    return a, lambda n: a.get(n, None), a.put, lambda: a.stats()


ARENAS = {"HostArena": _host_arena, "PinnedCopyArena": _copy_arena}


@pytest.mark.parametrize("kind", sorted(ARENAS))
@pytest.mark.parametrize("bad", [-1, -HOST_PAGE, 100.5])
def test_a_bad_size_is_refused_before_anything_is_carved(kind, bad, gen):
    """A negative size gave a block whose view ran from its offset to a byte before the
    chunk's end (``tensor[0:-1]``: other blocks' bytes with it); a fractional one raised from
    the view's slicing with its bytes carved and counted for good."""
    arena, get, put, stats = ARENAS[kind]()
    keep = get(3000)
    data = _rand(3000, gen)
    keep.tensor.copy_(data)
    before = stats()
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        get(bad)
    assert stats() == before
    other = get(3000)  # carved where the refused size would have been: nothing shared
    other.tensor.copy_(_rand(3000, gen))
    assert torch.equal(keep.tensor, data)
    put(other)
    put(keep)
    assert all(c.free == [[0, c.mem.nbytes]] for c in
               (arena._chunks if kind == "HostArena" else arena.chunks))


@pytest.mark.parametrize("bad", [-5, 7.5])
def test_host_memory_and_the_staging_pool_refuse_a_bad_size(bad):
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        HostMemory(bad, pin=False)
    pool = PinnedBufferPool(pin=False)
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        pool.acquire(bad)
    assert pool.stats()["held_bytes"] == 0


@pytest.mark.parametrize("bad", [-1, 2.5])
def test_shrink_refuses_a_bad_size(bad, gen):
    arena = HostArena(pin=False, chunk_bytes=CHUNK)
    block = arena.alloc(4 * HOST_PAGE)
    before = (arena.stats(), block.size, block.nbytes)
    with pytest.raises((ValueError, TypeError), match="nbytes"):
        arena.shrink(block, bad)
    assert (arena.stats(), block.size, block.nbytes) == before
    assert block.tensor.numel() == 4 * HOST_PAGE


@pytest.mark.parametrize("kind", sorted(ARENAS))
def test_a_block_given_back_twice_after_its_bytes_were_carved_again_is_refused(kind, gen):
    """The free-range check catches a second give-back only while the bytes are still free;
    once another block holds them, the second give-back freed that block's bytes, and the next
    allocation was carved over a live block."""
    arena, get, put, stats = ARENAS[kind]()
    n = 2 * HOST_PAGE + 100
    first = get(n)
    put(first)
    live = get(n)  # first's bytes again
    assert (live.chunk, live.offset) == (first.chunk, first.offset)
    data = _rand(n, gen)
    live.tensor.copy_(data)
    before = stats()
    with pytest.raises(RuntimeError, match="freed twice"):
        put(first)
    assert stats() == before
    other = get(n)
    other.tensor.copy_(_rand(n, gen))
    assert torch.equal(live.tensor, data), "a block was carved over a live one"
    put(other)
    put(live)
    assert stats()["used_bytes" if kind == "HostArena" else "in_use_bytes"] == 0


def test_shrink_of_a_freed_block_is_refused(gen):
    """Shrinking a block given back (its end another block's by now) gave that block's bytes
    back."""
    arena = HostArena(pin=False, chunk_bytes=CHUNK)
    first = arena.alloc(4 * HOST_PAGE)
    arena.free(first)
    live = arena.alloc(4 * HOST_PAGE)
    data = _rand(4 * HOST_PAGE, gen)
    live.tensor.copy_(data)
    before = arena.stats()
    with pytest.raises(RuntimeError, match="freed twice"):
        arena.shrink(first, 100)
    assert arena.stats() == before
    other = arena.alloc(3 * HOST_PAGE)
    other.tensor.copy_(_rand(3 * HOST_PAGE, gen))
    assert torch.equal(live.tensor, data)


def _cpu_arena() -> VirtualArena:
    return VirtualArena(torch.device("cpu"), chunk_bytes=CHUNK)


def test_an_interrupted_trim_loses_no_chunk():
    """``trim`` took a free chunk off the list before waiting for its last read: interrupted
    there, the chunk was out of every count (and pinned until collected)."""
    arena = _cpu_arena()
    ev = Interrupted()
    mems = [HostMemory(CHUNK, pin=False) for _ in range(3)]
    arena.free.extend([(mems[0], ev), (mems[1], None), (mems[2], None)])
    held = arena.held_bytes
    with pytest.raises(KeyboardInterrupt):
        arena.trim(keep=1)
    assert arena.held_bytes == held and [m for m, _ in arena.free] == mems
    arena.trim(keep=1)
    assert ev.done and arena.unpins == 2 and [m for m, _ in arena.free] == mems[2:]


def test_a_window_exceeded_error_loses_no_chunk():
    """Backing a chunk a table's window past a live one raises; the free chunk it had taken
    first was then in neither ``free`` nor ``backed``."""
    arena = _cpu_arena()
    old, spare = HostMemory(CHUNK, pin=False), HostMemory(CHUNK, pin=False)
    arena.backed[0] = old  # a live slice's chunk
    arena.live[0] = 1
    arena.free.append((spare, None))
    arena.frontier = arena.limit = TABLE_SIZE * CHUNK
    held, pins = arena.held_bytes, arena.pins
    with pytest.raises(RuntimeError, match="window exceeded"):
        arena.back(HOST_PAGE, None)
    assert arena.held_bytes == held and arena.pins == pins
    assert arena.free == [(spare, None)] and arena.backed == {0: old}
    arena.free.clear()  # none free: none made either
    with pytest.raises(RuntimeError, match="window exceeded"):
        arena.back(HOST_PAGE, None)
    assert arena.pins == pins and arena.backed == {0: old}


class _Marks:
    """``_arena.mark`` for a CPU test: an event per call, the ``Interrupted`` one where
    asked."""

    def __init__(self):
        self.made: list = []
        self.interrupt_next = False

    def __call__(self, stream):
        ev = Interrupted() if self.interrupt_next else _Done()
        self.interrupt_next = False
        self.made.append(ev)
        return ev


class _Done:
    done = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _ring(slots: int) -> UploadRing:
    ring = UploadRing(pin=False)
    ring.pin, ring.half = True, slots // 2  # page-locked as far as the ring can tell
    ring.buf = torch.zeros(slots, dtype=torch.int64)
    ring.np = ring.buf.numpy()
    return ring


def test_an_interrupted_move_of_the_upload_ring_leaves_it_where_it_was(monkeypatch, gen):
    """Moving into the other half, the ring waits for that half's readers of half a ring ago.
    It moved first: a wait interrupted there left the writer in the half it had left, and the
    next table went on into the other half, over a table a kernel might still read, without
    the wait."""
    marks = _Marks()
    monkeypatch.setattr(_arena, "mark", marks)
    ring, stream = _ring(8), object()

    def table():
        return [[int(v) for v in torch.randint(0, 1 << 40, (3,), generator=gen)]]

    ring.put(table(), stream)  # half 0
    second = ring.put(table(), stream)  # half 1
    marks.interrupt_next = True  # (half 1's readers' mark, taken as the writer leaves it)
    ring.put(table(), stream)  # back into half 0
    reader = marks.made[-1]
    assert isinstance(reader, Interrupted)
    at = (ring.cur, ring.at)
    with pytest.raises(KeyboardInterrupt):  # into half 1: waiting for ``reader``
        ring.put(table(), stream)
    assert (ring.cur, ring.at) == at
    addr = ring.put_addr(table(), stream)
    assert reader.done, "a table written into half 1 before its last readers were waited for"
    assert addr == second.data_ptr()


def test_a_cpu_output_that_dies_under_its_pools_lock_does_not_hang():
    """A lease's finalizer runs wherever the GC collects it (an output in a reference cycle),
    on Python 3.12+ at any loop or call, so also on a thread inside the pool's lock (in
    ``empty``'s search): it waited for that lock, held by its own thread, for good."""
    pool = CpuOutputPool()
    out = pool.empty((1 << 20,))
    ptr = out.data_ptr()
    cycle = [out]
    cycle.append(cycle)
    holder = [cycle]
    del out, cycle
    result = {}

    def collect_under_lock():
        was = gc.isenabled()
        gc.disable()  # (collected below, under the lock, not before)
        try:
            with pool._lock:
                holder.clear()  # the cycle unreachable: its output dies in the collection
                gc.collect()
        finally:
            if was:
                gc.enable()
        result["stats"] = pool.stats()
        result["again"] = pool.empty((1 << 20,)).data_ptr()

    worker = threading.Thread(target=collect_under_lock, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "a lease's finalizer hung on its pool's lock"
    assert result["stats"]["idle_buffers"] == 1 and result["again"] == ptr


def test_a_storage_that_can_never_fit_max_bytes_unpins_no_idle_chunk(gen):
    """Under ``max_bytes``, a storage larger than the bound (or than what unpinning every idle
    chunk would leave room for) gets no block; it unpinned the idle chunks all the same (each
    unpin waits for the whole GPU), every step, and the next blocks pinned them again."""
    a = PinnedCopyArena(pin=False, max_bytes=3 * CHUNK, chunk_bytes=CHUNK)
    busy, idle = a.get(CHUNK, None), a.get(CHUNK, None)
    data = _rand(CHUNK, gen)
    idle.tensor.copy_(data)
    a.put(idle)
    assert a.get(3 * CHUNK, None) is None  # the bound less the busy chunk: never fits
    assert a.drops == 0 and a.held_bytes == 2 * CHUNK
    again = a.get(CHUNK, None)  # the idle chunk, still pinned: no chunk made
    assert again.chunk is idle.chunk and a.misses == 2 and torch.equal(again.tensor, data)
    a.put(again)
    big = a.get(2 * CHUNK, None)  # fits once the idle chunk goes: it does
    assert big is not None and a.drops == 1 and a.held_bytes == 3 * CHUNK
    a.put(big)
    a.put(busy)
