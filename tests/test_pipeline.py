"""The slot ring, pools, back-pressure; GPU races, leaks, stage overlap (skip without CUDA)."""

import random
import threading
import time

import pytest
import torch
from pages import offload_cycles

import torch_pagecomp  # noqa: F401
from torch_pagecomp.cuda_stages import RawBypass
from torch_pagecomp.module import PageCompressor
from torch_pagecomp.pipeline import SlotState
from torch_pagecomp.pools import (
    ALIGN,
    HOST_PAGE,
    DeviceBufferPool,
    HostArena,
    HostBlock,
    HostMemory,
    InflightLimiter,
    PinnedBufferPool,
)
from torch_pagecomp.storage import BlobLayout, Storage, StoredBatch
from torch_pagecomp.timing import STAGES, overlapping_slots

# the workers themselves are tested here: every offload goes to them (conftest.py)
pytestmark = pytest.mark.usefixtures("through_the_workers")


# ----------------------------------------------------------------------------- pools
def test_host_memory_page_aligned_exact():
    for n in (1, 4095, 4096, 10_000):
        m = HostMemory(n, pin=False)
        assert m.tensor.numel() == n and m.tensor.data_ptr() % HOST_PAGE == 0
        assert m.held_bytes == -(-n // HOST_PAGE) * HOST_PAGE
        m.tensor.fill_(7)


def test_arena_exact_sizes_no_overlap_and_reuse():
    arena = HostArena(pin=False, chunk_bytes=1 << 20)
    rng = random.Random()
    live = []
    for step in range(2000):
        if live and rng.random() < 0.45:
            block, tag = live.pop(rng.randrange(len(live)))
            assert bool((block.tensor == tag).all()), "a block was overwritten by another"
            arena.free(block)
        else:
            n = rng.choice([1, 100, ALIGN, 4096, 50_000, rng.randrange(1, 200_000)])
            block = arena.alloc(n)
            assert block.tensor.numel() == n and block.size == -(-n // ALIGN) * ALIGN
            assert block.tensor.data_ptr() % ALIGN == 0
            tag = step % 251
            block.tensor.fill_(tag)
            live.append((block, tag))
    used = sum(b.size for b, _ in live)
    assert arena.stats()["used_bytes"] == used
    for block, _ in live:
        arena.free(block)
    s = arena.stats()
    assert s["used_bytes"] == 0 and s["hits"] > s["misses"]
    for chunk in arena._chunks:  # fully coalesced
        assert chunk.free == [[0, chunk.mem.nbytes]]
    held = s["held_bytes"]
    assert arena.trim() == held and arena.held_bytes == 0


@pytest.mark.parametrize("which", ["same", "overlapping", "after_coalescing"])
def test_a_block_freed_twice_is_refused_and_the_arena_stays_consistent(which):
    """A block given back twice raises, its chunk's free ranges unchanged: kept, two later
    allocations would share its bytes (one stored batch written over by another)."""
    arena = HostArena(pin=False, chunk_bytes=1 << 20)
    a, b, c = (arena.alloc(n) for n in (3000, 5000, 7000))
    arena.free(b)
    if which == "after_coalescing":
        arena.free(a)  # (a and b's ranges merged)
        twice = b
    elif which == "overlapping":
        twice = HostBlock(b.chunk, b.offset + 16, 64, 64, None)  # inside b's freed range
    else:
        twice = b
    before = (repr(b.chunk.free), b.chunk.used, arena.stats()["used_bytes"], arena.frees)
    with pytest.raises(RuntimeError, match="freed twice"):
        arena.free(twice)
    assert (repr(b.chunk.free), b.chunk.used, arena.stats()["used_bytes"], arena.frees) == before
    x, y = arena.alloc(5000), arena.alloc(5000)  # never the same bytes
    assert x.offset + x.size <= y.offset or y.offset + y.size <= x.offset or x.chunk is not y.chunk
    for blk in (x, y, c) + (() if which == "after_coalescing" else (a,)):
        arena.free(blk)
    assert arena.stats()["used_bytes"] == 0


def test_arena_bigger_than_chunk():
    arena = HostArena(pin=False, chunk_bytes=1 << 16)
    b = arena.alloc(3 << 16)
    assert arena.stats()["chunks"] == 1 and arena.held_bytes >= 3 << 16
    arena.free(b)


def test_staging_and_device_pools_hit_after_warmup():
    pool = PinnedBufferPool(pin=False)
    dev = DeviceBufferPool(torch.device("cpu"))
    for _ in range(5):
        a, b = pool.acquire(10_000), dev.acquire(777)
        pool.release(a)
        dev.release(b)
    assert (pool.misses, pool.hits) == (1, 4) and (dev.misses, dev.hits) == (1, 4)
    assert pool.stats()["held_bytes"] == 3 * HOST_PAGE and dev.stats()["held_bytes"] == 777
    pool.clear()
    dev.clear()
    assert pool.held_bytes == 0 and dev.held_bytes == 0


def test_a_pool_clear_interrupted_midway_stays_consistent():
    """A ``clear`` that raises while dropping a buffer (a copy still queued on it failing at
    its wait, a KeyboardInterrupt) leaves the pool consistent: the buffers dropped before
    are gone from the idle lists (not handed out again, unpinned) and counted out once; a
    later ``clear`` drops the rest and ``held_bytes`` ends at 0. (Before, every buffer stayed
    listed while the dropped ones were counted out: held_bytes went negative and acquire
    handed out released buffers.)"""

    class Failing:
        def synchronize(self):
            raise RuntimeError("simulated failure at a buffer's last use")

    pool = PinnedBufferPool(pin=False)
    bufs = [pool.acquire(n) for n in (HOST_PAGE, HOST_PAGE, 2 * HOST_PAGE, 3 * HOST_PAGE)]
    bufs[2].last_use = Failing()
    for b in bufs:
        pool.release(b)
    with pytest.raises(RuntimeError, match="simulated"):
        pool.clear()
    listed = [b for bucket in pool._free.values() for b in bucket]
    assert pool.held_bytes == sum(b.held_bytes for b in listed)
    again = [pool.acquire(b.nbytes) for b in bufs]
    assert not any(a is b for a in again for b in bufs if b not in listed)
    for a in again:
        pool.release(a)
    pool.clear()
    assert pool.held_bytes == 0 and not pool._free


def test_limiter_blocks_until_release():
    lim = InflightLimiter(100)
    lim.acquire(60)
    got = threading.Event()
    th = threading.Thread(target=lambda: (lim.acquire(60), got.set()))
    th.start()
    assert not got.wait(0.1)  # 120 > 100: waits
    lim.release(60)
    assert got.wait(2)
    th.join()
    assert lim.waits == 1 and lim.max_seen == 60
    lim.release(60)
    lim.acquire(500)  # larger than the bound: admitted alone
    lim.release(500)



def test_limiter_stop_wakes_waiters_and_refuses_later():
    lim = InflightLimiter(100)
    lim.acquire(100)
    errors = []

    def wait():
        try:
            lim.acquire(10)
        except RuntimeError as exc:
            errors.append(exc)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.1)
    lim.stop(RuntimeError("stopped"))
    th.join(1)
    assert not th.is_alive() and [str(e) for e in errors] == ["stopped"]
    with pytest.raises(RuntimeError, match="stopped"):
        lim.acquire(1)
    lim.release(100)  # in-flight work still gives its bytes back
    assert lim.in_flight == 0

# ----------------------------------------------------------------------------- storage
def test_blob_layout():
    lay = BlobLayout.of(3, 13)
    assert (lay.offsets_at, lay.sizes_at, lay.kinds_at, lay.total) == (16, 48, 60, 63)
    blob = torch.zeros(lay.total, dtype=torch.uint8)
    payload, offsets, sizes, kinds = lay.views(blob)
    assert payload.numel() == 13 and offsets.numel() == 4 and sizes.numel() == 3
    assert kinds.numel() == 3


def test_storage_freed_in_flight_keeps_blocks_until_written():
    arena = HostArena(pin=False, chunk_bytes=1 << 16)
    st = Storage(arena)
    i = st.open_batch()
    st.close()
    st.release()  # the handle is freed while its batch is in flight
    st.batch_stored(i, StoredBatch(arena.alloc(100), BlobLayout.of(1, 50), 0))
    assert arena.used_bytes > 0  # its copy may still be writing: not recycled yet
    st.batch_finished()
    assert arena.used_bytes == 0 and st.released and st.done.is_set()


def test_storage_kernel_bytes_leave_out_batches_stored_raw_untried():
    """The class policy judges compressibility from ``kernel_bytes``: batches the pipeline
    stored raw without the kernel (bypass, raw share) must not count."""
    arena = HostArena(pin=False, chunk_bytes=1 << 20)
    st = Storage(arena)
    n_k = [random.randrange(1, 40) for _ in range(3)]
    stored_k = [random.randrange(1, n * 4096) for n in n_k]
    for n, t in zip(n_k, stored_k):
        lay = BlobLayout.of(n, t)
        st.batch_stored(st.open_batch(), StoredBatch(arena.alloc(lay.total), lay, 0))
    raw = BlobLayout.of(64, 64 * 4096)
    st.batch_stored(st.open_batch(), StoredBatch(arena.alloc(raw.total), raw, 0, True))
    want_in = sum(n_k) * 4096
    want_stored = sum(BlobLayout.of(n, t).total for n, t in zip(n_k, stored_k))
    assert st.kernel_bytes(4096) == (want_in, want_stored)
    assert st.stored_nbytes == want_stored + raw.total  # host bytes count every batch


def test_storage_release_deferred_while_read():
    arena = HostArena(pin=False, chunk_bytes=1 << 16)
    st = Storage(arena)
    block = arena.alloc(100)
    st.batch_stored(st.open_batch(), StoredBatch(block, BlobLayout.of(1, 50), 0))
    st.batch_finished()
    assert not st.done.is_set()  # still open
    st.close()
    assert st.done.is_set()
    st.add_reader()
    st.release()
    assert arena.used_bytes > 0 and not st.released  # a restore still reads it
    st.reader_done()
    assert arena.used_bytes == 0 and st.released
    with pytest.raises(RuntimeError):
        st.add_reader()


# ----------------------------------------------------------------------------- ring (CPU)
def test_backpressure_bound_smaller_than_work(gen):
    bound = 3 * 4096
    pc = PageCompressor(device="cpu", batch_pages=8, max_pinned_bytes=bound)
    assert pc.batch_pages == 3  # capped so one batch fits the bound
    xs = [torch.randint(0, 3, (n,), dtype=torch.uint8, generator=gen) for n in (50_000, 81_921)]
    hs = [pc.offload(x) for x in xs]
    for x, h in zip(xs, hs):
        assert torch.equal(pc.restore(h), x)
    s = pc.stats()
    assert s["backpressure_waits"] > 0, s
    assert s["inflight_max_bytes"] <= bound and s["inflight_bytes"] == 0


def test_detached_batch_leaves_the_ring_and_bounds_downloads():
    """The GPU issuer's bookkeeping (``Pipeline._detach``), on a CPU ring: a batch whose download
    is queued leaves its ring position to another slot, which the caller gets at once; the
    position shows the batch's state until the batch completes; at most ``slots`` batches are
    detached (the issuer waits); completed ones give their slots to the spare pool."""
    from torch_pagecomp.pipeline import Pipeline, _Job

    p = Pipeline("cpu", 4096, 4, slots=2)
    try:
        jobs = []
        for _ in range(2):
            slot = p.acquire_slot()
            job = _Job("offload", slot, None, 0, 1, 4096)
            slot.job, slot.cpu_stage = job, SlotState.DOWNLOADING
            p._detach(job)
            jobs.append(job)
        assert p._detached == 2 and all(j.slot.detached and j.slot.active for j in jobs)
        assert all(ring is not j.slot for ring, j in zip(p.slots, jobs))
        assert p.states() == [SlotState.DOWNLOADING] * 2  # the ring still shows the downloads
        assert not any(ring.active for ring in p.slots)  # (else the next line would block)
        s0 = p.acquire_slot()  # no wait: the position was handed on
        assert s0.index == jobs[0].slot.index and not s0.detached and s0.previous is None
        waiter = threading.Thread(target=p._wait_download_room)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "a third download outside the ring must wait"
        p._release_slot(jobs[0].slot)  # its download completed
        waiter.join(5)
        assert not waiter.is_alive() and p._detached == 1 and p._spare == [jobs[0].slot]
        assert p.states()[1] == SlotState.DOWNLOADING
        p._release_slot(jobs[1].slot)
        assert p.states()[1] == SlotState.COMPLETE and p._detached == 0
        p._release_slot(s0)
        p.drain()  # nothing active, nothing detached
    finally:
        p.close()


def test_slot_states_and_ring_order(gen, monkeypatch):
    from torch_pagecomp import pipeline as pipeline_module

    pc = PageCompressor(device="cpu", batch_pages=2, slots=3)
    seen = set()
    stop = threading.Event()
    busy_seen = threading.Event()  # the watcher saw a slot at work
    real = pipeline_module.BlobLayout

    class GatedLayout(real):
        """The CPU compress stage lays out its batch while its slot is COMPRESSING: it waits
        there until the watcher has seen a slot at work (on a fast runner the 20 batches
        otherwise finished between two of the watcher's looks)."""

        @classmethod
        def of(cls, *args, **kwargs):
            if not busy_seen.wait(5):
                busy_seen.set()  # never seen: the assertion below says so, once
            return real.of(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "BlobLayout", GatedLayout)

    def watch():
        while not stop.is_set():
            states = pc.slot_states()
            seen.update(states)
            if SlotState.COMPRESSING in states or SlotState.UPLOADING in states:
                busy_seen.set()

    th = threading.Thread(target=watch)
    th.start()
    x = torch.randint(0, 256, (40 * 4096,), dtype=torch.uint8, generator=gen)
    h = pc.offload(x)
    h.wait()
    pc.synchronize()
    stop.set()
    th.join()
    assert set(pc.slot_states()) == {SlotState.COMPLETE}
    assert SlotState.COMPRESSING in seen or SlotState.UPLOADING in seen
    tl = [t for t in pc.timeline() if t["kind"] == "offload"]
    assert [t["slot"] for t in tl] == [i % 3 for i in range(20)]
    assert all(t["gbps"] > 0 and t["bound"] in STAGES and t["ratio"] > 0.9 for t in tl)
    assert torch.equal(pc.restore(h), x)


def test_pools_hit_after_warmup_and_no_growth(gen):
    pc = PageCompressor(device="cpu", batch_pages=4)
    x = torch.randint(0, 256, (30_000,), dtype=torch.uint8, generator=gen)
    pc.restore(pc.offload(x)).sum()
    warm = pc.stats()
    for _ in range(20):
        h = pc.offload(x)
        assert torch.equal(pc.restore(h), x)
        h.free()
    s = pc.stats()
    assert s["pool_misses"] == warm["pool_misses"] and s["pool_hits"] > warm["pool_hits"]
    assert s["host_pool_bytes"] == warm["host_pool_bytes"] and s["bytes_held_host"] == 0
    assert pc.empty_cache() > 0 and pc.stats()["host_pool_bytes"] == 0


def test_worker_error_reaches_handle_and_ring_recovers(monkeypatch, gen):
    pc = PageCompressor(device="cpu", batch_pages=2)
    real = pc.pipeline._cpu_compress
    calls = {"n": 0}

    def flaky(job):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        real(job)

    monkeypatch.setattr(pc.pipeline, "_cpu_compress", flaky)
    x = torch.randint(0, 256, (6 * 4096,), dtype=torch.uint8, generator=gen)
    h = pc.offload(x)
    with pytest.raises(RuntimeError, match="boom"):
        h.wait()
    assert h.state == "failed"
    h2 = pc.offload(x)
    assert torch.equal(pc.restore(h2), x)
    h.free()
    h2.free()
    assert pc.stats()["bytes_held_host"] == 0 and pc.stats()["inflight_bytes"] == 0


def test_a_release_interrupted_midway_gives_each_block_back_once(monkeypatch, gen):
    """A handle's free that raises after its first block went back (an interrupt inside the
    arena's free) is finished by the next free, each block given back once: before, the
    block already given back was still listed and went back a second time (overlapping free
    ranges: one range carved for two batches)."""
    pc = PageCompressor(device="cpu", batch_pages=2, slots=2)
    x = torch.randint(0, 4, (5 * 4096,), dtype=torch.uint8, generator=gen)
    h = pc.offload(x)
    h.wait()
    arena = pc.pipeline.arena
    used = arena.stats()["used_bytes"]
    assert used > 0
    real, calls = arena.free, []

    def free_then_interrupt(block):
        calls.append(block)
        real(block)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(arena, "free", free_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        h._storage.release()
    h._storage.release()  # the next free (the handle's finalizer calls the same)
    assert len(calls) == 3 and len({id(b) for b in calls}) == 3
    st = arena.stats()
    assert st["used_bytes"] == 0 and arena.frees == 3
    monkeypatch.setattr(arena, "free", real)
    y = torch.randint(0, 4, (5 * 4096,), dtype=torch.uint8, generator=gen)
    assert torch.equal(pc.restore(pc.offload(y), device="cpu"), y)  # the arena still works
    pc.close()


def test_interrupted_cpu_restore_gives_its_slot_back(monkeypatch, gen):
    """A CPU restore interrupted while a batch decodes (a ``KeyboardInterrupt``, or a
    ``MemoryError`` for its pages) gives that batch's ring slot back: else the ring's next
    offload waited for it for ever, and so did ``synchronize`` and ``close``."""
    from torch_pagecomp import pipeline as pipeline_module

    pc = PageCompressor(device="cpu", batch_pages=2, slots=2)
    x = torch.randint(0, 4, (5 * 4096,), dtype=torch.uint8, generator=gen)
    h = pc.offload(x)
    h.wait()
    real, calls = pipeline_module.decompress_cpu_direct, []

    def second_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pipeline_module, "decompress_cpu_direct", second_interrupted)
        with pytest.raises(KeyboardInterrupt):
            pc.restore(h)
    assert pc.pipeline.drain(timeout=2), "a slot of the interrupted restore is still held"
    assert torch.equal(pc.restore(h), x)
    h2 = pc.offload(x)  # takes every slot of the ring in turn
    assert torch.equal(pc.restore(h2), x)
    h.free()
    h2.free()
    assert pc.stats()["bytes_held_host"] == 0
    assert pc.close(timeout=10)


def test_close_cancel_fails_queued_batches_and_joins(monkeypatch, gen):
    pc = PageCompressor(device="cpu", batch_pages=1, slots=3)
    p = pc.pipeline
    real = p._cpu_compress

    def slow(job):
        time.sleep(0.3)
        real(job)

    monkeypatch.setattr(p, "_cpu_compress", slow)
    x = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8, generator=gen)
    h = pc.offload(x)  # three batches queued; the first one is running
    assert p.close(cancel=True, timeout=10)
    assert not any(t.is_alive() for t in p._threads)
    with pytest.raises(RuntimeError, match="closed before this batch ran"):
        h.wait()
    h.free()
    s = pc.stats()
    assert s["bytes_held_host"] == 0 and s["inflight_bytes"] == 0
    assert s["host_pool_bytes"] == 0  # idle pools released on close


