"""The slot ring: batches of pages through upload -> kernel -> download on CUDA streams.

On a GPU each slot owns seven timing events; the caller's thread enqueues a batch's upload
(``h2d`` stream) and kernels (``compute`` stream: compress, pack, and a one-value store of the
packed size ``T`` into the slot's pinned ``total``). An *issuer* thread waits for those kernels
(a sync of one event, off the caller's stream), carves an exact-size block from the host arena
and enqueues the download of exactly ``T`` packed bytes and the metadata (``d2h`` stream).
A *completer* thread waits for each batch's last event, records its timing and frees its slot.
Streams are ordered by events, so slot ``k``'s download, slot ``k+1``'s kernel and slot
``k+2``'s upload run at once. Buffers belong to a batch, not to its slot, and go back to their
pools only once the batch completed (host-side), so none is overwritten while still read. Once
an offload batch's download is queued, its ring position takes a spare slot (its own events
stay with the download): the next kernels need not wait for the link and the host's notice,
and at most ``slots`` batches download outside the ring. Every read of a source waits for the
producer's event; a restore's writes wait for the caller's stream and the caller's stream waits
for them.

Batches of a stream that does not compress skip the kernel (``cuda_stages.RawBypass``): the
caller's thread enqueues their download of the raw pages at once; small compressed probes
notice when the data compresses again. Raw batches have their own ring of slots, their own
download stream (``d2h_raw``, in chunks) and their own completer thread: they never hold a slot
that a kernel batch needs. With ``max_raw_share`` a share of a kernel-bound stream's batches
goes raw, so the kernel and the copy engine work at once.

Without a GPU the same ring runs the lz4 reference on the issuer thread (stage times from
``perf_counter``), with the same states, back-pressure and statistics.

Lifetime: the worker threads are daemons (a stuck one cannot hang the interpreter's exit), but
none may still be inside a torch call when the interpreter finalizes (the process then aborts).
So every live pipeline is in a weak registry and one ``atexit`` handler closes them all,
cancelling queued batches and joining the threads within ``EXIT_TIMEOUT_S``. Once a pipeline
stops (closed, broken by a worker's failure, or inherited by a forked child, where its threads
do not exist) every wait re-checks that and raises :class:`PipelineStopped` instead of waiting
for a thread that will never answer.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from enum import Enum

import torch

from . import cpu_codec
from ._events import handoff, mark
from ._ops import compress_cpu_direct, decompress_cpu_direct
from .cuda_stages import CudaStages, CudaStreams, RawBypass
from .pools import ALIGN, DeviceBufferPool, HostArena, InflightLimiter, PinnedBufferPool
from .storage import BlobLayout, Storage, StoredBatch, detached_error
from .timing import BatchTiming, TimingLog

EXIT_TIMEOUT_S = 10.0  # at interpreter exit, for all pipelines together


class PipelineStopped(RuntimeError):
    """The pipeline takes no more work: closed, broken by a worker's failure, or used in a
    process forked from the one that made it."""


class SlotState(str, Enum):
    FREE = "free"
    UPLOADING = "uploading"
    COMPRESSING = "compressing"  # the kernel stage (compress, or decompress for a restore)
    DOWNLOADING = "downloading"
    COMPLETE = "complete"


# k_c: compress + pack done (before the metadata copy, which may wait for the copy engine)
_STAGES = ("up_s", "up_e", "k_s", "k_c", "k_e", "d_s", "d_e")


class Slot:
    """One place in the ring. ``state`` is read from its events (GPU) or its stage (CPU)."""

    def __init__(self, index: int, cuda: bool):
        self.index = index
        self.active = False
        self.used = False
        self.detached = False  # left the ring with its batch's download (Pipeline._detach)
        self.previous: Slot | None = None  # the detached slot this one replaced in the ring
        self.job: _Job | None = None
        self.cpu_stage: SlotState = SlotState.FREE
        self.events = {k: torch.cuda.Event(enable_timing=True) for k in _STAGES} if cuda else {}
        self.recorded: set[str] = set()
        # an offload batch's packed size, stored here by a kernel (CudaStages.publish)
        self.total = torch.zeros(1, dtype=torch.int64, pin_memory=True) if cuda else None

    def record(self, name: str, stream) -> None:
        self.events[name].record(stream)
        self.recorded.add(name)

    @property
    def state(self) -> SlotState:
        if not self.active:
            prev = self.previous
            if prev is not None and prev.active:  # its last batch is still downloading
                return prev.state
            return SlotState.COMPLETE if self.used else SlotState.FREE
        if not self.events:
            return self.cpu_stage
        for end, st in (("up_e", SlotState.UPLOADING), ("k_e", SlotState.COMPRESSING)):
            if end not in self.recorded or not self.events[end].query():
                return st
        return SlotState.DOWNLOADING


@dataclass
class _Job:
    kind: str  # "offload" | "restore"
    slot: Slot
    storage: Storage
    index: int
    n_pages: int
    nbytes: int
    limit_bytes: int = 0
    buffers: tuple = ()  # (pool, buffer) pairs to give back on completion
    keep: tuple = ()  # tensors kept alive until the batch completed
    meta: tuple = ()  # (offsets, sizes, kinds) on the GPU until downloaded (GPU offload)
    packed: torch.Tensor | None = None
    first_page: int = 0
    stored: int = 0
    t: dict | None = None  # CPU stage times (perf_counter seconds)
    work: object = None  # CPU offload: (src, lo, hi, element_size) for the issuer
    reader_release: bool = False  # the last batch of a restore: ends the storage read
    raw: bool = False  # stored raw without the kernel (incompressible stream)
    key: object = None  # the RawBypass stream this batch belongs to
    payload_bytes: int = 0
    producer: object = None
    submitted: float = -1.0  # host ms (timing epoch) when the caller had queued it
    issued: float = -1.0  # ... when the issuer had queued its download


class Pipeline:
    """A ring of ``slots`` slots moving batches of ``batch_pages`` pages of ``page_size`` bytes.

    ``max_inflight_bytes`` bounds the uncompressed bytes of offload batches in flight (pinned
    landing space); producers wait for earlier batches (back-pressure). ``stream_priority``: the
    CUDA priority of the pipeline's streams (lower is higher; see ``PageCompressor``).

    On a GPU the device work of a batch (upload, kernels, download) is enqueued by ``_gpu``, a
    :class:`CudaStages` made here from this pipeline's streams, pools and arena; the pipeline
    keeps the ring, the threads and the bookkeeping, and calls it at each stage.
    """

    def __init__(
        self, device, page_size, batch_pages, slots=3, max_inflight_bytes=None, raw_bypass=True,
        max_raw_share=0.0, stream_priority=0,
    ):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.page_size = page_size
        if max_inflight_bytes is not None:
            batch_pages = max(1, min(batch_pages, max_inflight_bytes // page_size))
        self.batch_pages = batch_pages
        # arena chunks hold 8 of the largest blobs (an incompressible batch): at most ~1/8
        # of a chunk is left at its tail when blobs of other sizes do not fit
        largest = BlobLayout.of(batch_pages, batch_pages * page_size).total + ALIGN
        chunk = min(max(8 * largest, 4 << 20), 512 << 20)
        self.arena = HostArena(pin=self.cuda, chunk_bytes=chunk)
        self.staging = PinnedBufferPool(pin=self.cuda)
        self.device_pool = DeviceBufferPool(self.device)
        self.limiter = InflightLimiter(max_inflight_bytes)
        self.timing = TimingLog()
        self.bypass = RawBypass(self.cuda, bypass=raw_bypass, max_raw_share=max_raw_share)
        self.slots = [Slot(i, self.cuda) for i in range(slots)]
        # raw batches (GPU only): a ring of their own, so they never hold a kernel batch's slot
        self.raw_slots = [Slot(slots + i, self.cuda) for i in range(slots)] if self.cuda else []
        self._next = 0
        self._next_raw = 0
        self._detached = 0  # offload batches downloading outside the ring (see _detach)
        self._spare: list[Slot] = []  # slots (event sets) of completed detached batches
        self._cond = threading.Condition()
        self._gpu: CudaStages | None = None  # the device stages (GPU only)
        if self.cuda:
            with torch.cuda.device(self.device):
                streams = CudaStreams(
                    *(torch.cuda.Stream(priority=stream_priority) for _ in range(5))
                )
                # kept here too: a restore orders against ``compute``, and ``PageCompressor``
                # marks a source tensor as used on the streams that read it
                self.h2d, self.compute, self.d2h, self.d2h_raw, self.d2h_meta = streams
                self.epoch = torch.cuda.Event(enable_timing=True)
                self.epoch.record(self.compute)
                self.timing.epoch = time.perf_counter()  # the host clock's zero, roughly
            self._gpu = CudaStages(
                self.device, streams, self.page_size, self.batch_pages, self.arena,
                self.staging, self.device_pool, self.bypass,
            )
        self._issue_q: queue.Queue = queue.Queue()
        self._done_q: queue.Queue = queue.Queue()
        self._raw_done_q: queue.Queue = queue.Queue()  # raw batches, completed independently
        self.closed = False
        self.broken: BaseException | None = None  # a worker thread's failure (no traceback)
        self._cancel_reason: str | None = None  # close(cancel=True): queued batches fail
        self._stop_sent = False  # the workers' queues got their end marker: no more jobs
        self._forked_from: int | None = None  # the parent's pid, in a forked child
        self._threads = [
            self._thread("pagecomp-issuer", self._issuer),
            self._thread("pagecomp-completer", self._completer, self._done_q),
            self._thread("pagecomp-raw-completer", self._completer, self._raw_done_q),
        ]
        _LIVE.add(self)
        try:
            for th in self._threads:
                th.start()
        except BaseException:
            # a worker could not start (the process's thread limit): end those that did, else
            # the issuer waited on its queue for ever, keeping this half-made pipeline alive
            self._refuse_work(cancel=True)
            self._send_stop()
            _LIVE.discard(self)
            raise

    def _thread(self, name: str, loop, *args) -> threading.Thread:
        th = threading.Thread(target=self._worker, args=(loop, *args), daemon=True, name=name)
        _WORKERS.add(th)
        return th

    # ------------------------------------------------------------------ liveness
    def _stop_error(self, closed_ok: bool = False) -> PipelineStopped | None:
        """Why this pipeline cannot take the work asked for (``None``: it can). ``closed_ok``:
        the work needs no worker thread (a restore to the CPU of what is stored)."""
        if self._forked_from is not None:
            return PipelineStopped(
                f"this PageCompressor was created in process {self._forked_from} and cannot be "
                f"used after os.fork() in process {os.getpid()} (its worker threads exist only "
                "in the parent); create a new PageCompressor in the child"
            )
        if self.broken is not None:
            return PipelineStopped(
                f"this PageCompressor stopped: a worker thread failed "
                f"({type(self.broken).__name__}: {self.broken}); create a new one"
            )
        if self.closed and not closed_ok:
            return PipelineStopped("this PageCompressor was closed")
        return None

    def check_usable(self, closed_ok: bool = False) -> None:
        """Raise :class:`PipelineStopped` unless this pipeline can take work now."""
        err = self._stop_error(closed_ok)
        if err is not None:
            raise err

    def check_alive(self) -> None:
        """For a storage waiting on its batches: raise when no thread will ever finish them
        (broken, forked, or closed with its threads gone)."""
        self.check_usable(closed_ok=True)
        if self.closed and not any(th.is_alive() for th in self._threads):
            raise PipelineStopped("this PageCompressor was closed before the offload finished")

    def _wait(self, ready, closed_ok: bool = False) -> None:
        """With ``_cond`` held: wait until ``ready()``, raising as soon as the pipeline stops
        (every change of either is notified on ``_cond``)."""
        while True:
            self.check_usable(closed_ok)
            if ready():
                return
            self._cond.wait()

    def _enqueue(self, q: queue.Queue, item) -> None:
        """Hand ``item`` to a worker, unless the workers were told to end (it would never be
        taken: the end marker is ahead of it)."""
        with self._cond:
            if self._stop_sent:
                raise self._stop_error() or PipelineStopped("this PageCompressor was closed")
            q.put(item)

    # ------------------------------------------------------------------ slots
    def acquire_slot(self, raw: bool = False, closed_ok: bool = False) -> Slot:
        """Next slot of the ring (of the raw ring when ``raw``), waiting (host side) until its
        previous batch completed; raises :class:`PipelineStopped` once the pipeline stops
        (``closed_ok``: not merely because it was closed)."""
        with self._cond:
            if raw:
                slot = self.raw_slots[self._next_raw]
                self._wait(lambda: not slot.active, closed_ok)
                self._next_raw = (self._next_raw + 1) % len(self.raw_slots)
            else:
                i = self._next
                self._wait(lambda: not self.slots[i].active, closed_ok)  # may be a new object
                slot = self.slots[i]
                self._next = (i + 1) % len(self.slots)
            slot.active = slot.used = True
            slot.previous = None
            slot.recorded.clear()
            slot.cpu_stage = SlotState.UPLOADING
            return slot

    def _release_slot(self, slot: Slot) -> None:
        with self._cond:
            slot.job = None
            slot.active = False
            if slot.detached:  # its ring position moved on already: keep its events for reuse
                slot.detached = False
                slot.previous = None
                for ring in self.slots:
                    if ring.previous is slot:
                        ring.previous = None
                self._detached -= 1
                self._spare.append(slot)
            self._cond.notify_all()

    def _wait_download_room(self) -> None:
        """Issuer, before queueing a download: at most ``len(slots)`` batches downloading
        outside the ring (their device buffers are still held)."""
        with self._cond:
            self._wait(lambda: self._detached < len(self.slots), closed_ok=True)

    def _detach(self, job: _Job) -> None:
        """The issuer queued ``job``'s download: its ring position takes a spare slot, so the
        caller may queue the next batch's kernel while this one downloads; the job keeps its
        slot, whose events time the download, until it completes.

        Without this a ring of three holds every batch through kernel, download and the host's
        notice of both, and refills only after the oldest completed: the link idles once every
        three batches, for as long as the host takes to notice and queue the next kernel."""
        with self._cond:
            old = job.slot
            new = self._spare.pop() if self._spare else Slot(old.index, self.cuda)
            new.index, new.active, new.used, new.job = old.index, False, True, None
            new.previous = old
            new.recorded.clear()
            new.cpu_stage = SlotState.COMPLETE
            self.slots[old.index] = new
            old.detached = True
            self._detached += 1
            self._cond.notify_all()

    def states(self) -> list[SlotState]:
        return [s.state for s in self.slots]

    # ------------------------------------------------------------------ offload
    def submit_compress(
        self, storage, src, nbytes, element_size, producer=None, keep=(), key=None
    ):
        """Queue the compression of ``src`` (``uint8 [nbytes]``, on this device or the host)
        as batches appended to ``storage``; closes ``storage`` at the end (even on error).

        ``producer``: a CUDA event recorded on the caller's stream after ``src`` was produced;
        every read of ``src`` waits for it. ``key`` names the stream of similar tensors whose
        incompressible batches may skip the kernel (:class:`RawBypass`). Returns once every
        batch is queued (blocking only on back-pressure: slots or the in-flight bound).
        """
        on_host = src.device.type == "cpu"
        p, bp = self.page_size, self.batch_pages
        total_pages = -(-nbytes // p)
        p0, error = 0, None
        stopped = self._stop_error()
        if stopped is not None:
            storage.close(stopped)
            raise stopped
        gpu_src = self.cuda and not on_host
        try:
            while p0 < total_pages:
                n = min(bp, total_pages - p0)
                route = self.bypass.route(key) if gpu_src else "kernel"
                if route == "probe":  # a small compressed sample of a raw stream
                    n = min(n, max(1, bp // self.bypass.probe_fraction))
                # a kernel-bound stream: a share of its batches goes raw, so that the copy
                # engine works while the kernel does
                if gpu_src and route == "kernel" and self.bypass.split(key, n):
                    route = "raw"
                self._submit_batch(storage, src, nbytes, p0, n, route, element_size,
                                   producer, key, keep)
                p0 += n
        except BaseException as exc:
            error = exc
            raise
        finally:
            storage.close(error)

    def _submit_batch(self, storage, src, nbytes, p0, n, route, element_size, producer, key,
                      keep) -> None:
        """Queue pages ``[p0, p0 + n)`` of ``src`` as one stored batch: through the kernel
        (``route`` "kernel" or "probe") or downloaded as they are ("raw")."""
        p = self.page_size
        lo, hi = p0 * p, min(nbytes, (p0 + n) * p)
        self.limiter.acquire(n * p)
        try:
            slot = self.acquire_slot(raw=route == "raw")
        except BaseException:
            self.limiter.release(n * p)
            raise
        job = _Job("offload", slot, storage, storage.open_batch(), n, n * p,
                   limit_bytes=n * p, first_page=p0, key=key, keep=keep)
        slot.job = job
        try:
            if route == "raw":  # issued here, on its own stream and slot ring
                job.raw, job.producer = True, producer
                job.work = (src, lo, hi, element_size)
                self._gpu.issue_raw(job)
            elif self._gpu is not None:
                self._gpu.enqueue_compress(job, src, lo, hi, element_size, producer)
            else:
                job.work = (src, lo, hi, element_size)
            job.submitted = self.timing.host_ms(time.perf_counter())
            self._enqueue(self._raw_done_q if job.raw else self._issue_q, job)
        except BaseException as exc:
            self._fail(job, exc)
            raise

    def _cpu_compress(self, job: _Job) -> None:
        src, lo, hi, element_size = job.work
        job.t, lay = self._store_host_batch(job.storage, job.index, src, lo, hi, job.n_pages,
                                            job.first_page, element_size, job.slot)
        job.stored, job.payload_bytes = lay.total, lay.payload_bytes

    def _store_host_batch(self, storage: Storage, index: int, src: torch.Tensor, lo: int,
                          hi: int, n: int, first_page: int, element_size: int,
                          slot: Slot | None = None) -> tuple[dict, BlobLayout]:
        """Compress bytes ``lo .. hi`` of host ``src`` (``uint8``; ``n`` pages, the last one
        zero-padded) into a blob of this pipeline's arena, batch ``index`` of ``storage``, on
        the calling thread: ``(stage times, the blob's layout)``. The codec's host loops
        themselves (the arguments are the offload's, checked there); the pages packed by the
        C loop straight into the blob, at its exact size."""
        p = self.page_size
        t0 = time.perf_counter()
        pages = cpu_codec.page_rows(src[lo:hi], p)  # n rows
        if slot is not None:
            slot.cpu_stage = SlotState.COMPRESSING
        t1 = time.perf_counter()
        payload, sizes, kinds = compress_cpu_direct(pages, element_size, storage.float_format)
        offsets = cpu_codec.packed_offsets(sizes, p)
        lay = BlobLayout.of(n, int(offsets[n]))
        if slot is not None:
            slot.cpu_stage = SlotState.DOWNLOADING
        t2 = time.perf_counter()
        block = self.arena.alloc(lay.total)
        try:
            payload_v, off_v, size_v, kind_v = lay.views(block.tensor)
            cpu_codec.pack_into(payload, offsets, payload_v)
            off_v.numpy()[:] = offsets
            size_v.copy_(sizes)
            kind_v.copy_(kinds)
            storage.batch_stored(index, StoredBatch(block, lay, first_page))
        except BaseException:
            # not yet the storage's (which frees only the blocks it holds): given back here,
            # else a KeyboardInterrupt or error while packing kept the arena bytes for ever
            self.arena.free(block)
            raise
        return {"up": (t0, t1), "k": (t1, t2), "d": (t2, time.perf_counter())}, lay

    def compress_now(self, storage: Storage, src: torch.Tensor, nbytes: int,
                     element_size: int) -> None:
        """Compress host ``src`` (``uint8 [nbytes]``) into ``storage`` on the calling thread,
        batch by batch as the workers would, and close it: a CPU-only pipeline's small
        tensors, for which the hand-offs to and from the worker threads cost more than the
        codec's work (``bench/results/cpu2_77d03ac_inline``). Recorded in the timeline as batches
        of no slot (-1). Raises what a batch raised; the storage then holds that error."""
        if self.cuda or src.is_cuda:
            raise ValueError("compress_now is the CPU-only pipeline's, for host bytes")
        p, bp = self.page_size, self.batch_pages
        error, opened = None, False
        try:
            self.check_usable()
            for p0 in range(0, -(-nbytes // p), bp):
                lo, hi = p0 * p, min(nbytes, (p0 + bp) * p)
                n = -(-(hi - lo) // p)
                index, opened = storage.open_batch(), True
                t, lay = self._store_host_batch(storage, index, src, lo, hi, n, p0,
                                                element_size)
                opened = False
                storage.batch_finished()
                self.timing.add_cpu("offload", -1, n * p, lay.total, *t["up"], *t["k"], *t["d"])
        except BaseException as exc:
            error = exc
            raise
        finally:
            if opened:  # the batch that failed: finished, so that no waiter waits for it
                storage.batch_finished(error)
            storage.close(error)

    # ------------------------------------------------------------------ restore
    def submit_decompress(self, storage: Storage, out: torch.Tensor, consumer=None) -> list:
        """Queue the decompression of every batch of ``storage`` into ``out`` (``uint8 [nbytes]``
        on this GPU). ``consumer``: the caller's stream; the writes wait for what it queued before
        and it waits for them. Returns the per-batch status tensors (on the device).
        """
        self.check_usable(closed_ok=True)  # broken or forked
        if self.closed:
            raise PipelineStopped("this PageCompressor was closed (restore to the CPU still works)")
        p = self.page_size
        statuses = []
        storage.add_reader()
        with torch.cuda.device(self.device):
            start = mark(consumer)
            self.compute.wait_event(start)
            count, last = 0, len(storage.batches) - 1
            try:
                for b, sb in enumerate(storage.batches):
                    n = sb.layout.n_pages
                    slot = self.acquire_slot()
                    job = _Job("restore", slot, storage, b, n, n * p)
                    slot.job = job
                    try:
                        self._gpu.enqueue_decompress(job, sb, out, statuses, start)
                    except BaseException as exc:
                        self._fail(job, exc)
                        raise
                    job.reader_release = b == last  # the last batch ends the read
                    job.submitted = self.timing.host_ms(time.perf_counter())
                    try:
                        self._enqueue(self._done_q, job)
                    except BaseException as exc:
                        job.reader_release = False  # the read ends below, once
                        self._fail(job, exc)
                        raise
                    count += 1
            finally:
                handoff(self.compute, consumer)
                for status in statuses:  # read later on the caller's stream
                    status.record_stream(consumer)
                if count == 0:
                    storage.reader_done()
                elif count <= last:  # failed part-way: release after the queued batches
                    self._end_read_after_queued(storage)
        return statuses

    def _end_read_after_queued(self, storage: Storage) -> None:
        """A restore failed part-way: end its read once the batches it queued completed (by
        the completer, in order; or here, after the device finished them, if the workers were
        told to end)."""
        try:
            self._enqueue(self._done_q, ("reader_done", storage))
        except PipelineStopped:
            torch.cuda.synchronize(self.device)
            storage.reader_done()

    def cpu_decompress(self, storage: Storage, out: torch.Tensor) -> list:
        """Decompress every batch into the CPU ``uint8 [nbytes]`` tensor ``out`` now (also
        after :meth:`close`: it needs no worker thread)."""
        self.check_usable(closed_ok=True)
        p = self.page_size
        statuses = []
        storage.add_reader()
        try:
            for sb in storage.batches:
                lay, n = sb.layout, sb.layout.n_pages
                slot = self.acquire_slot(closed_ok=True) if not self.cuda else None
                # the slot goes back however the decode ends: a KeyboardInterrupt or a
                # MemoryError left it active, and the ring's next offload, ``drain`` and
                # ``close`` waited for it for ever
                try:
                    t0 = time.perf_counter()
                    if slot is not None:
                        slot.cpu_stage = SlotState.COMPRESSING
                    payload, offsets, sizes, kinds = lay.views(sb.block.tensor)
                    lo = sb.first_page * p
                    hi = min(out.numel(), lo + n * p)
                    exp = storage.float_format is not None
                    if hi - lo == n * p:  # whole pages: decoded where they go
                        _, status = decompress_cpu_direct(payload, offsets[:-1], sizes, kinds,
                                                          p, exp, out=out[lo:hi].view(n, p))
                    else:  # the tensor's last bytes end inside the batch's last page
                        pages, status = decompress_cpu_direct(payload, offsets[:-1], sizes,
                                                              kinds, p, exp)
                        out[lo:hi].copy_(pages.view(-1)[: hi - lo])
                    statuses.append(status)
                    if slot is not None:
                        t1 = time.perf_counter()
                        self.timing.add_cpu("restore", slot.index, n * p, lay.total,
                                            t0, t0, t0, t1)
                finally:
                    if slot is not None:
                        self._release_slot(slot)
        finally:
            storage.reader_done()
        return statuses

    # ------------------------------------------------------------------ workers
    def _bind_device(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)

    def _worker(self, loop, *args) -> None:
        """A worker thread's body: if its loop ever fails, the pipeline is broken."""
        try:
            self._bind_device()
            loop(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            self._break(exc)

    def _issuer(self) -> None:
        """Issue each job (a call per job: while the thread waits for the next one, nothing of
        the last one stays referenced, so a freed handle's storage can go)."""
        while self._issue_one(self._issue_q.get()):
            pass
        self._done_q.put(None)  # after every job it passed on

    def _issue_one(self, job: _Job | None) -> bool:
        if job is None:
            return False
        try:
            if self._cancel_reason is not None:
                raise PipelineStopped(self._cancel_reason)
            if job.raw:
                self._gpu.issue_raw(job)
            elif self._gpu is not None:
                self._wait_download_room()
                self._gpu.issue_download(job)
                self._detach(job)
            else:
                self._cpu_compress(job)
            job.issued = self.timing.host_ms(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported through the handle
            self._fail(job, exc)
            return True
        self._done_q.put(job)
        return True

    def _completer(self, done_q: queue.Queue) -> None:
        while self._complete_one(done_q.get()):
            pass

    def _complete_one(self, job) -> bool:
        if job is None:
            return False
        if isinstance(job, tuple):  # ("reader_done", storage): a failed restore ended
            job[1].reader_done()
            return True
        try:
            self._complete(job)
        except BaseException as exc:  # noqa: BLE001
            self._fail(job, exc)
        return True

    def _complete(self, job: _Job) -> None:
        slot = job.slot
        if self.cuda:
            last = "d_e" if job.kind == "offload" else "k_e"
            slot.events[last].synchronize()
            noticed = self.timing.host_ms(time.perf_counter())
            ev = slot.events
            stamp = {k: self.epoch.elapsed_time(ev[k]) for k in slot.recorded}
            d = (stamp.get("d_s", stamp["k_e"]), stamp.get("d_e", stamp["k_e"]))
            # an offload's kernel stage is compress + pack (to k_c); k_e after it marks T on
            # the host (a kernel store, or a copy that may wait for the copy engine)
            k = (stamp["k_s"], stamp.get("k_c", stamp["k_e"]))
            t = BatchTiming(
                job.kind, slot.index, job.nbytes, job.stored,
                (stamp["up_s"], stamp["up_e"]), k, d, job.submitted, job.issued, noticed,
            )
            self.timing.add(t)
            if job.kind == "offload" and job.raw:
                self.bypass.observe_raw(job.key, job.nbytes, t.download_ms)
            elif job.kind == "offload":
                self.bypass.observe(
                    job.key, job.payload_bytes, job.nbytes, t.kernel_ms, t.download_ms
                )
        elif job.t is not None:
            t = job.t
            stages = (*t["up"], *t["k"], *t["d"])
            self.timing.add_cpu(job.kind, slot.index, job.nbytes, job.stored, *stages,
                                submitted=job.submitted)
        self._finish(job)

    def _finish(self, job: _Job, error: BaseException | None = None) -> None:
        """Give back the job's buffers and budget, tell its storage, then free its slot (last,
        so that ``drain`` returning means the storage knows)."""
        for pool, buf in job.buffers:
            pool.release(buf)
        job.buffers = job.keep = ()
        job.packed = job.work = job.producer = None
        job.meta = ()
        if job.limit_bytes:
            self.limiter.release(job.limit_bytes)
            job.limit_bytes = 0
        if job.kind == "offload":
            job.storage.batch_finished(error)
        elif job.reader_release:
            job.reader_release = False
            job.storage.reader_done()
        self._release_slot(job.slot)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        if self.cuda:  # buffers may still be in use by queued GPU work
            torch.cuda.synchronize(self.device)
        self._finish(job, exc)

    def _break(self, exc: BaseException) -> None:
        """A worker thread died: wake every waiter with the failure and let the other workers
        end (the batches they hold can never complete)."""
        with self._cond:
            if self.broken is None:
                self.broken = detached_error(exc)
            self._stop_sent = True
            self._cond.notify_all()
        self.limiter.stop(self._stop_error())
        for q in (self._issue_q, self._done_q, self._raw_done_q):
            q.put(None)

    def close(self, wait: bool = True, cancel: bool = False, timeout: float | None = None,
              final: bool = False) -> bool:
        """Stop taking work and stop the worker threads. Returns whether they stopped.

        At once, producers waiting for a slot or for in-flight budget raise
        :class:`PipelineStopped`, and so does every later offload. Then, with ``wait``, the
        batches already queued complete (``cancel``: those not started yet fail instead), the
        workers are told to end and are joined, and idle pooled memory is released; ``timeout``
        bounds all of it (seconds). ``final`` (interpreter exit) also unregisters the pinned
        arena while CUDA is still up. Without ``wait`` (a finalizer, which may run on a worker
        thread) the end is only queued behind the work. Idempotent; stored handles stay
        readable on the CPU. In a forked child it only marks the pipeline closed: the threads
        are the parent's."""
        if self._forked_from is not None:
            self.closed = True
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._refuse_work(cancel)
        if not wait or threading.current_thread() in self._threads:
            self._send_stop()
            return False
        try:
            drained = self.drain(_left(deadline))
        except PipelineStopped:  # broken: what is queued will not complete
            drained = False
        self._send_stop()
        for th in self._threads:
            th.join(_left(deadline))
        stopped = not any(th.is_alive() for th in self._threads)
        if stopped:
            self._release_idle(final)
        return drained and stopped

    def _refuse_work(self, cancel: bool) -> None:
        with self._cond:
            self.closed = True
            if cancel and self._cancel_reason is None:
                self._cancel_reason = "this PageCompressor was closed before this batch ran"
            self._cond.notify_all()
        self.limiter.stop(self._stop_error())

    def _send_stop(self) -> None:
        """Queue the workers' end marker (once), behind every job queued so far."""
        with self._cond:
            if self._stop_sent:
                return
            self._stop_sent = True
            self._issue_q.put(None)  # the issuer passes it on to the completer
            self._raw_done_q.put(None)

    def _release_idle(self, final: bool) -> None:
        """Threads joined: fail what a broken pipeline left queued, give back idle pools."""
        error = self._stop_error(closed_ok=True) or PipelineStopped("closed with work queued")
        for q in (self._issue_q, self._done_q, self._raw_done_q):
            while True:
                # taken, not looked at first: two closes at once (two threads, or one and the
                # exit handler) both saw the last item, and the second's get raised Empty
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Job):
                    self._finish(item, error)
                elif isinstance(item, tuple):  # ("reader_done", storage)
                    item[1].reader_done()
        # blocks that handles still hold go back later: their chunks are then released at once
        # rather than kept for work a closed pipeline will never take
        self.arena.keep_free_chunks = 0
        self.arena.trim()
        self.staging.clear()
        self.device_pool.clear()
        if final and self.cuda:
            self.arena.unpin()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued batch completed (``False``: ``timeout`` seconds passed
        first). Raises :class:`PipelineStopped` if the pipeline is broken or forked: its
        batches would never complete."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.check_usable(closed_ok=True)  # before the lock: a fork may have left it held
        with self._cond:
            while self._detached or any(s.active for s in (*self.slots, *self.raw_slots)):
                self.check_usable(closed_ok=True)
                left = _left(deadline)
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _after_fork_in_child(self, parent: int) -> None:
        """This process is a fork: the threads stayed in the parent, and one of them may have
        held these conditions. Fresh ones, and every use raises."""
        if self._forked_from is None:  # (a grandchild keeps the first owner's pid)
            self._forked_from = parent
        self._cond = threading.Condition()
        self.limiter.reset_lock_after_fork()


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``None``: no deadline), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


_LIVE: weakref.WeakSet[Pipeline] = weakref.WeakSet()  # every pipeline not yet collected
_WORKERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # their threads, until collected


def _close_all_at_exit() -> None:
    """Close every live pipeline before the interpreter finalizes: queued batches are
    cancelled, running ones finish, threads are joined (``EXIT_TIMEOUT_S`` in all). Then join
    every worker thread still running, those of pipelines already collected too: the thread
    that drops a pipeline's last reference (its loop ended after the compressor was
    collected) frees the pipeline's tensors as it ends, and a daemon thread still in a torch
    call when the interpreter finalizes aborts the process ("terminate called without an
    active exception": 4-6 in 60 pytest runs of the README's quickstart before this)."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for p in list(_LIVE):
        try:
            p.close(cancel=True, timeout=_left(deadline), final=True)
        except Exception:  # noqa: BLE001 - nothing to report to at exit; keep closing
            pass
    for th in list(_WORKERS):
        if th.ident is not None and th is not threading.current_thread():
            th.join(_left(deadline))


def _mark_forked_in_child() -> None:
    parent = os.getppid()
    for p in list(_LIVE):
        p._after_fork_in_child(parent)


atexit.register(_close_all_at_exit)
os.register_at_fork(after_in_child=_mark_forked_in_child)
