"""The GPU stages of the pipeline, enqueued on its five streams (``CudaStages``, owned by
``Pipeline``).

``Pipeline`` runs the ring (slots, threads, back-pressure, completion); ``CudaStages`` enqueues
one batch's device work and is handed, when made, exactly what that needs: the streams, the
pools and arena, the page geometry and the bypass policy. It keeps no ring state, so the ring
can change without reaching into this module and the other way round.

Every device operation here runs inside an explicit ``torch.cuda.stream`` context of one of the
pipeline's streams (``h2d``, ``compute``, ``d2h``, ``d2h_raw``, ``d2h_meta``), never on whatever
stream the calling thread has current; cross-stream order comes from the slot's events and the
caller's events.

Device-to-host copies share one copy engine, which serves them in the order they were queued:
a batch's small metadata copy waits for every larger download queued before it (a raw batch's
whole chunked download, say). So nothing the issuer waits for goes through it: a batch's packed
size ``T`` reaches pinned host memory by a one-program kernel store on the compute stream
(``publish_to_host``), and the issuer queues the download of batch ``k`` (payload and metadata,
four copies on ``d2h``) while batch ``k - 1``'s is still on the link. With ``T`` sent by a copy
instead (``d2h_meta``), the issuer learns it only after the previous download ended, and the
link idles between batches while the host reacts.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, NamedTuple

import torch

from ._ops import compress_codec_eager, decompress_into_eager, pack_eager, publish_total_eager
from .pools import DeviceBufferPool, HostArena, PinnedBufferPool
from .storage import BlobLayout, StoredBatch, meta_capacity

if TYPE_CHECKING:  # pipeline imports this module: the ring's types are for annotations only
    from .pipeline import _Job

RAW_CHUNK = 4 << 20  # bytes per copy of a raw batch's download (see CudaStages.issue_raw)


class RawBypass:
    """Which batches skip the kernel and go to the host raw (a plain pinned copy).

    * Incompressible streams (``bypass``): per ``key`` (a stream of similar tensors, e.g. one
      dtype and element size), after ``streak`` compressed batches in a row saved less than
      1/32 of their bytes, batches are stored RAW. Every ``probe``-th batch is instead a small
      compressed sample (``1/probe_fraction`` of a batch) that notices when the data compresses
      again (any saving resets the streak).
    * Kernel-bound streams (``max_raw_share > 0``): when the kernel (``K`` bytes/ms) is slower
      than the copy engine moving its output (link ``B``, ratio ``r``), a share
      ``f = a / (a + 1/B)``, ``a = 1/K - 1/(rB)``, of the batches (at most ``max_raw_share``;
      :meth:`split`) goes raw so that both engines stay busy: faster, at the cost of ratio.
      Whole batches, not a split of each batch: two parts per batch double the caller's host
      work per byte (each part is a full enqueue), which makes a large offload of mixed data
      bound by the host rather than by the kernel or the link.
    """

    def __init__(self, enabled: bool, bypass: bool = True, max_raw_share: float = 0.0,
                 streak: int = 3, probe: int = 8, probe_fraction: int = 16):
        self.enabled = enabled and (bypass or max_raw_share > 0)
        self.streak = streak if bypass else float("inf")
        self.probe, self.probe_fraction = probe, probe_fraction
        self.max_raw_share = max(0.0, min(1.0, max_raw_share))
        self._state: dict = {}  # key -> [streak, batches in raw mode, split accumulator]
        self._rates: dict = {}  # key -> {"kernel", "link", "ratio"}: EMAs, bytes per ms
        self._lock = threading.Lock()
        self.raw_batches = 0
        self.split_batches = 0

    def route(self, key) -> str:
        """``"kernel"``, ``"raw"`` or ``"probe"`` (a small kernel batch) for ``key``'s next."""
        if not self.enabled or key is None:
            return "kernel"
        with self._lock:
            st = self._state.setdefault(key, [0, 0, 0.0])
            if st[0] >= self.streak:
                st[1] += 1
                if st[1] % self.probe == 0:
                    return "probe"
                self.raw_batches += 1
                return "raw"
            return "kernel"

    def split(self, key, n: int) -> int:
        """How many of a kernel batch's ``n`` pages of ``key`` go raw: all of them for the
        balancing share of the batches (the fraction carried to the next), else none."""
        if not self.enabled or key is None or n <= 0:
            return 0
        share = self.share(key)
        if share <= 0:
            return 0
        with self._lock:
            st = self._state.setdefault(key, [0, 0, 0.0])
            st[2] += share
            if st[2] < 1.0:
                return 0
            st[2] -= 1.0
            self.raw_batches += 1
            self.split_batches += 1
            return n

    def share(self, key) -> float:
        """The raw share that balances kernel and copy engine for ``key`` (0 until measured)."""
        r = self._rates.get(key, {})
        if self.max_raw_share <= 0 or len(r) < 3:
            return 0.0
        a = 1.0 / r["kernel"] - 1.0 / (r["ratio"] * r["link"])
        return 0.0 if a <= 0 else min(self.max_raw_share, a / (a + 1.0 / r["link"]))

    def _ema(self, key, name: str, value: float) -> None:
        r = self._rates.setdefault(key, {})
        r[name] = value if name not in r else 0.7 * r[name] + 0.3 * value

    def observe(self, key, payload_bytes: int, nbytes: int, kernel_ms: float = 0.0,
                download_ms: float = 0.0) -> None:
        """A compressed batch of ``key`` completed: ``payload_bytes`` stored of ``nbytes``."""
        if key is None:
            return
        with self._lock:
            st = self._state.setdefault(key, [0, 0, 0.0])
            st[0] = st[0] + 1 if payload_bytes * 32 >= nbytes * 31 else 0
            if kernel_ms > 0:
                self._ema(key, "kernel", nbytes / kernel_ms)
                self._ema(key, "ratio", nbytes / max(1, payload_bytes))
            if download_ms > 0 and payload_bytes >= 1 << 20:  # small copies: latency, not rate
                self._ema(key, "link", payload_bytes / download_ms)

    def observe_raw(self, key, nbytes: int, download_ms: float) -> None:
        """A raw batch of ``key`` completed: ``nbytes`` copied in ``download_ms``."""
        if key is not None and download_ms > 0 and nbytes >= 1 << 20:
            with self._lock:
                self._ema(key, "link", nbytes / download_ms)


