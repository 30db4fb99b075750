"""The hooks' page-locked memory for plain copies (``offload._copy_arena``), on the CPU: blocks
carved at exact sizes, never overlapping, any size served from the chunks already made, the
GPU's last use of freed bytes waited for, and chunks unpinned only beyond the busiest step of
the window."""

import random

import pytest
import torch

from torch_pagecomp.offload._copy_arena import PinnedCopyArena
from torch_pagecomp.pools import ALIGN, HOST_PAGE, SHRINK_STEPS, round_up

CHUNK = 64 * HOST_PAGE


class FakeEvent:
    """An event the test completes by hand."""

    def __init__(self, done: bool = False):
        self.done, self.synced = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced = self.done = True


class FakeStream:
    def __init__(self):
        self.waited: list[FakeEvent] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def arena(**kw) -> PinnedCopyArena:
    return PinnedCopyArena(pin=False, chunk_bytes=CHUNK, **kw)


def step(a: PinnedCopyArena, sizes: list[int], rng: random.Random) -> None:
    """One training step: a block per size, each filled with its own byte, checked, then all
    freed in reverse (a backward) and the arena shrunk."""
    blocks = []
    for n in sizes:
        b = a.get(n, None)
        assert b is not None and b.tensor.numel() == n and b.held_bytes == round_up(n, ALIGN)
        blocks.append((b, rng.randrange(256)))
        b.tensor.fill_(blocks[-1][1])
    for b, v in blocks:  # no block wrote into another's bytes
        assert bool((b.tensor == v).all())
    for b, _ in reversed(blocks):
        a.put(b)
    assert a.in_use_bytes == 0
    a.shrink()


def test_new_sizes_every_step_pin_nothing_after_the_first_steps(seed):
    """A new sequence length each step: every step's sizes differ (the largest storage, at
    the longest length, a whole chunk), yet after the first steps no chunk is made or let
    go."""
    rng = random.Random(seed)
    a = arena()
    base = [4 * HOST_PAGE + 100, 16 * HOST_PAGE, 3 * HOST_PAGE + 7]
    longest = [n * 4 for n in base] * 3
    for _ in range(SHRINK_STEPS):
        step(a, longest if rng.random() < 0.3 else
             [int(n * rng.uniform(1.0, 4.0)) for n in base] * 3, rng)
    step(a, longest, rng)
    made, dropped = a.misses, a.drops
    for _ in range(6 * SHRINK_STEPS):
        scale = rng.uniform(1.0, 4.0)
        step(a, [int(n * scale) for n in base] * 3, rng)
        if rng.random() < 0.3:
            step(a, longest, rng)
    assert (a.misses, a.drops) == (made, dropped), a.stats()


def test_blocks_are_exact_sizes_and_freed_bytes_merge_back(seed):
    rng = random.Random(seed)
    a = arena()
    sizes = [rng.randrange(1, 5 * HOST_PAGE) for _ in range(20)]
    blocks = [a.get(n, None) for n in sizes]
    assert a.in_use_bytes == sum(round_up(n, ALIGN) for n in sizes)
    rng.shuffle(blocks)  # freed in any order
    for b in blocks:
        a.put(b)
    for chunk in a.chunks:  # every chunk one free range again
        assert chunk.free == [[0, chunk.mem.nbytes]] and chunk.used == 0


def test_a_storage_larger_than_a_chunk_gets_whole_chunks_of_its_own():
    a = arena()
    b = a.get(CHUNK + 1, None)
    assert b.chunk.mem.nbytes == 2 * CHUNK and a.held_bytes == 2 * CHUNK
    small = a.get(HOST_PAGE, None)  # the big chunk's rest serves it
    assert small.chunk is b.chunk and a.misses == 1