def test_no_job_queued_behind_the_workers_end(gen):
    """A batch handed over after the end marker would never be taken: refused instead."""
    from torch_pagecomp.pipeline import PipelineStopped

    pc = PageCompressor(device="cpu", batch_pages=1)
    p = pc.pipeline
    p._send_stop()
    with pytest.raises(PipelineStopped):
        p._enqueue(p._issue_q, object())
    assert p.close(timeout=10)
    with pytest.raises(PipelineStopped, match="closed"):
        p.acquire_slot()
    assert p.drain(timeout=1)


def test_raw_bypass_policy():
    rb = RawBypass(enabled=True, streak=2, probe=4)
    key = ("bf16", 2)
    assert rb.route(key) == "kernel" and rb.route(None) == "kernel"
    rb.observe(key, 1000, 1000)
    assert rb.route(key) == "kernel"  # streak 1 < 2
    rb.observe(key, 990, 1000)  # saved < 1/32: still incompressible
    routes = [rb.route(key) for _ in range(8)]
    assert routes == ["raw"] * 3 + ["probe"] + ["raw"] * 3 + ["probe"]
    assert rb.raw_batches == 6
    rb.observe(key, 500, 1000)  # a probe compressed: back to the kernel
    assert rb.route(key) == "kernel" and rb.route(("other", 1)) == "kernel"
    assert RawBypass(enabled=False).route(key) == "kernel"