class CudaStreams(NamedTuple):
    """The pipeline's five streams, one per kind of device work (see the module docstring).
    Work on different streams is ordered only by the events the stages record and wait for,
    so one batch's upload, another's kernel and a third's download run at once."""

    h2d: torch.cuda.Stream  # uploads
    compute: torch.cuda.Stream  # kernels (and device-side copies of a partial batch)
    d2h: torch.cuda.Stream  # kernel batches' downloads
    d2h_raw: torch.cuda.Stream  # raw batches' downloads
    d2h_meta: torch.cuda.Stream  # T by copy, where kernels cannot store to pinned memory


class CudaStages:
    """Upload, kernel and download of one batch on a GPU, for ``pipeline.Pipeline``.

    The pipeline makes one and keeps it; everything the stages touch besides the batch itself
    (its job, slot and source) is given here. ``arena``, ``staging``, ``device_pool`` and
    ``bypass`` are the pipeline's own objects, shared, not copies: the pipeline's completer
    gives the batches' buffers back to the same pools, and ``bypass``'s ``max_raw_share`` is
    read at each raw batch. The only state of its own that changes is ``publish``.
    """

    def __init__(
        self,
        device: torch.device,
        streams: CudaStreams,
        page_size: int,
        batch_pages: int,
        arena: HostArena,
        staging: PinnedBufferPool,
        device_pool: DeviceBufferPool,
        bypass: RawBypass,
    ) -> None:
        self.device = device
        self.h2d, self.compute, self.d2h, self.d2h_raw, self.d2h_meta = streams
        self.page_size = page_size
        self.batch_pages = batch_pages
        self.arena = arena
        self.staging = staging
        self.device_pool = device_pool
        self.bypass = bypass
        # a device buffer holds a batch's pages, or an uploaded blob (payload and metadata)
        self.dev_bytes = batch_pages * page_size + meta_capacity(batch_pages) + 64
        # kernels store T to pinned memory (off after the first failure: _publish_total)
        self.publish = True

    def enqueue_compress(self, job: _Job, src: torch.Tensor, lo: int, hi: int,
                         element_size: int, producer: torch.cuda.Event | None) -> None:
        """Caller's thread: upload (host source or a partial last batch) and kernels, all on
        the pipeline's own streams (never the caller's current stream)."""
        p, n, slot = self.page_size, job.n_pages, job.slot
        full = hi - lo == n * p
        on_host = src.device.type == "cpu"
        dev = None
        if on_host or not full:  # written by the upload (h2d) or by the compute stream
            dev = self._device_buffer(self.h2d if on_host else self.compute)
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
            payload, sizes, kinds = compress_codec_eager(pages, element_size,
                                                         job.storage.float_format)
            packed, offsets = pack_eager(payload, sizes, zero_tail=False)  # T bytes go down
            slot.record("k_c", self.compute)
            # T to the host by a kernel (the copy engine is the link's); where that fails,
            # k_e stays unrecorded and T is copied below
            if self.publish and self._publish_total(offsets[n:], slot.total):
                slot.record("k_e", self.compute)
        if "k_e" not in slot.recorded:  # no kernel stores to host memory here: copy T
            s = self.d2h_meta
            with torch.cuda.stream(s):
                s.wait_event(slot.events["k_c"])
                slot.total.copy_(offsets[n:], non_blocking=True)
                slot.record("k_e", s)
            offsets.record_stream(s)
        for t in (packed, offsets, sizes, kinds):  # made on compute, downloaded on d2h
            t.record_stream(self.d2h)
        job.packed, job.meta = packed, (offsets, sizes, kinds)

    def _publish_total(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """``dst`` (pinned) = ``src`` by a kernel; returns whether it was queued. The first
        failure (a host allocator whose memory kernels cannot reach) turns it off for this
        pipeline: a copy does it instead, for that batch too."""
        try:
            publish_total_eager(src, dst)
            return True
        except Exception as exc:  # noqa: BLE001 - the copy path is always there
            self.publish = False
            warnings.warn(f"pagecomp: kernel stores to pinned memory failed ({exc}); the "
                          "batch sizes go to the host by copy (downloads then queue behind "
                          "each other's size)", stacklevel=3)
            return False

    def _device_buffer(self, writer: torch.cuda.Stream) -> torch.Tensor:
        """A pooled device buffer for a batch whose first write is on stream ``writer``.

        A pooled buffer is idle (its last batch completed on the host). A new one is allocated
        on ``writer``: the caching allocator hands out memory freed on the allocating stream
        without ordering any other stream, so allocating on the compute stream and writing on
        ``h2d`` would let the upload overwrite memory that queued kernels (a previous batch's
        decompressed pages) have yet to use."""
        with torch.cuda.stream(writer):
            return self.device_pool.acquire(self.dev_bytes)

    def issue_download(self, job: _Job) -> None:
        """Issuer thread: once the batch's kernels stored ``T`` on the host, carve an
        exact-size block from the arena and queue the download (payload and metadata) on
        ``d2h``; the block is the batch's in its storage from here on."""
        slot, n = job.slot, job.n_pages
        slot.events["k_e"].synchronize()
        lay = BlobLayout.of(n, int(slot.total[0]))
        block = self.arena.alloc(lay.total)
        # the storage's at once (it gives it back once the batch finished, after ``_fail``
        # waited for any copy queued into it): listed only after the copies, a failure or an
        # interrupt in between left the block nobody's, never given back
        job.storage.batch_stored(job.index, StoredBatch(block, lay, job.first_page))
        payload, offsets, sizes, kinds = lay.views(block.tensor)
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
            self.d2h.wait_event(slot.events["k_c"])
            slot.record("d_s", self.d2h)
            if lay.payload_bytes:
                payload.copy_(job.packed[: lay.payload_bytes], non_blocking=True)
            for dst, src in zip((offsets, sizes, kinds), job.meta):
                dst.copy_(src, non_blocking=True)
            slot.record("d_e", self.d2h)
        job.stored, job.payload_bytes = lay.total, lay.payload_bytes

    def issue_raw(self, job: _Job) -> None:
        """An incompressible stream's batch: download the pages as they are (RAW pages, the
        metadata written on the host), no kernel. Ordered after the producer.

        On its own stream (``d2h_raw``): a kernel batch's download never queues behind it. With
        ``max_raw_share`` in chunks of ``RAW_CHUNK`` bytes, so that a copy queued on another
        stream may get the copy engine between two chunks."""
        src, lo, hi, _ = job.work
        slot, n, p = job.slot, job.n_pages, self.page_size
        lay = BlobLayout.of(n, n * p)
        block = self.arena.alloc(lay.total)
        # the storage's at once, as in issue_download (here on the caller's thread: a Ctrl-C
        # between the carve and the listing kept the block for ever)
        job.storage.batch_stored(job.index, StoredBatch(block, lay, job.first_page, True))
        s = self.d2h_raw
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            if job.producer is not None:
                s.wait_event(job.producer)
            for name in ("up_s", "up_e", "k_s", "k_c", "k_e", "d_s"):
                slot.record(name, s)
            # one copy when not splitting (an incompressible stream: no kernel batches to let in)
            step = RAW_CHUNK if self.bypass.max_raw_share > 0 else max(1, hi - lo)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                block.tensor[a - lo : b - lo].copy_(src[a:b], non_blocking=True)
            slot.record("d_e", s)
        _, offsets, sizes, kinds = lay.views(block.tensor)
        block.tensor[hi - lo : n * p].zero_()
        torch.arange(0, (n + 1) * p, p, out=offsets)
        sizes.fill_(p)
        kinds.zero_()
        job.stored, job.payload_bytes = lay.total, lay.payload_bytes

    def enqueue_decompress(self, job: _Job, sb: StoredBatch, out: torch.Tensor,
                           statuses: list, start: torch.cuda.Event) -> None:
        """Caller's thread: upload one stored batch and decode it into its pages of ``out``
        (an all-RAW batch is uploaded straight into ``out``, no kernel); appends the batch's
        per-page status tensor to ``statuses``. ``start``: recorded on the caller's stream,
        which may still be using ``out``."""
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
            with torch.cuda.stream(self.compute):  # one status per page, in page order
                statuses.append(torch.zeros(n, dtype=torch.int32, device=out.device))
            slot.record("k_e", self.compute)
            return
        dev = self._device_buffer(self.h2d)
        job.buffers = ((self.device_pool, dev),)
        slot.record("up_s", self.h2d)
        with torch.cuda.stream(self.h2d):
            dev[: lay.total].copy_(sb.block.tensor, non_blocking=True)
        slot.record("up_e", self.h2d)
        self.compute.wait_event(slot.events["up_e"])
        with torch.cuda.stream(self.compute):
            slot.record("k_s", self.compute)
            payload, offsets, sizes, kinds = lay.views(dev)
            status = torch.empty(n, dtype=torch.int32, device=out.device)
            whole = hi - lo == n * p  # decoded in place; a partial last page goes via a buffer
            pages = out[lo:hi].view(n, p) if whole else torch.empty(
                (n, p), dtype=torch.uint8, device=out.device)
            decompress_into_eager(payload, offsets[:-1], sizes, kinds, pages, status,
                                  exp=job.storage.float_format is not None)
            if not whole:
                out[lo:hi].copy_(pages.view(-1)[: hi - lo])
            slot.record("k_e", self.compute)
        statuses.append(status)
