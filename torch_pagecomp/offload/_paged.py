"""Compressed activation storage that needs no host thread and no host sync to offload.

Stored tensors (``uint8 [nbytes]`` storages on the GPU) are compressed in *slices* of whole
pages (``_arena``). Per slice, on the offloader's side streams: the compress kernel writes
fixed-stride pages into a scratch buffer (stream ``compress``); then (stream ``pack``) one
kernel of a few persistent programs reserves the slice's bytes at the end of a *virtual
arena* of page-locked host memory and copies the pages there
(``torch_pagecomp.kernels.host_pack.pack_slice``). The compressed size never has to reach the
host before the bytes move, so the link works while the host runs ahead, and host memory
holds the compressed bytes only (16-byte aligned pages).

A slice holds the pages of one tensor, or (``offload(..., defer=True)``: the activation
hooks) of every tensor offloaded since the last :meth:`PagedStore.flush`, up to
``BATCH_BYTES``: the compress kernel then reads each page where it lies (a table of page
addresses), so a block's saved tensors cost the host one compress and one pack launch
together rather than two each. Until its slice is made a stored tensor is *pending*: not
ready, its source still needed; asking to wait on it, restore it or place it flushes first.

The host backs the arena ahead of use: before each slice it adds chunks so that the arena's
end, advanced by the slice's worst case (``N * P``), stays backed; the device refuses (and
marks failed) a slice that would pass the backed limit, so no store ever leaves the chunks.
Chunks behind every live slice go back to a free list and back later parts of the arena.

A restore is queued on the caller's stream after the slice's pack, without waiting on the
host: when the slice's placement is already known (its pack finished: the usual case by the
time backward needs it) the copy engine brings the tensor's exact bytes back; otherwise a few
persistent programs read the slice from the chunk (placement from the device descriptor).
The decoder then expands them. A partial last page (``nbytes % P``) travels as a plain copy.
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from .. import _ops, cpu_codec
from ..api import checksum_status
from ..format import CorruptPageError
from ..module import RestoreFailures
from ..pools import can_pin
from ._arena import CHUNK_BYTES, SliceNotStored, VirtualArena, _Part, _record, _Slice, _wait
from ._streams import current_stream, on_stream

__all__ = ["PagedStore", "PagedStored", "SliceNotStored"]

SLICE_BYTES = 64 << 20  # pages per compress launch: fills the GPU, bounds the scratch; each
# slice costs the host ~5 kernel launches both ways
SCRATCH_SLICES = 2  # slices compressed ahead of the pack stream (scratch held at once)
BATCH_BYTES = 16 << 20  # a batch of deferred offloads is flushed once it holds this many bytes
# of pages: the host backs the arena ahead by each pending slice's worst case (``N * P``), so a
# batch stays a fraction of a chunk (batches of a whole chunk each backed a chunk more than
# they used until confirmed: new pinned chunks every step, measured at 290 us per slice)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without making the host wait: on CUDA it goes up
    from page-locked memory (a copy from pageable memory waits for the stream)."""
    if device.type == "cuda" and can_pin():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _align16(nbytes: int) -> int:
    return (nbytes + 15) & ~15