def test_raw_share_balances_kernel_and_copy_engine():
    nbytes, key = 33_000_000, ("u8", 1)

    def fed(max_share, kernel_gbps, link_gbps=55.0, ratio=2.83):
        rb = RawBypass(enabled=True, bypass=False, max_raw_share=max_share)
        payload = int(nbytes / ratio)
        for _ in range(3):
            rb.observe(key, payload, nbytes, nbytes / (kernel_gbps * 1e6),
                       payload / (link_gbps * 1e6))
        return rb

    rb = fed(1.0, 24.7)
    share = rb.share(key)
    assert abs(share - 0.652) < 0.01
    assert all(rb.route(key) == "kernel" for _ in range(5))  # not an incompressible stream
    raws = [rb.split(key, 1000) for _ in range(100)]  # whole batches raw, the share of them
    assert set(raws) == {0, 1000} and raws.count(1000) in (64, 65, 66), raws
    assert rb.split_batches == rb.raw_batches == raws.count(1000)
    rb = fed(0.3, 24.7)
    assert rb.share(key) == 0.3 and [rb.split(key, 10) for _ in range(10)].count(10) in (2, 3)
    assert fed(1.0, 200.0).split(key, 1000) == 0  # the kernel outruns the link: compress all
    assert fed(0.0, 24.7).split(key, 1000) == 0
    assert RawBypass(enabled=True, bypass=False).split(key, 1000) == 0  # nothing measured yet
    assert RawBypass(enabled=False, max_raw_share=1.0).split(key, 1000) == 0