def test_max_bytes_bounds_the_chunks_and_lets_idle_ones_go_for_a_block():
    a = arena(max_bytes=CHUNK + 8 * HOST_PAGE)
    first = a.get(CHUNK, None)
    second = a.get(4 * HOST_PAGE, None)  # a smaller chunk: what the bound leaves
    assert second.chunk.mem.nbytes == 8 * HOST_PAGE and a.held_bytes == CHUNK + 8 * HOST_PAGE
    assert a.get(8 * HOST_PAGE, None) is None  # no room, nothing idle: stays on the GPU
    a.put(first)
    third = a.get(CHUNK // 2, None)  # carved from the idle big chunk
    assert third is not None and third.chunk is first.chunk and a.drops == 0
    a.put(third)
    a.put(second)
    big = a.get(CHUNK + 4 * HOST_PAGE, None)  # only by letting both idle chunks go
    assert big is not None and a.drops == 2 and a.held_bytes == a.max_bytes  # (all it may)


def test_bytes_freed_before_the_gpu_is_done_with_them_are_waited_for():
    """A freed block whose last use is not complete: the next block carved from its chunk has
    its stream wait for that use; one complete is not waited for (nor kept)."""
    a = arena()
    b = a.get(HOST_PAGE, None)
    busy, done = FakeEvent(), FakeEvent(done=True)
    b.last_use = busy
    a.put(b)
    c = a.get(HOST_PAGE, None)
    c.last_use = done
    s = FakeStream()
    d = a.get(HOST_PAGE, s)
    assert s.waited == [busy]
    a.put(c)
    busy.done = True
    s2 = FakeStream()
    a.get(HOST_PAGE, s2)
    assert s2.waited == [] and d.chunk.waits == []


def test_shrink_unpins_a_chunk_idle_for_the_window_and_only_after_its_last_use():
    """A chunk that held no block for ``IDLE_STEPS`` steps goes (after the GPU's last use of
    it); until then it stays, however short the steps between."""
    from torch_pagecomp.offload._copy_arena import IDLE_STEPS

    rng = random.Random(0)
    a = arena()
    blocks = [a.get(CHUNK, None) for _ in range(4)]  # a step of four chunks
    last = blocks[-1]
    last.last_use = FakeEvent()  # the GPU still reads it when it is freed
    for b in reversed(blocks):
        a.put(b)
    a.shrink()
    waited = last.chunk.waits[0]
    for _ in range(IDLE_STEPS - 1):  # short steps: the first chunk only
        step(a, [CHUNK // 2], rng)
        assert len(a.chunks) == 4 and a.drops == 0, a.stats()
    step(a, [CHUNK // 2], rng)  # the other three idle for the whole window: they go
    assert len(a.chunks) == 1 and a.chunks[0] is blocks[0].chunk and a.drops == 3
    assert waited.synced  # unpinned only after its last use
    made = a.misses
    assert a.shrink() == 0 and a.misses == made  # nothing carved since: nothing changes


def test_clear_unpins_idle_chunks_only():
    a = arena()
    kept = a.get(CHUNK, None)
    idle = a.get(CHUNK, None)
    a.put(idle)
    a.clear()
    assert len(a.chunks) == 1 and a.chunks[0] is kept.chunk and a.held_bytes == CHUNK


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_blocks_are_page_locked():
    a = PinnedCopyArena(pin=True, chunk_bytes=CHUNK)
    b = a.get(3 * HOST_PAGE + 5, torch.cuda.current_stream())
    assert b.tensor.is_pinned()
    a.put(b)
    a.clear()
    assert a.held_bytes == 0



@pytest.mark.parametrize("fails", ["copy", "event"])
def test_a_plain_copy_that_fails_gives_its_block_back(monkeypatch, fails):
    """``PinnedStore.offload`` raising after its block was carved (the copy, or the event
    after it) gives the block back: the caller never sees it to free it. (It stayed carved
    for good: ``in_use_bytes`` drifted and its chunk was never unpinned.)"""
    from torch_pagecomp.offload import _stores

    monkeypatch.setattr(_stores, "current_stream", lambda device: None)  # (the CPU)
    if fails == "event":
        def mark(stream):
            raise RuntimeError("simulated event failure")

        monkeypatch.setattr(_stores, "mark", mark)
        src = torch.ones(3 * HOST_PAGE, dtype=torch.uint8)
    else:  # a copy out of a meta tensor raises
        src = torch.empty(3 * HOST_PAGE, dtype=torch.uint8, device="meta")
    a = arena()
    store = _stores.PinnedStore(a)
    with pytest.raises((RuntimeError, NotImplementedError)):
        store.offload(src, 1)
    assert a.in_use_bytes == 0 and all(c.used == 0 for c in a.chunks), a.stats()
    a.clear()
    assert a.held_bytes == 0


def test_a_get_whose_wait_for_freed_bytes_raises_carves_nothing():
    """``get`` raising while its stream is made to wait for the last use of a chunk's freed
    bytes (an event's query failing) carves nothing: no block is left in use that nobody
    holds. (The block was carved first: in_use_bytes drifted, the chunk never unpinned.)"""

    class Failing(FakeEvent):
        def query(self):
            if self.synced:  # (queried once by ``put``: not done)
                raise RuntimeError("simulated query failure")
            self.synced = True
            return False

    a = arena()
    b = a.get(HOST_PAGE, None)
    b.last_use = Failing()
    a.put(b)
    with pytest.raises(RuntimeError, match="simulated"):
        a.get(HOST_PAGE, FakeStream())
    assert a.in_use_bytes == 0 and all(c.used == 0 for c in a.chunks), a.stats()