class PagedStored:
    """One storage held in the arena (see :class:`PagedStore`): ``slices`` are its parts
    (``_arena._Part``), in page order; empty and ``pending`` until its slices are made."""

    kind = "compressed"

    def __init__(self, nbytes: int, page_size: int, slices: list[_Part], tail=None,
                 consumed=None, tail_sum=None, pending=None, seq: int = 0):
        self.nbytes, self.page_size, self.slices = nbytes, page_size, slices
        self.seq = seq  # offload order in its store (restoring in it joins adjacent copies)
        self.tail = tail  # pinned uint8 [nbytes % P] or None
        self.tail_sum = tail_sum  # its checksum (int32 [1], on the device), or None
        self.consumed = consumed  # the source has been read (device event, None on the CPU)
        self.pending = pending  # the store whose next flush makes its slices, or None
        self.freed = False
        self.kernel: tuple[int, int] | None = None  # kept when freed

    def ready(self) -> bool:
        """The copy is done: every page is in host memory. Until then the offloader keeps the
        source, as it does for a plain copy, so a backward that comes first reads it in place
        rather than over the link."""
        return self.pending is None and (self.consumed is None or self.consumed.query()) and all(
            sl.done() for sl in self.slices)

    def wait_on(self, stream) -> None:
        """``stream`` waits until the source may be dropped: its pages are compressed (the
        packing may still run). A pending tensor is flushed first."""
        if self.pending is not None:
            self.pending.flush()
        _wait(stream, self.consumed)

    def stored(self) -> bool:
        return self.pending is None and all(sl.base is not None for sl in self.slices)

    def failed(self) -> bool:
        return any(sl.base is not None and sl.base < 0 for sl in self.slices)

    def host_nbytes(self) -> int | None:
        """Host bytes held (compressed pages + the raw tail) once placed, else None."""
        if not self.stored():
            return None
        tail = self.tail.numel() if self.tail is not None else 0
        return sum(sl.total for sl in self.slices) + tail

    def kernel_bytes(self) -> tuple[int, int] | None:
        """``(page bytes, stored bytes)`` of the compressed pages once placed."""
        if self.freed:
            return self.kernel
        if not self.stored():
            return None
        return (sum(sl.n for sl in self.slices) * self.page_size,
                sum(sl.total for sl in self.slices))


