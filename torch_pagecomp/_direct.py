"""``PageCompressor``'s path for GPU tensors of at most one batch: no thread, no host wait.

The ring (``pipeline.Pipeline``) hands every offload and restore to worker threads and waits
on the host for each batch's compressed size: 1.3-1.9 ms per call, whatever the size (#26,
``bench/results/h200_5144f51_events/``). A tensor of one batch or less gains nothing from the
ring's overlap of several batches, so it goes to the kernel-only store the activation hooks
and the KV cache use (``offload._paged.PagedStore``): the compress kernel and a pack kernel
that writes the pages straight into page-locked host memory, on side streams, and a restore
queued on a stream of its own that the caller's stream waits for.

:class:`DirectPath` owns the store of one compressor (made on its first such offload), its
three streams, and a bound on the bytes it has in flight on the GPU (the pack frees each
slice's device payload; beyond the bound the host waits for the oldest, as the ring's slots
make it wait). :class:`DirectStorage` is one handle's stored tensor, with the interface the
handle reads (``ready``, ``wait``, ``release``, ``stored_nbytes``, ``compressed`` ...).

Handles are freed from finalizers, which may run in the middle of the store's bookkeeping:
a freed tensor goes to a sink (a list append) and is freed under the path's lock at its next
call. The store's pinned chunks are unregistered by :meth:`DirectPath.close` (``final``), at
interpreter exit for every live path, while CUDA is still up.
"""

from __future__ import annotations

import atexit
import collections
import threading
import weakref

import torch

from . import format as fmt
from ._events import handoff
from .offload._paged import PagedStore, PagedStored, SliceNotStored, free_each
from .offload._small_store import SMALL_BYTES, SmallStore, SmallStored, gather_pages
from .offload._streams import current_stream, on_stream

META_BYTES_PER_PAGE = 13  # a placed page's metadata on the host: offset 8, size 4, kind 1


class DirectStorage:
    """One tensor stored by a :class:`DirectPath` (what an ``OffloadHandle`` holds)."""

    direct = True

    def __init__(self, path: DirectPath, stored: PagedStored):
        self.path, self.stored = path, stored

    @property
    def error(self) -> BaseException | None:
        """The reason the tensor was not stored (a slice did not fit the host arena), once its
        placement is known; else None."""
        if self.path.placed(self.stored) and self.stored.failed():
            bad = next(sl for sl in self.stored.slices if sl.base is not None and sl.base < 0)
            return SliceNotStored(bad.n)
        return None

    def ready(self) -> bool:
        """Every page is in host memory (never blocks)."""
        return self.path.placed(self.stored)

    def wait(self) -> None:
        """Block until every page is in host memory."""
        self.path.wait_placed(self.stored)

    def release(self) -> None:
        """Free the host bytes (at the path's next call: see the module docstring)."""
        self.path.free(self.stored)

    @property
    def codec(self) -> str:
        return "exp" if self.stored.exp else "lz4"

    @property
    def stored_nbytes(self) -> int:
        """Host bytes: the packed pages, the partial last page, 13 bytes of metadata a page;
        0 until placed."""
        if not self.path.placed(self.stored):
            return 0
        held = self.stored.host_nbytes() or 0
        return held + META_BYTES_PER_PAGE * sum(sl.n for sl in self.stored.slices)

    def kernel_bytes(self, page_size: int) -> tuple[int, int]:
        """``(page bytes, stored bytes)`` of the pages the kernel compressed (every full page;
        the partial last page is copied as it is)."""
        if not self.path.placed(self.stored):
            return 0, 0
        return self.stored.kernel_bytes() or (0, 0)

    def compressed(self, page_size: int) -> fmt.CompressedPages:
        """The pages as one packed CPU ``CompressedPages`` (copied out of the arena; a partial
        last page becomes a RAW page, zero-padded). Raises ``PageCompError`` once freed."""
        return self.path.compressed(self.stored)


class SmallStorage(DirectStorage):
    """One tensor stored by the :class:`DirectPath`'s small store (``offload._small_store``):
    placed once its offload is done (the store then trims its block, under the path's lock);
    the block holds its metadata, so the host bytes are the block's."""

    error = None  # (a block that cannot be had fails the offload call itself)

    def ready(self) -> bool:
        if not self.stored.source_read():
            return False
        with self.path._lock:
            self.path.small.settle(self.stored)
        return self.stored.stored()

    def wait(self) -> None:
        self.stored.synchronize()
        with self.path._lock:
            self.path.small.settle(self.stored)

    @property
    def stored_nbytes(self) -> int:
        """Host bytes: the block (metadata, partial last page, pages); 0 until placed (and,
        through its handle, once freed)."""
        if not self.ready():
            return 0
        return self.stored.host_nbytes() or 0

    def kernel_bytes(self, page_size: int) -> tuple[int, int]:
        if not self.ready():
            return 0, 0
        return self.stored.kernel_bytes() or (0, 0)

    def compressed(self, page_size: int) -> fmt.CompressedPages:
        """The pages as one packed CPU ``CompressedPages`` (a partial last page becomes a
        RAW page, zero-padded). Raises ``PageCompError`` once freed.

        Read under the path's lock, as :meth:`DirectPath.compressed` reads (see there): the
        small store copies every part of the block before it returns."""
        self.wait()
        with self.path._lock:
            self.path._check_readable(self.stored)
            return self.path.small.compressed(self.stored)


