"""Review 89 of the slot ring and the host pools (CPU): what a refused producer leaves held,
two closes of a broken pipeline at once, an arena block carved by a GPU stage that is
interrupted before its storage lists it, and the pinned bytes the pools report when the driver
refuses to register their memory."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

import pytest
import torch

from torch_pagecomp import module
from torch_pagecomp.cuda_stages import CudaStages, RawBypass
from torch_pagecomp.module import PageCompressor
from torch_pagecomp.pipeline import _STAGES, PipelineStopped, Slot, _Job
from torch_pagecomp.pools import DeviceBufferPool, HostArena, InflightLimiter, PinnedBufferPool
from torch_pagecomp.storage import Storage

P = 4096


@pytest.fixture(autouse=True)
def _through_the_workers(monkeypatch):
    monkeypatch.setattr(module, "INLINE_HOST_BYTES", 0)


# ------------------------------------------------------------------ the limiter's stored error
def test_a_refused_acquire_keeps_nothing_of_its_caller():
    """``stop``'s error is raised to every later ``acquire``: raised as the one stored object,
    it kept the traceback of each refusal, and with it every frame's locals (the caller's
    tensor) for as long as the limiter lived."""
    lim = InflightLimiter(10)
    lim.stop(PipelineStopped("closed"))

    def producer(t):
        with pytest.raises(PipelineStopped, match="closed"):
            lim.acquire(1)

    t = torch.ones(1000)
    ref = weakref.ref(t)
    producer(t)
    producer(t)  # (and the second refusal's frames on top)
    del t
    gc.collect()
    assert ref() is None, "a refused caller's tensor is kept by the limiter's stored error"


def test_an_offload_refused_at_close_frees_its_tensor():
    """An offload waiting on back-pressure when the compressor closes raises
    PipelineStopped; its tensor must then go with the caller's references, not stay held by
    the closed compressor (it lives on while handles or the module do)."""
    pc = PageCompressor(device="cpu", batch_pages=1, slots=3, max_pinned_bytes=P)
    p = pc.pipeline
    gate, real = threading.Event(), p._cpu_compress

    def slow(job):
        gate.wait(10)
        real(job)

    p._cpu_compress = slow
    out = {}

    def producer():
        x = torch.randint(0, 4, (8 * P,), dtype=torch.uint8)
        out["ref"] = weakref.ref(x)
        try:
            pc.offload(x)
        except PipelineStopped as exc:
            out["err"] = str(exc)

    th = threading.Thread(target=producer)
    th.start()
    deadline = time.monotonic() + 10
    while p.limiter.waits == 0 and time.monotonic() < deadline:  # waits for the budget
        time.sleep(0.01)
    closer = threading.Thread(target=lambda: out.setdefault("closed", pc.close(timeout=10)))
    closer.start()
    th.join(10)
    gate.set()
    closer.join(10)
    assert out.get("err") == "this PageCompressor was closed" and out.get("closed") is True
    gc.collect()
    assert out["ref"]() is None, "the refused offload's tensor is kept by the closed compressor"


# ------------------------------------------------------------------ close, twice at once
def test_two_closes_of_a_broken_pipeline_at_once_both_return(monkeypatch):
    """A broken pipeline leaves its workers' end markers queued; ``close`` empties the
    queues. Two closes at once (two threads, or one and the exit handler) both saw an item
    and both took one: the second got ``queue.Empty`` out of ``close``."""
    pc = PageCompressor(device="cpu", batch_pages=1, slots=2)
    p = pc.pipeline

    def fail(job):
        raise RuntimeError("issuer down")

    monkeypatch.setattr(p, "_issue_one", fail)
    pc.offload(torch.zeros(P, dtype=torch.uint8)).wait()  # (the issuer's waiting call: the real)
    h = pc.offload(torch.zeros(P, dtype=torch.uint8))
    with pytest.raises(PipelineStopped, match="issuer down"):
        h.wait()
    for th in p._threads:
        th.join(10)
    q = p._issue_q
    assert q.qsize() == 1  # the end marker of the break, the issuer gone before it
    both = threading.Barrier(2)
    real_get = q.get_nowait

    def get_nowait():  # both closers take their item at once
        with contextlib.suppress(threading.BrokenBarrierError):
            both.wait(2)
        return real_get()

    monkeypatch.setattr(q, "get_nowait", get_nowait)
    results, errors = [], []

    def close():
        try:
            results.append(p.close(timeout=10))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    closers = [threading.Thread(target=close) for _ in range(2)]
    for th in closers:
        th.start()
    for th in closers:
        th.join(20)
    assert errors == [] and results == [False, False]  # (not drained: broken)
    assert q.qsize() == 0
    h.free()


# ------------------------------------------------------------------ GPU stages, interrupted
class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    """A stream whose next ``wait_event`` is interrupted (a Ctrl-C in the stage)."""

    def __init__(self):
        self.interrupt = False

    def wait_event(self, event):
        if self.interrupt:
            raise KeyboardInterrupt


@pytest.fixture
def stages(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    arena = HostArena(pin=False, chunk_bytes=1 << 20)
    streams = [_Stream() for _ in range(5)]
    gpu = CudaStages(torch.device("cpu"), streams, P, 4, arena, PinnedBufferPool(False),
                     DeviceBufferPool(torch.device("cpu")), RawBypass(False))
    return gpu, arena


def _job(arena, n):
    storage = Storage(arena)
    slot = Slot(0, cuda=False)
    slot.events = {k: _Event() for k in _STAGES}
    job = _Job("offload", slot, storage, storage.open_batch(), n, n * P)
    return job, storage


@pytest.mark.parametrize("stage", ["issue_raw", "issue_download"])
def test_a_stage_interrupted_after_carving_its_block_gives_it_back(stages, stage):
    """``issue_raw`` (on the caller's thread) and ``issue_download`` carve the batch's block,
    queue its copies, and only then listed it in the storage: interrupted in between (a
    KeyboardInterrupt, a failing copy), the block was nobody's and never went back. Listed at
    once, it goes back with the storage, after the pipeline's failure path (``_fail``) waited
    for the copies already queued into it."""
    gpu, arena = stages
    n = 3
    job, storage = _job(arena, n)
    src = torch.randint(0, 256, (n * P - 5,), dtype=torch.uint8)
    if stage == "issue_raw":
        job.work, job.producer = (src, 0, src.numel(), 1), _Event()
        gpu.d2h_raw.interrupt = True
    else:
        job.slot.total = torch.tensor([src.numel()])
        job.packed = src
        job.meta = (torch.zeros(n + 1, dtype=torch.int64), torch.zeros(n, dtype=torch.int32),
                    torch.zeros(n, dtype=torch.uint8))
        gpu.d2h.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        getattr(gpu, stage)(job)
    assert arena.used_bytes > 0  # not back before the batch finished: copies may be queued
    storage.batch_finished(KeyboardInterrupt())  # what Pipeline._fail does, once synchronized
    storage.close()
    storage.release()  # the handle's free
    assert arena.used_bytes == 0 and arena.frees == arena.allocs == 1


# ------------------------------------------------------------------ pinned bytes reported
class _RefusingDriver:
    """``cudaHostRegister`` refused (not supported here, say): the memory stays pageable."""

    def cudaHostRegister(self, ptr, size, flags):
        return 801

    def cudaHostUnregister(self, ptr):
        raise AssertionError("nothing was registered")


def test_pools_report_no_pinned_bytes_when_registration_fails(monkeypatch):
    """A pool asked to pin whose memory the driver refused to register warns "using pageable
    host memory", and reported every byte it held as pinned anyway (``stats()``'s
    ``pinned_bytes``, summed into ``PageCompressor.stats()["pinned_bytes_held"]``)."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _RefusingDriver())
    arena, staging = HostArena(pin=True, chunk_bytes=1 << 20), PinnedBufferPool(pin=True)
    with pytest.warns(UserWarning, match="pageable"):
        block = arena.alloc(1000)
    with pytest.warns(UserWarning, match="pageable"):
        buf = staging.acquire(5000)
    assert not block.chunk.mem.pinned and not buf.pinned
    assert arena.stats()["held_bytes"] == 1 << 20 and arena.stats()["pinned_bytes"] == 0
    assert staging.stats()["held_bytes"] == 8192 and staging.stats()["pinned_bytes"] == 0
    staging.release(buf)
    staging.clear()
    arena.free(block)
    assert arena.trim() == 1 << 20 and staging.stats()["pinned_bytes"] == 0