class PagedStore:
    """Offload storages compressed into a :class:`~._arena.VirtualArena` (one per device).

    ``streams``: ``(compress, pack, restore)`` CUDA streams (``None`` on the CPU, where the
    kernels run synchronously: the Triton interpreter in tests). Restores run on the caller's
    current stream; ``restore_stream`` is the stream they are issued on (chunk reuse waits
    for it). ``checksum``: keep each page's checksum (format) on the device beside its
    metadata and check every restored page against it (``STATUS_CHECKSUM``, counted as decode
    failures are); one more read of the pages each way. A partial last page travels as plain
    bytes, checked as one zero-padded page (:func:`tail_checksum`).
    """

    kind = "compressed"

    def __init__(self, device: torch.device, page_size: int, streams=(None, None, None),
                 chunk_bytes: int = CHUNK_BYTES, slice_bytes: int = SLICE_BYTES,
                 checksum: bool = False):
        self.device, self.page_size = device, page_size
        self.checksum = checksum
        self.compress_stream, self.pack_stream, self.restore_stream = streams
        with on_stream(self.pack_stream):  # the pack kernel reads the arena's state there
            self.arena = VirtualArena(device, chunk_bytes)
        self.slice_pages = max(1, min(slice_bytes, chunk_bytes) // page_size)
        self.batch_pages = max(1, min(BATCH_BYTES, slice_bytes, chunk_bytes // 4) // page_size)
        self._packed: collections.deque = collections.deque()  # pack events of recent slices
        self.failures = None  # pages that failed to decode, counted on the device
        self._statuses: dict = {}  # restore stream -> decode statuses not counted yet
        if device.type == "cuda":
            with on_stream(self.restore_stream):
                self.failures = RestoreFailures(device)
            self.pack_stream.synchronize()  # both made before any kernel may use them
            self.restore_stream.synchronize()
        self.scratch_bytes = 0  # bound on the scratch held at once (reported in stats)
        self._scratches: dict[int, tuple] = {}  # element size -> the compress kernel's scratch
        self._scratch_held = 0
        # deferred offloads, in order: (stored, source) of one element size and producer
        self._batch: list[tuple[PagedStored, torch.Tensor]] = []
        self._batch_key: tuple | None = None  # (element size, producer stream)
        self._batch_pages = 0
        self._seq = 0

    # ------------------------------------------------------------------ offload
    def offload(self, src: torch.Tensor, element_size: int, producer=None,
                defer: bool = False) -> PagedStored:
        """Start storing ``src`` (``uint8 [nbytes]``, contiguous) after ``producer``'s work.

        ``defer``: join the pending batch (compressed with the tensors offloaded after it, at
        the next :meth:`flush`, or once the batch holds ``BATCH_BYTES``); the caller keeps
        ``src`` unchanged until the stored tensor is ready (as for any offload). Sources that
        do not start 16-byte aligned are stored at once."""
        self._seq += 1
        stored = PagedStored(src.numel(), self.page_size, [], pending=self, seq=self._seq)
        key, pages = (element_size, producer), src.numel() // self.page_size
        if self._batch and (self._batch_key != key
                            or self._batch_pages + pages > self.batch_pages):
            self.flush()  # a batch holds one kind of pages, and a large tensor goes alone
        self._batch.append((stored, src))
        self._batch_key = key
        self._batch_pages += pages
        if not defer or self._batch_pages >= self.batch_pages or src.data_ptr() % 16:
            self.flush()
        return stored

    def flush(self) -> None:
        """Make the slices of every pending offload: one compress and one pack launch per
        ``SLICE_BYTES`` of their pages, after their producer's work so far."""
        batch, (element_size, producer) = self._batch, self._batch_key or (1, None)
        if not batch:
            return
        self._batch, self._batch_key, self._batch_pages = [], None, 0
        p, cs = self.page_size, self.compress_stream
        if cs is not None and producer is not None:
            cs.wait_stream(producer)
        spans: list[tuple] = []  # (stored, source, first page, pages) of the next slice
        room = self.slice_pages
        with on_stream(cs):
            for stored, src in batch:
                full = src.numel() // p
                first = 0
                while first < full:
                    n = min(room, full - first)
                    spans.append((stored, src, first, n))
                    first += n
                    room -= n
                    if room == 0:
                        self._store_slice(spans, element_size)
                        spans, room = [], self.slice_pages
            if spans:
                self._store_slice(spans, element_size)
            for stored, src in batch:
                full = src.numel() // p
                if src.numel() % p:
                    stored.tail = torch.empty(src.numel() % p, dtype=torch.uint8,
                                              pin_memory=self.arena.pin)
                    stored.tail.copy_(src[full * p:], non_blocking=True)
                    if self.checksum:
                        stored.tail_sum = tail_checksum(src[full * p:], p)
            consumed = _record(cs)
        for stored, _ in batch:
            stored.consumed, stored.pending = consumed, None

    def _store_slice(self, spans: list[tuple], element_size: int) -> None:
        """One slice of the pages of ``spans`` (``(stored, source, first, n)`` each, in
        order): compressed on the current (compress) stream, packed on the pack stream; each
        span becomes its stored tensor's next part."""
        from ..kernels.host_pack import pack_slice  # Triton: imported on use

        p, cs, ps = self.page_size, self.compress_stream, self.pack_stream
        if len(self._packed) >= SCRATCH_SLICES:  # bound the scratch in flight
            _wait(cs, self._packed.popleft())
        n = sum(span[3] for span in spans)
        dev = spans[0][1].device
        # two allocations per slice: the fixed-stride payload (freed once packed) and the
        # metadata the restore needs, ``rel int64 [n] | desc int64 [2] | sizes int32 [n] |
        # kinds uint8 [n] (| sums int32 [n])``, each part 16-byte aligned (Triton compiles a
        # kernel per pointer alignment: parts placed by ``n`` alone would compile new variants
        # mid-training)
        payload = torch.empty((n, p), dtype=torch.uint8, device=dev)
        a = _align16(8 * n)
        b = a + 16 + _align16(4 * n)
        c = b + _align16(n)
        meta = torch.empty(c + 4 * n if self.checksum else b + n, dtype=torch.uint8, device=dev)
        rel, desc = meta[:8 * n].view(torch.int64), meta[a:a + 16].view(torch.int64)
        sizes, kinds = meta[a + 16:a + 16 + 4 * n].view(torch.int32), meta[b:b + n]
        sums = meta[c:c + 4 * n].view(torch.int32) if self.checksum else None
        scratch = self._scratch(dev, element_size)
        _compress_spans(spans, p, element_size, (payload, sizes, kinds), scratch, sums)
        compressed = _record(cs)
        self.scratch_bytes = max(self.scratch_bytes, SCRATCH_SLICES * n * p + self._scratch_held)
        ats, at = [], 0
        for span in spans:
            ats.append(at)
            at += span[3]
        host_rel = (torch.empty(n, dtype=torch.int64, pin_memory=self.arena.pin)
                    if len(spans) > 1 else None)
        with on_stream(ps):
            _wait(ps, compressed)
            arena = self.arena
            host_desc = arena.host_desc()
            arena.back(n * p, ps)
            pack_slice(payload, sizes, rel, arena.state, arena.parity, arena.limit, desc,
                       host_desc, arena.table, arena.chunk, host_rel=host_rel)
            arena.parity ^= 1
            stored = _record(ps)
            if ps is not None:
                payload.record_stream(ps)  # made on the compress stream, read here
                meta.record_stream(ps)
            self._packed.append(stored)
        sl = _Slice(n, sizes, kinds, rel, desc, host_desc, stored, sums, tuple(ats), host_rel)
        for k, (owner, _, first, count) in enumerate(spans):
            owner.slices.append(_Part(sl, k, ats[k], count, first))
        arena.add(sl, n * p)

    def _scratch(self, dev: torch.device, element_size: int):
        """The compress kernel's working memory for ``element_size`` (on the GPU: kept for the
        store's life, used on its compress stream only, so launches reuse it in order)."""
        if dev.type != "cuda":
            return None
        scratch = self._scratches.get(element_size)
        if scratch is None:
            from ..kernels.lz4_compress import compress_config, compress_scratch, max_programs

            cfg = compress_config(self.page_size, element_size)
            scratch = compress_scratch(dev, cfg, max_programs(dev, cfg))
            self._scratches[element_size] = scratch
            self._scratch_held += sum(t.numel() * t.element_size() for t in scratch)
        return scratch

    def release_scratch(self) -> None:
        """Free the compress kernel's scratch and stop counting it (the offloader's in-flight
        bound subtracts ``scratch_bytes``): the offloader calls this when it settles on copying,
        so copied passes get the bound and the GPU memory of plain copies. Made again on the
        next compressed slice. The scratch is only used on the compress stream, where it was
        made, so its memory is reused after the kernels queued there."""
        self._scratches.clear()
        self._scratch_held = 0
        self.scratch_bytes = 0

    # ------------------------------------------------------------------ restore
    def restore(self, stored: PagedStored, out: torch.Tensor) -> None:
        """Decode ``stored`` into ``out`` (``uint8 [nbytes]``) on the current stream, after
        its pack (a device-side wait: the host learns nothing and waits for nothing)."""
        from ..kernels.host_pack import fetch_from_host

        if stored.pending is not None:
            self.flush()
        p, arena = self.page_size, self.arena
        stream = current_stream(out.device) if out.is_cuda else None  # on out's device
        arena.confirm()  # placements known by now (never waits)
        full = stored.nbytes // p  # the slices' pages; the partial tail travels as bytes
        checked_tail = stored.tail_sum is not None
        status = torch.empty(full + checked_tail, dtype=torch.int32, device=out.device)
        for part in stored.slices:
            sl = part.sl
            if sl.base is not None and sl.base < 0:
                raise SliceNotStored(part.n)
            rel, sizes, kinds, sums = part.meta()
            if sl.base is not None:  # placed: the copy engine brings the part's bytes
                staging = torch.empty(part.total, dtype=torch.uint8, device=out.device)
                at = sl.base % arena.chunk + part.start
                host = arena.backed[sl.base // arena.chunk].tensor[at:at + part.total]
                staging.copy_(host, non_blocking=True)
                if part.start:
                    rel = rel - part.start
            else:  # still packing: kernels read the slice once the pack is done
                _wait(stream, sl.stored)
                staging = torch.empty(sl.n * p, dtype=torch.uint8, device=out.device)
                fetch_from_host(staging, sl.desc, arena.table, arena.chunk)
            pages = out[part.first * p:(part.first + part.n) * p].view(part.n, p)
            st = status[part.first:part.first + part.n]
            _decompress_into(staging, rel, sizes, kinds, pages, st, sums)
        if stored.tail is not None:  # its status (if checked) follows the pages'
            restore_tail(stored, out[stored.nbytes - stored.tail.numel():], stream,
                         status[full:])
        if status.numel():
            self._count_failures(status, stream)
        if stream is None:
            arena.confirm()

    def restore_group(self, group, out) -> None:
        """Decode the stored tensors of ``group`` (a ``_paged_group.StoredGroup``, which keeps
        the metadata of its placed tensors between calls: a KV cache layer's blocks) with a
        constant number of launches, back to back into ``out`` (``uint8 [group.nbytes]``) or
        into a list of one output per stored tensor (see ``_paged_group``)."""
        from ._paged_group import restore_group

        if self._batch:
            self.flush()
        restore_group(self, group, out)

    def wait_placed(self) -> None:
        """Wait until every slice stored so far is placed and confirmed (exact host sizes)."""
        self.flush()
        if self.arena.pending:
            self.arena.confirm(through=self.arena.pending[-1][0])

    def close(self) -> None:
        """Wait for this store's streams, then unpin every chunk. Stored tensors are not
        restorable afterwards (pending ones are never stored); the store must not be used
        again."""
        self._batch.clear()
        for s in (self.compress_stream, self.pack_stream, self.restore_stream):
            if s is not None:
                s.synchronize()
        self.arena.confirm()
        for mem in self.arena.backed.values():
            mem.release()
        self.arena.backed.clear()
        self.arena.trim()
        self._packed.clear()
        self._scratches.clear()

    def _count_failures(self, status: torch.Tensor, stream) -> None:
        if stream is None:  # the CPU: known at once
            bad = int(torch.count_nonzero(status))
            if bad:
                raise CorruptPageError([], [], f"{bad} offloaded page(s) failed to decode")
            return
        # counted once per backward (one launch for all restores, not two per restore);
        # the statuses stay alive until then, on the stream that wrote them
        self._statuses.setdefault(stream, []).append(status)

    def failed_restores(self) -> int:
        """Pages that failed to decode in restores so far, as far as the host knows (never
        blocks)."""
        if self.failures is None:
            return 0
        for stream, statuses in self._statuses.items():
            self.failures.add(statuses, stream)
        self._statuses.clear()
        return self.failures.poll()

    # ------------------------------------------------------------------ lifetime
    def poll(self) -> None:
        """Confirm the placement of finished slices (no waiting)."""
        self.arena.confirm()

    def free(self, stored: PagedStored) -> None:
        if stored.pending is not None:  # never compressed: out of the batch, source dropped
            self._batch = [(s, src) for s, src in self._batch if s is not stored]
            self._batch_pages = sum(src.numel() // self.page_size for _, src in self._batch)
            stored.pending = None
        for part in stored.slices:
            self.arena.release(part, self.restore_stream)
        stored.kernel = stored.kernel_bytes()  # what the class policy may still read
        stored.slices = []
        stored.tail = stored.tail_sum = None
        stored.freed = True

    def stats(self) -> dict:
        a = self.arena
        return {
            "host_used_bytes": a.used,
            "host_held_bytes": a.held_bytes,
            "host_peak_held_bytes": a.peak_held,
            "scratch_bytes": self.scratch_bytes,
            "pending_slices": len(a.pending),
            "pending_tensors": len(self._batch),
        }


def _compress_spans(spans: list[tuple], page_size: int, element_size: int, out: tuple,
                    scratch, sums) -> None:
    """``pagecomp.compress`` of the pages of ``spans`` into ``out`` (``payload, sizes,
    kinds``) and, with ``sums``, their checksums. On the GPU the launchers are called directly
    (the op's argument checks cost host time per slice and cannot fail here): one span's pages
    as they lie, several by a table of page addresses. On the CPU (tests, under the
    interpreter) the op's lz4 path over the pages gathered."""
    p = page_size
    views = [src[first * p:(first + n) * p] for _, src, first, n in spans]
    if not views[0].is_cuda:
        pages = torch.cat(views).view(-1, p)
        for dst, res in zip(out, _ops.compress_eager(pages, element_size)):
            dst.copy_(res)
        if sums is not None:
            _checksums(pages, sums)
        return
    if len(spans) == 1:
        from ..kernels.lz4_compress import compress_pages

        pages = views[0].view(-1, p)
        compress_pages(pages, element_size, traced=False, out=out, scratch=scratch)
        if sums is not None:
            _checksums(pages, sums)
        return
    from ..kernels.checksum import row_checksums
    from ..kernels.lz4_compress import compress_rows

    rows = _row_table(views, p)
    compress_rows(rows, p, element_size, out, scratch)
    if sums is not None:
        row_checksums(rows, p, sums)


def _checksums(pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The format's checksum of each page of ``pages`` (``uint8 [n, P]``) on the current
    stream, into ``out`` (``int32 [n]``) if given: the kernel on the GPU, numpy on the CPU."""
    if pages.is_cuda:
        from ..kernels.checksum import page_checksums

        return page_checksums(pages, traced=False, out=out)
    got = cpu_codec.page_checksums_cpu(pages)
    if out is None:
        return got
    out.copy_(got)
    return out


def restore_tail(stored: PagedStored, out: torch.Tensor, stream, status) -> None:
    """Copy ``stored``'s partial last page into ``out`` (``uint8 [nbytes % P]``) on ``stream``
    once its copy to the host is done (on the compress stream, after the pages: not covered by
    the packs' events); with its checksum (the store's ``checksum``), its status goes to
    ``status`` (``int32 [1]``; unused without one)."""
    _wait(stream, stored.consumed)
    out.copy_(stored.tail, non_blocking=True)
    if stored.tail_sum is not None:
        status.zero_()
        verify(status, tail_checksum(out, stored.page_size), stored.tail_sum)


def tail_checksum(tail: torch.Tensor, page_size: int) -> torch.Tensor:
    """The checksum (``int32 [1]``) of a partial last page ``tail`` (``uint8 [r]``, ``r <
    page_size``) zero-padded to a page, on its device's current stream: the hooks store a
    tensor's last ``nbytes % P`` bytes as a plain copy and check them with this."""
    page = torch.zeros((1, page_size), dtype=torch.uint8, device=tail.device)
    page[0, :tail.numel()].copy_(tail, non_blocking=True)
    return _checksums(page)


def verify(status: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    """``api.checksum_status`` written into ``status`` (a part of the restore's statuses)."""
    status.copy_(checksum_status(status, got, want))


def _row_table(outs: list, page_size: int) -> torch.Tensor:
    """``int64 [pages]`` on the outputs' device: the address of every page of ``outs`` in
    order (uploaded from pinned memory, no host wait)."""
    rows = np.concatenate([np.arange(o.numel() // page_size, dtype=np.int64) * page_size
                           + o.data_ptr() for o in outs])
    return to_device(torch.from_numpy(rows), outs[0].device)


def _decompress_rows(payload, offsets, sizes, kinds, outs: list, page_size: int,
                     status, sums=None) -> None:
    """Decode the pages of several outputs (``uint8 [n_i * P]`` each, back to back in the
    metadata's order) with one launch pair, each page into its own output: on the GPU the
    decoder takes a table of row addresses; on the CPU the pages are decoded aside and copied.
    ``sums`` (``int32 [pages]``): check the decoded pages against them (:func:`verify`)."""
    if outs[0].is_cuda:
        from ..kernels.lz4_decompress import decompress_rows

        table = _row_table(outs, page_size)
        decompress_rows(payload, offsets, sizes, kinds, table, page_size, status)
        if sums is not None:
            from ..kernels.checksum import row_checksums

            if all(o.data_ptr() % 4 == 0 for o in outs):
                got = torch.empty_like(sums)
                row_checksums(table, page_size, got)
            else:  # the kernel reads 32-bit words: rows of a ragged group's later tensors
                # may start anywhere, so those pages are checked from an aligned copy
                got = _checksums(torch.cat([o.view(-1, page_size) for o in outs]))
            verify(status, got, sums)
        return
    pages = torch.empty((status.numel(), page_size), dtype=torch.uint8)
    _decompress_into(payload, offsets, sizes, kinds, pages, status, sums)
    at = 0
    for o in outs:
        n = o.numel() // page_size
        o.view(n, page_size).copy_(pages[at:at + n])
        at += n


def _decompress_into(payload, offsets, sizes, kinds, pages, status, sums=None) -> None:
    """``pagecomp.decompress_into`` of a slice's own metadata (see :func:`_compress`);
    ``sums`` (``int32 [n]``): then check the decoded pages against them (:func:`verify`)."""
    if pages.is_cuda:
        from ..kernels.lz4_decompress import decompress_into

        decompress_into(payload, offsets, sizes, kinds, pages, status, traced=False)
    else:
        _ops.decompress_into_eager(payload, offsets, sizes, kinds, pages, status)
    if sums is not None:
        verify(status, _checksums(pages), sums)
