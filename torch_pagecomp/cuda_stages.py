"""The GPU stages of the pipeline, enqueued on its three streams (a mixin of ``Pipeline``).

Every device operation here runs inside an explicit ``torch.cuda.stream`` context of one of the
pipeline's streams (``h2d``, ``compute``, ``d2h``), never on whatever stream the calling
thread has current; cross-stream order comes from the slot's events and the caller's events.
"""

from __future__ import annotations

import threading

import torch

from .storage import BlobLayout, StoredBatch, meta_capacity


class RawBypass:
    """Skip the kernel for streams that do not compress.

    Per ``key`` (a stream of similar tensors, e.g. one dtype): after ``streak`` compressed
    batches in a row saved less than 1/32 of their bytes, batches are stored RAW straight from
    the source (a plain pinned copy), except every ``probe``-th, which is compressed to notice
    when the data becomes compressible again (any saving resets the streak).
    """

    def __init__(self, enabled: bool, streak: int = 3, probe: int = 16):
        self.enabled, self.streak, self.probe = enabled, streak, probe
        self._state: dict = {}
        self._lock = threading.Lock()
        self.raw_batches = 0

    def take(self, key) -> bool:
        """Whether the next batch of ``key`` skips the kernel."""
        if not self.enabled or key is None:
            return False
        with self._lock:
            st = self._state.setdefault(key, [0, 0])
            st[1] += 1
            raw = st[0] >= self.streak and st[1] % self.probe != 0
            self.raw_batches += raw
            return raw

    def observe(self, key, payload_bytes: int, nbytes: int) -> None:
        """A compressed batch of ``key`` completed with ``payload_bytes`` of ``nbytes``."""
        if key is None:
            return
        with self._lock:
            st = self._state.setdefault(key, [0, 0])
            st[0] = st[0] + 1 if payload_bytes * 32 >= nbytes * 31 else 0