def test_overlapping_slots_counts_cross_slot_stage_overlap():
    def t(slot, up, k, d):
        return {"slot": slot, "upload": up, "kernel": k, "download": d}

    serial = [t(0, (0, 1), (1, 2), (2, 3)), t(1, (3, 4), (4, 5), (5, 6))]
    piped = [t(0, (0, 1), (1, 2), (2, 3)), t(1, (1, 2), (2, 3), (3, 4)),
             t(2, (2, 3), (3, 4), (4, 5))]
    assert overlapping_slots(serial) == 0
    assert overlapping_slots(piped) >= 3


# ----------------------------------------------------------------------------- GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP = 20_000_000  # cycles of torch.cuda._sleep: ~10 ms, far longer than the copies raced


# the controls below race the host's queuing against a sleep: under 8 test workers on one
# host, queuing a restore has taken longer than 10 ms (the control then saw no race)
CONTROL_SLEEP = 10 * SLEEP


def _produce(x: torch.Tensor, src: torch.Tensor, sleep: int = SLEEP) -> None:
    """On the caller's stream: stay busy, then write ``x`` (so a reader that skips the wait
    reads the old contents)."""
    torch.cuda._sleep(sleep)
    x.copy_(src)


@gpu
@pytest.mark.gpu
def test_gpu_stress_bit_exact_with_busy_streams(gen):
    pc = PageCompressor(batch_pages=16, max_pinned_bytes=40 * 4096)  # 2 batches in flight
    srcs, handles = [], []
    for i in range(48):
        n = random.randrange(1, 300_000)
        src = (torch.randint(0, 4 if i % 2 else 256, (n,), dtype=torch.uint8, generator=gen)
               .cuda())
        x = torch.full_like(src, 0xA5)
        _produce(x, src)
        handles.append(pc.offload(x, element_size=random.choice([1, 2, 4])))
        srcs.append(src)
    for src, h in zip(srcs, handles):
        torch.cuda._sleep(SLEEP)  # the consumer stream is busy before the restore
        with torch.cuda.stream(pc.pipeline.compute):
            torch.cuda._sleep(SLEEP // 4)  # the restore's own kernels start late
        y = pc.restore(h)
        assert torch.equal(y.clone(), src)  # read at once in stream order
    pc.synchronize()
    assert pc.stats()["inflight_max_bytes"] <= 40 * 4096


@gpu
@pytest.mark.gpu
def test_gpu_control_missing_waits_corrupt(gen, monkeypatch):
    """The same races with the barrier removed must corrupt data: the stress test can fail."""
    # the ring's races: tensors of one batch would take the kernel-only store (test_direct.py)
    monkeypatch.setattr(PageCompressor, "_takes_direct", lambda self, flat, nbytes: False)
    warm = PageCompressor(batch_pages=256)  # compile every kernel first: a JIT compile inside a
    for hi in (256, 4):  # race below would let the sleep end before the racing work is queued
        data = torch.randint(0, hi, (1 << 20,), dtype=torch.uint8, generator=gen).cuda()
        warm.restore(warm.offload(data))
    torch.cuda.synchronize()
    pc = PageCompressor(batch_pages=256)  # 1 MiB: one batch
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen).cuda()
    x = torch.full_like(src, 0xA5)
    _produce(x, src, CONTROL_SLEEP)
    st = Storage(pc.pipeline.arena)
    with torch.cuda.device(pc.device):  # producer=None: the wait on the caller stream is skipped
        pc.pipeline.submit_compress(st, x, x.numel(), 1, producer=None, keep=(x,))
    st.done.wait()
    torch.cuda.synchronize()
    host = torch.empty(src.numel(), dtype=torch.uint8)
    pc.pipeline.cpu_decompress(st, host)  # what was stored
    assert not torch.equal(host.cuda(), src), "a missing producer wait went unnoticed"
    # consumer side: the caller's stream does not wait for the decompression (compressible
    # data, so the blob goes through the decompress kernel on the delayed compute stream)
    src = torch.randint(0, 4, (1 << 20,), dtype=torch.uint8, generator=gen).cuda()
    good = pc.offload(src)
    good.wait()
    pc.restore(good)  # the same blob once: kernels specialise on sizes, so compile them now
    torch.cuda.synchronize()
    out = torch.full_like(src, 0xA5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(pc.pipeline.compute):
        torch.cuda._sleep(CONTROL_SLEEP)
    pc.pipeline.submit_decompress(good._storage, out, side)  # waits on `side`, not ours
    early = out.clone()
    torch.cuda.synchronize()
    assert not torch.equal(early, src), "a missing consumer wait went unnoticed"
    assert torch.equal(out, src)


@gpu
@pytest.mark.gpu
def test_gpu_10k_cycles_no_growth(gen):
    pc = PageCompressor(batch_pages=4)
    x = torch.randint(0, 8, (5 * 4096 + 11,), dtype=torch.uint8, generator=gen).cuda()
    dev0, s0, s = offload_cycles(pc, x, 10_000)
    assert torch.cuda.memory_allocated() <= dev0
    assert s["pinned_bytes_held"] == s0["pinned_bytes_held"]
    assert s["host_pool_bytes"] == s0["host_pool_bytes"]
    assert s["pool_misses"] == s0["pool_misses"] and s["bytes_held_host"] == 0


@gpu
@pytest.mark.gpu
def test_gpu_stages_of_different_slots_overlap(gen):
    pc = PageCompressor(batch_pages=1024)  # 4 MiB batches
    host = torch.randint(0, 16, (64 << 20,), dtype=torch.uint8, generator=gen).pin_memory()
    pc.compress_host(host).wait()  # warm-up: pools, kernels
    pc.synchronize()
    pc.reset_timing()
    t0 = time.perf_counter()
    h = pc.compress_host(host)
    h.wait()
    wall = time.perf_counter() - t0
    pc.synchronize()
    tl = [t for t in pc.timeline() if t["kind"] == "offload"]
    assert len(tl) == 16
    assert overlapping_slots(tl) > 0, tl[:4]
    busy = sum(t["upload_ms"] + t["kernel_ms"] + t["download_ms"] for t in tl)
    print(f"wall {wall * 1e3:.1f} ms, stage sum {busy:.1f} ms")
    assert torch.equal(pc.restore(h, device="cpu"), host)


@gpu
@pytest.mark.gpu
def test_gpu_free_in_flight_never_recycles_a_block_being_written(gen):
    pc = PageCompressor(batch_pages=64)
    for i in range(30):
        a = torch.randint(0, 256, (256 * 4096,), dtype=torch.uint8, generator=gen).cuda()
        b = torch.randint(0, 2, (256 * 4096,), dtype=torch.uint8, generator=gen).cuda()
        torch.cuda._sleep(SLEEP // 4)
        pc.offload(a).free()  # freed while its copies are still queued
        h = pc.offload(b)
        assert torch.equal(pc.restore(h), b), i
        h.free()
    pc.synchronize()
    assert pc.stats()["bytes_held_host"] == 0


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("publish", ["kernel", "copy"])
def test_gpu_batch_size_reaches_host_by_kernel_or_copy(publish, gen, monkeypatch, recwarn):
    """The issuer sizes each download from ``T`` stored into pinned memory by a kernel; where
    that store fails the pipeline says so once and copies ``T`` instead. Both restore exactly."""
    from torch_pagecomp import cuda_stages

    if publish == "copy":
        def refuse(src, dst):
            raise ValueError("Pointer argument cannot be accessed from Triton (test)")
        monkeypatch.setattr(cuda_stages, "publish_total_eager", refuse)
    pc = PageCompressor(batch_pages=32)
    # every tensor through the ring (more than a batch), the first one random: a batch whose
    # kernel store failed once read a T never written (hidden while the first was all zeros)
    srcs = [torch.randint(0, 1 + 255 * ((i + 1) % 2), (random.randrange(32 * 4096 + 1, 600_000),),
                          dtype=torch.uint8, generator=gen).cuda() for i in range(6)]
    handles = [pc.offload(s) for s in srcs]
    for s, h in zip(srcs, handles):
        assert torch.equal(pc.restore(h), s)
    pc.synchronize()
    warned = [w for w in recwarn.list if "kernel stores to pinned memory" in str(w.message)]
    assert pc.pipeline._gpu.publish is (publish == "kernel")
    assert len(warned) == (publish == "copy")