class DirectPath:
    """The kernel-only store of one ``PageCompressor`` (see the module docstring).

    ``max_in_flight``: bytes of offloads whose pages may be on the GPU at once (device
    payload not packed yet); an offload beyond it waits on the host for the oldest. On the
    CPU (tests, with the Triton interpreter) there are no streams and every call completes
    before it returns.
    """

    def __init__(self, device: torch.device, page_size: int, stream_priority: int,
                 checksum: bool, max_in_flight: int):
        self.device, self.page_size, self.max_in_flight = device, page_size, max_in_flight
        streams = (None, None, None)
        if device.type == "cuda":
            streams = tuple(torch.cuda.Stream(device=device, priority=stream_priority)
                            for _ in range(3))
        self.compress_stream, self.pack_stream, self.restore_stream = streams
        # a handle may live long: its metadata (13 bytes a page) waits on the host, in the
        # arena behind its pages, as every store's does once placed
        self.store = PagedStore(device, page_size, streams, checksum=checksum)
        # exponent-codec tensors of at most SMALL_BYTES: one encode, one copy, one decode
        # (#26); checksums and pageable host memory go through the store
        self.small = None if checksum else SmallStore(device, page_size, self.compress_stream)
        self.small_bytes = SMALL_BYTES  # (read here: a probe sets it first, 0 for none)
        if self.small is not None and not self.small.usable:
            self.small = None
        # not reentrant: a finalizer that runs while this thread holds it (in the store's
        # bookkeeping) must leave its tensor in the sink, not free it there
        self._lock = threading.Lock()
        self._sink: list[PagedStored] = []
        self._in_flight: collections.deque = collections.deque()  # (event, nbytes)
        self._in_flight_bytes = 0
        self._unsettled: collections.deque[PagedStored] = collections.deque()  # not counted
        self.offloads = self.waits = 0
        self.bytes_in = self.bytes_stored = 0  # pages through the kernel, and their bytes held
        self.closed = False  # every chunk unpinned at interpreter exit: nothing is readable
        self.shut = False  # its compressor closed: no offload comes, the handles still read
        _LIVE.add(self)

    # ------------------------------------------------------------------ offload
    def offload(self, src: torch.Tensor, element_size: int,
                float_format: str | None) -> DirectStorage:
        """Store ``src`` (``uint8 [nbytes]``, contiguous, on this device) after the current
        stream's work; ``src``'s memory is not reused before the compress stream read it."""
        if (self.small is not None and float_format is not None
                and src.numel() <= self.small_bytes):
            small = self.offload_small(src, src.numel(), float_format == "fp16")
            if small is not None:
                return small
        producer = self._current()
        with self._lock:
            self._drain()
            self._bound(src.numel())
            stored = self.store.offload(src, element_size, producer=producer,
                                        float_format=float_format)
            last = stored.slices[-1].stored if stored.slices else stored.consumed
            self._track(stored, last, src, src.numel(), producer)
        return DirectStorage(self, stored)

    def offload_small(self, src: torch.Tensor, nbytes: int, fp16: bool) -> SmallStorage | None:
        """The small store's offload of ``src`` (a contiguous bf16 or fp16 tensor of
        ``nbytes`` bytes, at most ``SMALL_BYTES``, on this device; the small store present)
        after the current stream's work: :meth:`offload`'s and ``PageCompressor``'s one-call
        path's (``torch_pagecomp._small_tensor``). None where its block could not be
        page-locked."""
        producer = self._current()
        with self._lock:
            self._drain()
            self._bound(nbytes)
            stored = self.small.offload(src, fp16, producer)
            if stored is None:
                return None
            self._track(stored, stored, src, nbytes, producer)  # (it answers as an event)
        return SmallStorage(self, stored)

    def _track(self, stored, last, src: torch.Tensor, nbytes: int, producer) -> None:
        """Count an offload queued (the lock held): ``src`` kept for the compress stream,
        ``last`` (its last event, or what answers as one) bounding the bytes in flight."""
        if producer is not None:
            src.record_stream(self.compress_stream)
        self._in_flight.append((last, nbytes))
        self._in_flight_bytes += nbytes
        self._unsettled.append(stored)
        if len(self._unsettled) > 64:
            self._settle()
        self.offloads += 1

    def _bound(self, nbytes: int) -> None:
        """Forget finished offloads; wait for the oldest while ``nbytes`` more would pass
        ``max_in_flight``."""
        while self._in_flight:
            event, n = self._in_flight[0]
            if event is not None and not event.query():
                if self._in_flight_bytes + nbytes <= self.max_in_flight:
                    return
                self.waits += 1
                event.synchronize()
            self._in_flight.popleft()
            self._in_flight_bytes -= n

    def _settle(self) -> None:
        """Count the placed sizes of the stored tensors placed since the last call (in stream
        order: the first one not placed ends it)."""
        self.store.poll()
        if self.small is not None:
            self.small.poll()
        while self._unsettled and self._unsettled[0].stored():
            kb = self._unsettled.popleft().kernel_bytes()
            if kb is not None:  # (None: freed before it was placed)
                self.bytes_in += kb[0]
                self.bytes_stored += kb[1]

    # ------------------------------------------------------------------ restore
    def restore_into(self, storage: DirectStorage, out: torch.Tensor) -> torch.Tensor:
        """Decode ``storage`` into ``out`` (``uint8 [nbytes]`` on this device) in the current
        stream's order: the restore stream waits for the caller's work (``out`` may be memory
        it used), decodes, and the caller's stream waits for it. Returns the statuses
        (``int32``, on the device, usable on the caller's stream)."""
        consumer = self._current()
        if isinstance(storage.stored, SmallStored):  # decoded on the caller's stream
            return self.restore_small(storage.stored, out, consumer)
        with self._lock:
            self._check_readable(storage.stored)
            if consumer is None:  # the CPU: done on return
                return self.store.restore(storage.stored, out, count=False)
            handoff(consumer, self.restore_stream)
            with on_stream(self.restore_stream):
                status = self.store.restore(storage.stored, out, count=False)
            handoff(self.restore_stream, consumer)
        status.record_stream(consumer)  # made on the restore stream, read on the caller's
        return status

    def restore_small(self, stored: SmallStored, out: torch.Tensor, consumer) -> torch.Tensor:
        """Decode ``stored`` (the small store's) into ``out`` (contiguous, its bytes, on this
        GPU) on ``consumer`` (the current stream); returns the statuses (``int32``, made and
        written on ``consumer``)."""
        with self._lock:
            self._check_readable(stored)
            return self.small.restore(stored, out, consumer)

    def _check_readable(self, stored) -> None:
        """With the lock held: the frees left in the sink made (:meth:`_drain`), then raise
        where ``stored``'s host bytes are gone: its handle freed by another thread since the
        caller checked it (the drain gave its block back: a decode queued now, or a copy made
        now, could read memory a new offload rewrites), or every chunk unpinned at interpreter
        exit (:meth:`close`; a decode would read host memory the GPU may no longer address)."""
        self._drain()
        if self.closed:
            raise fmt.PageCompError("this PageCompressor's host memory was released at "
                                    "interpreter exit: its handles are not restorable")
        if stored.freed:
            raise fmt.PageCompError("this handle was freed")

    def _current(self):
        """The caller's stream on this device (None on the CPU)."""
        return current_stream(self.device) if self.device.type == "cuda" else None

    # ------------------------------------------------------------------ placement
    def placed(self, stored: PagedStored) -> bool:
        """Whether every page of ``stored`` is in host memory at a known place (no waiting)."""
        if not stored.ready():
            return False
        with self._lock:
            self.store.poll()
        return stored.stored()

    def wait_placed(self, stored: PagedStored) -> None:
        consumed = stored.consumed  # (set to None once seen done, from any thread)
        if consumed is not None:
            consumed.synchronize()
        with self._lock:
            if stored.slices:
                self.store.arena.confirm(through=stored.slices[-1])
                self.store.arena.settle()  # (their bytes in host memory)

    def compressed(self, stored: PagedStored) -> fmt.CompressedPages:
        """``stored`` as one packed CPU ``CompressedPages`` (see ``DirectStorage``). Raises
        ``PageCompError`` where its handle was freed (or the host memory released at exit)
        before the read.

        The path's lock is the read's hold on the slices: a free meanwhile (another thread)
        stays in the sink, and its chunks go back at the next call's drain, after the read.
        So every byte is copied under the lock: a placed slice's sizes and kinds are views of
        the arena's host memory (raw addresses, which keep no chunk alive), and concatenated
        after the lock they were read once a free could have given their chunk to another
        offload, or unmapped it (a compressor closed: a crash)."""
        self.wait_placed(stored)
        p = self.page_size
        payloads, sizes, kinds = [], [], []
        with self._lock:
            self._check_readable(stored)  # (a free left in the sink: refused, as a restore)
            for sl in stored.slices:
                if sl.base < 0:
                    raise SliceNotStored(sl.n)
                # the slice's pages lie 16-byte aligned in the arena: gather them back to back
                blob = torch.cat([v for _, v in self.store.arena.pieces(sl.base, sl.total)])
                size = sl.sizes.to("cpu", copy=True)
                payloads.append(gather_pages(blob, sl.rel.cpu(), size))
                sizes.append(size)
                kinds.append(sl.kinds.to("cpu", copy=True))
            if stored.tail is not None:  # a RAW page, zero-padded
                page = torch.zeros(p, dtype=torch.uint8)
                page[:stored.tail.numel()] = stored.tail
                payloads.append(page)
                sizes.append(torch.tensor([p], dtype=torch.int32))
                kinds.append(torch.tensor([fmt.KIND_RAW], dtype=torch.uint8))
        return fmt.packed_pages(payloads, sizes, kinds, p, "exp" if stored.exp else "lz4")

    # ------------------------------------------------------------------ lifetime
    def free(self, stored: PagedStored) -> None:
        self._sink.append(stored)  # a list append: safe from any finalizer
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Free what the sink holds (the lock held)."""
        if not self._sink or self.closed:
            return
        self._settle()  # count what is placed before it goes
        taken = []  # (popped in place: a finalizer may append meanwhile, kept for next time)
        while self._sink:
            taken.append(self._sink.pop())
        small = [s for s in taken if isinstance(s, SmallStored)]
        paged = [s for s in taken if not isinstance(s, SmallStored)]
        try:
            if small:  # (no small store without small tensors)
                free_each(small, self.small.free)
            if paged:  # (its stream hand-offs only where the store holds some; it empties
                self.store.free_after_restores(paged)  # ``paged`` as each is freed)
        except BaseException:  # (an interrupt): the rest wait for the next call's drain,
            self._sink.extend(small + paged)  # not lost with their host bytes
            raise
        if self.shut:  # no offload will reuse what they held: given back as they go (kept
            self._release_idle()  # pinned, the last handle's chunk stayed until exit)

    def shut_down(self) -> None:
        """Its compressor closed (no offload comes; the handles stay readable): wait for the
        streams and give back what no handle holds, then the rest as the handles are freed."""
        self.synchronize()
        with self._lock:
            self.shut = True
            self._drain()
            self._release_idle()

    def synchronize(self) -> None:
        """Wait for every offload and restore queued so far."""
        for s in (self.compress_stream, self.pack_stream, self.restore_stream):
            if s is not None:
                s.synchronize()
        with self._lock:
            self.store.poll()
            if self.small is not None:
                self.small.poll()

    def release_idle(self) -> int:
        """Unpin the chunks no stored tensor needs and free the compress scratch; returns the
        host bytes given back."""
        with self._lock:
            self._drain()
            return self._release_idle()

    def _release_idle(self) -> int:
        """:meth:`release_idle` with the lock held."""
        before = self._host_held()
        self.store.release_idle()
        if self.small is not None:
            self.small.release_idle()
        return before - self._host_held()

    def _host_held(self) -> int:
        return self.store.arena.held_bytes + (
            self.small.arena.held_bytes if self.small is not None else 0)

    def stats(self) -> dict:
        with self._lock:
            self._drain()
            self._settle()
            st = self.store.stats()
            if self.small is not None:  # counted in the totals too
                small = self.small.stats()
                st.update(small)
                st["host_used_bytes"] += small["small_host_used_bytes"]
                st["host_held_bytes"] += small["small_host_held_bytes"]
                st["scratch_bytes"] += small["small_scratch_bytes"]
            st.update(offloads=self.offloads, backpressure_waits=self.waits,
                      inflight_bytes=self._in_flight_bytes, bytes_in=self.bytes_in,
                      bytes_stored=self.bytes_stored)
        return st

    def close(self, final: bool = False) -> None:
        """Wait for the streams. ``final`` (interpreter exit): also unpin every chunk while
        CUDA is still up (stored tensors are not restorable afterwards)."""
        try:
            self.synchronize()
        except RuntimeError:  # a CUDA context already torn down: nothing to wait for
            return
        if final and not self.closed:
            with self._lock:
                self._drain()
                self.store.close()
                if self.small is not None:
                    self.small.close()
                self.closed = True


_LIVE: weakref.WeakSet[DirectPath] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for path in list(_LIVE):
        try:
            path.close(final=True)
        except Exception:  # noqa: BLE001 - nothing to report to at exit; keep closing
            pass