class CudaStages:
    """Upload, kernel and download of one batch on a GPU (see ``pipeline.Pipeline``)."""

    def _enqueue_compress(self, job, src, lo, hi, element_size, producer) -> None:
        """Caller's thread: upload (host source or a partial last batch) and kernels, all on
        the pipeline's own streams (never the caller's current stream)."""
        p, n, slot = self.page_size, job.n_pages, job.slot
        full = hi - lo == n * p
        on_host = src.device.type == "cpu"
        meta = self.staging.acquire(meta_capacity(self.batch_pages))
        job.buffers = ((self.staging, meta),)
        job.meta = meta.tensor
        dev = None
        if on_host or not full:
            dev = self._device_buffer()
            job.buffers += ((self.device_pool, dev),)
        if on_host:
            host = src[lo:hi]
            if not (full and src.is_pinned()):
                if producer is not None:  # the host reads src: its producer must be done
                    producer.synchronize()
                stage = self.staging.acquire(self.batch_pages * p)
                job.buffers += ((self.staging, stage),)
                stage.tensor[: hi - lo].copy_(host)
                stage.tensor[hi - lo : n * p].zero_()
                host = stage.tensor[: n * p]
            with torch.cuda.stream(self.h2d):
                if producer is not None:
                    self.h2d.wait_event(producer)
                slot.record("up_s", self.h2d)
                dev[: n * p].copy_(host, non_blocking=True)
                slot.record("up_e", self.h2d)
            self.compute.wait_event(slot.events["up_e"])
        with torch.cuda.stream(self.compute):
            if not on_host:
                if producer is not None:
                    self.compute.wait_event(producer)
                slot.record("up_s", self.compute)
                if not full:
                    dev[hi - lo : n * p].zero_()
                    dev[: hi - lo].copy_(src[lo:hi])
                slot.record("up_e", self.compute)
            pages = src[lo:hi].view(n, p) if dev is None else dev[: n * p].view(n, p)
            slot.record("k_s", self.compute)
            payload, sizes, kinds = torch.ops.pagecomp.compress(pages, element_size)
            packed, offsets = torch.ops.pagecomp.pack(payload, sizes)
            lay = BlobLayout.of(n, 0)
            m = job.meta
            m[: lay.sizes_at].view(torch.int64).copy_(offsets, non_blocking=True)
            m[lay.sizes_at : lay.kinds_at].view(torch.int32).copy_(sizes, non_blocking=True)
            m[lay.kinds_at : lay.kinds_at + n].copy_(kinds, non_blocking=True)
            slot.record("k_e", self.compute)
        packed.record_stream(self.d2h)
        job.packed = packed

    def _device_buffer(self) -> torch.Tensor:
        """A pooled device buffer, allocated on the compute stream (our streams alone use it)."""
        with torch.cuda.stream(self.compute):
            return self.device_pool.acquire(self.dev_bytes)

    def _issue_download(self, job) -> None:
        slot, n = job.slot, job.n_pages
        slot.events["k_e"].synchronize()
        meta = job.meta
        offsets = meta[: 8 * (n + 1)].view(torch.int64)
        lay = BlobLayout.of(n, int(offsets[n]))
        block = self.arena.alloc(lay.total)
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
            self.d2h.wait_event(slot.events["k_e"])
            slot.record("d_s", self.d2h)
            if lay.payload_bytes:
                block.tensor[: lay.payload_bytes].copy_(
                    job.packed[: lay.payload_bytes], non_blocking=True
                )
            slot.record("d_e", self.d2h)
        block.tensor[lay.offsets_at :].copy_(meta[: lay.meta_bytes])
        job.stored, job.payload_bytes = lay.total, lay.payload_bytes
        job.storage.batch_stored(job.index, StoredBatch(block, lay, job.first_page))

    def _issue_raw(self, job) -> None:
        """An incompressible stream's batch: download the pages as they are (RAW pages, the
        metadata written on the host), no kernel. Ordered after the producer."""
        src, lo, hi, _ = job.work
        slot, n, p = job.slot, job.n_pages, self.page_size
        lay = BlobLayout.of(n, n * p)
        block = self.arena.alloc(lay.total)
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
            if job.producer is not None:
                self.d2h.wait_event(job.producer)
            for name in ("up_s", "up_e", "k_s", "k_e", "d_s"):
                slot.record(name, self.d2h)
            block.tensor[: hi - lo].copy_(src[lo:hi], non_blocking=True)
            slot.record("d_e", self.d2h)
        _, offsets, sizes, kinds = lay.views(block.tensor)
        block.tensor[hi - lo : n * p].zero_()
        torch.arange(0, (n + 1) * p, p, out=offsets)
        sizes.fill_(p)
        kinds.zero_()
        job.stored, job.payload_bytes = lay.total, lay.payload_bytes
        job.storage.batch_stored(job.index, StoredBatch(block, lay, job.first_page))

    def _enqueue_decompress(self, job, sb, out, statuses, start) -> None:
        p, slot, lay, n = self.page_size, job.slot, sb.layout, sb.layout.n_pages
        lo = sb.first_page * p
        hi = min(out.numel(), lo + n * p)
        if lay.payload_bytes == n * p:  # every page RAW: upload straight into `out`
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(start)  # `out` may still be in use on the caller's stream
                slot.record("up_s", self.h2d)
                out[lo:hi].copy_(sb.block.tensor[: hi - lo], non_blocking=True)
                slot.record("up_e", self.h2d)
            self.compute.wait_event(slot.events["up_e"])
            slot.record("k_s", self.compute)
            slot.record("k_e", self.compute)
            return
        dev = self._device_buffer()
        job.buffers = ((self.device_pool, dev),)
        slot.record("up_s", self.h2d)
        with torch.cuda.stream(self.h2d):
            dev[: lay.total].copy_(sb.block.tensor, non_blocking=True)
        slot.record("up_e", self.h2d)
        self.compute.wait_event(slot.events["up_e"])
        with torch.cuda.stream(self.compute):
            slot.record("k_s", self.compute)
            payload, offsets, sizes, kinds = lay.views(dev)
            pages, status = torch.ops.pagecomp.decompress(payload, offsets[:-1], sizes, kinds, p)
            out[lo:hi].copy_(pages.view(-1)[: hi - lo])
            slot.record("k_e", self.compute)
        statuses.append(status)
