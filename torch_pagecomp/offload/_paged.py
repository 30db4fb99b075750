"""Compressed activation storage that needs no host thread and no host sync to offload.

A storage's bytes (``uint8 [nbytes]`` on the GPU) are cut into slices of whole pages, each
placed at the end of a *virtual arena* of page-locked host memory (``_arena``), its page
metadata behind its pages. Per slice, on the offloader's side streams:

* the exponent codec's pages (bf16 / fp16): the encoder lays them end to end in a payload
  buffer (stream ``compress``; ``kernels.exp_codec.compress_exp_placed``), a one-program
  kernel reserves their bytes at the arena's end (stream ``pack``;
  ``kernels.host_pack.place_slice``) and publishes the placement, and the host, once it sees
  that done (a poll, never a wait), queues the copy engine's copies into the arena (stream
  ``send_stream``): the link runs at the copy engine's rate beside the model's kernels;
* LZ4's pages: the compress kernel writes them at a fixed stride, then one kernel of a few
  persistent programs reserves the slice's bytes and copies the pages there
  (``kernels.host_pack.pack_slice``): the compressed size never has to reach the host.

Host memory holds the compressed bytes only (16-byte aligned pages).

A restore is queued on the caller's stream without waiting on the host: when the slice's
placement is known and its bytes are in host memory (the usual case by the time backward
needs it) the copy engine brings its exact bytes back; otherwise a few persistent programs
read them from the chunk after a device-side wait (placement from the device descriptor); a
slice not sent yet (its placement not read) is decoded from the device payload it is still
in. The decoder then expands them. A partial last page (``nbytes % P``) travels as a plain
copy.
"""

from __future__ import annotations

import torch

from .. import _ops
from .._events import handoff, mark
from ..format import CorruptPageError
from . import _decode
from ._arena import (
    CHUNK_BYTES,
    UploadRing,
    VirtualArena,
    _meta_offsets,
    _Slice,
    _wait,
    meta_span,
    slice_meta,
    slice_upper,
)
from ._batch import gpu_memory
from ._copies import copy_spans
from ._statuses import StatusCount
from ._streams import current_stream, on_stream

SLICE_BYTES = 64 << 20  # pages per compress launch: fills the GPU, bounds the scratch; each
# slice costs the host a few kernel launches and copies both ways, so most saved tensors are
# one slice
# The most slices' payloads the GPU holds at once (:meth:`PagedStore._slot`): the first, and
# while the link is behind (the first still holds pages not sent), a second, so that the
# compress of one slice runs while the copy engine sends the one before; the exponent codec's
# pages are sent only once the host has read their placement, so with one payload the link
# waited for each compress and for the host between slices. The second goes once the first is
# free again.
SCRATCH_SLICES = 2
IDLE_SLICES = 2  # slices that found the first payload free before the others' buffers go
BACKLOG_BYTES = CHUNK_BYTES  # bytes on their way to host memory past which due batches wait


class _PayloadSlot:
    """One of :class:`PagedStore`'s payload buffers (up to ``SCRATCH_SLICES``,
    :meth:`PagedStore._slot`), the slice that used it last (a new slice's compress waits
    until that one's pages have left it: its ``stored`` event) and the placed encoder's
    counter (``int64 [1]`` on the device, made with the buffer; each plan sets it to 0)."""

    __slots__ = ("buf", "last", "end", "used")

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.last: _Slice | None = None
        self.end: torch.Tensor | None = None
        self.used = 0  # when a slice last took it (``PagedStore._uses``)


class SliceNotStored(RuntimeError):
    """A slice of a stored tensor did not fit the host arena: its data was not stored."""

    def __init__(self, pages: int):
        super().__init__(f"compressed store: a slice of {pages} pages did not fit the host "
                         "arena; its data was not stored")


def _placed_bytes(slices: list[_Slice], tail) -> int | None:
    """Host bytes of ``slices`` and of the raw ``tail`` (pinned ``uint8``, or None) once every
    slice is placed, else None."""
    if any(sl.base is None for sl in slices):
        return None
    return sum(sl.total for sl in slices) + (tail.numel() if tail is not None else 0)


class PagedStored:
    """One storage held in the arena (see :class:`PagedStore`)."""

    kind = "compressed"

    def __init__(self, nbytes: int, page_size: int, slices: list[_Slice], tail, consumed,
                 tail_sum=None, exp: bool = False):
        self.nbytes, self.page_size, self.slices = nbytes, page_size, slices
        self.exp = exp  # exponent-codec pages (else LZ4): which decoder reads them
        self.tail = tail  # pinned uint8 [nbytes % P] or None
        self.tail_sum = tail_sum  # its checksum (int32 [1], on the device), or None
        self.consumed = consumed  # the source has been read (device event, None on the CPU)
        self.freed = False
        self.kernel: tuple[int, int] | None = None  # kept when freed

    def ready(self) -> bool:
        """The copy is done: every page is in host memory (in a backward the offloader keeps
        a source it served in place until then; in a forward only until
        :meth:`source_read`)."""
        if (self.consumed is not None and self.tail is None and self.slices
                and all(sl.stored is None for sl in self.slices)):
            self.consumed = None  # every pack is confirmed, and the last one waited for it
        return self.source_read() and all(sl.done() for sl in self.slices)

    def source_read(self) -> bool:
        """The source is read: its pages are compressed (the packing may still run), so it
        may be dropped (never blocks)."""
        if self.consumed is not None:
            if not self.consumed.query():
                return False
            self.consumed = None  # done: the kept event (``_events.mark``) is not held
        return True

    def wait_on(self, stream) -> None:
        """``stream`` waits until the source may be dropped: its pages are compressed (the
        packing may still run)."""
        _wait(stream, self.consumed)

    def stored(self) -> bool:
        return all(sl.base is not None for sl in self.slices)

    def failed(self) -> bool:
        return any(sl.base is not None and sl.base < 0 for sl in self.slices)

    def host_nbytes(self) -> int | None:
        """Host bytes held (compressed pages + the raw tail) once placed, else None."""
        return _placed_bytes(self.slices, self.tail)

    def size_when_placed(self):
        """A function that returns :meth:`host_nbytes` once every slice is placed (None
        before), still after this stored tensor is freed: the host ledger's count of a tensor
        freed before its placement was read (the slices stay in the arena's pending queue
        until then anyway)."""
        slices, tail = list(self.slices), self.tail
        return lambda: _placed_bytes(slices, tail)

    def kernel_bytes(self) -> tuple[int, int] | None:
        """``(page bytes, stored bytes)`` of the compressed pages once placed."""
        if self.freed:
            return self.kernel
        if not self.stored():
            return None
        return (sum(sl.n for sl in self.slices) * self.page_size,
                sum(sl.total for sl in self.slices))


def free_each(storeds: list, free) -> None:
    """``free`` each of ``storeds`` (a caller's list, emptied), the last first. Each stays
    listed until freed: should a free raise (an interrupt), the list still holds it and the
    rest, for a later call (a free is idempotent). Taken off by position, not by ``pop()``:
    one appended during a free (a handle's finalizer run by the collector) stays listed."""
    while storeds:
        at = len(storeds) - 1
        free(storeds[at])
        del storeds[at]


class PagedStore:
    """Offload storages compressed into a :class:`VirtualArena` (one per device).

    ``streams``: ``(compress, pack, restore)`` CUDA streams (``None`` on the CPU, where the
    kernels run synchronously: the Triton interpreter in tests). Restores run on the caller's
    current stream; ``restore_stream`` is the stream they are issued on (chunk reuse waits
    for it). ``checksum``: keep each page's checksum (format) on the device beside its
    metadata and check every restored page against it (``STATUS_CHECKSUM``, counted as decode
    failures are); one more read of the pages each way. A partial last page travels as plain
    bytes, checked as one zero-padded page (:func:`tail_checksum`). A placed slice's page
    metadata (13 bytes a page) lies in the arena behind its pages (``_arena._Slice``).
    """

    kind = "compressed"

    def __init__(self, device: torch.device, page_size: int, streams=(None, None, None),
                 chunk_bytes: int = CHUNK_BYTES, slice_bytes: int | None = None,
                 checksum: bool = False):
        if slice_upper(1, page_size, checksum) > chunk_bytes or chunk_bytes % 16:
            raise ValueError(f"chunk_bytes must be a multiple of 16 bytes and hold a page of "
                             f"{page_size} bytes and its metadata "
                             f"({slice_upper(1, page_size, checksum)} bytes), got {chunk_bytes}")
        self.device, self.page_size = device, page_size
        self.checksum = checksum
        self.compress_stream, self.pack_stream, self.restore_stream = streams
        # the copy engine's copies of sent slices into the arena: a stream of their own, so
        # that a copy the host queues starts at once, not behind the plans and packs of later
        # slices (each waiting for its compress). A chunk the copies write is live until they
        # are done (``VirtualArena``), so no other stream's write to it needs to wait for them.
        self.send_stream = (torch.cuda.Stream(device=device) if self.pack_stream is not None
                            else None)
        with on_stream(self.pack_stream):  # the pack kernel reads the arena's state there
            self.arena = VirtualArena(device, chunk_bytes)
        self.arena.sender, self.arena.reader = self.send_stream, self.restore_stream
        # a slice, its metadata with it, is at most a chunk long: it lies in one chunk or two
        # (the pack kernel's rule)
        slice_bytes = SLICE_BYTES if slice_bytes is None else slice_bytes  # (read when made)
        pages = max(1, min(slice_bytes, chunk_bytes) // page_size)
        while pages > 1 and slice_upper(pages, page_size, checksum) > chunk_bytes:
            pages -= 1
        self.slice_pages = pages
        # up to SCRATCH_SLICES payloads, each with the slice that used it last (:meth:`_slot`)
        self._slots = [_PayloadSlot() for _ in range(SCRATCH_SLICES)]
        self._uses = 0  # slices stored so far: each slot's ``used`` is the count at its last
        self.step_peak: int | None = None  # the GPU's peak in the last step (end_step)
        # pages that failed to decode, counted on the device (None on the CPU: raised at once)
        self.statuses = None
        if device.type == "cuda":
            self.statuses = StatusCount(device, self.restore_stream)
            self.pack_stream.synchronize()  # both made before any kernel may use them
            self.restore_stream.synchronize()
        # small tables that restores' kernels read from page-locked memory (row tables)
        self.uploads = UploadRing(pin=self.arena.pin) if device.type == "cuda" else None
        self.scratch_bytes = 0  # bound on the scratch held at once (reported in stats)
        self._scratches: dict[int, tuple] = {}  # element size -> the compress kernel's scratch
        self._lz4_launch: dict[int, tuple] = {}  # element size -> (programs, settings)
        self._scratch_held = 0
        self._handed = None  # the event the latest slice's pack waits for (compress stream)
        if device.type == "cuda":
            from ..kernels.host_pack import link_programs

            self._link_programs = link_programs(device)

    # ------------------------------------------------------------------ offload
    @property
    def takes_parts(self) -> bool:
        """Whether :meth:`offload` reads a list of parts where they lie (on a GPU, without
        checksums, which are taken of contiguous pages)."""
        return self.compress_stream is not None and not self.checksum

    def parts_problem(self, parts: list[tuple[int, torch.Tensor]],
                      float_format: str | None) -> str | None:
        """Why :meth:`offload` cannot read ``parts`` where they lie (with ``float_format``,
        the exponent codec's pages, else LZ4's), or None where it can."""
        if not self.takes_parts:
            return "parts are read where they lie only on a GPU without checksums"
        if not parts:
            return "no parts to store"
        if any(t.numel() % self.page_size for _, t in parts):
            return f"every part must be whole pages of {self.page_size} bytes"
        # LZ4's kernel reads pages as 8-byte words (storages from PyTorch's allocators are
        # aligned; one from elsewhere may not be)
        if float_format is None and any(t.data_ptr() & 7 for _, t in parts):
            return "LZ4 reads parts as 8-byte words: every part must start at a multiple of 8"
        return None

    def offload(self, src: torch.Tensor | list[tuple[int, torch.Tensor]], element_size: int,
                producer=None, float_format: str | None = None) -> PagedStored:
        """Start storing ``src`` (``uint8 [nbytes]``, contiguous) after ``producer``'s work:
        LZ4 pages (bit-shuffled by ``element_size``), or with ``float_format`` (``"bf16"`` /
        ``"fp16"``: what ``src`` holds) the exponent codec's (``torch_pagecomp.exp_codec``).

        Where :meth:`parts_problem` finds none, ``src`` may be a batch's members instead:
        ``(byte offset, uint8 [n_i])`` each, whole pages, back to back. Their pages are
        compressed where they lie, read by address (a table of page addresses, ``ramps``): no
        joined copy, which held a batch's bytes twice while it was made, at the forward's GPU
        peak (``bench/results/h200x2_a242d2b_session56``, ``dev_peak_owners``). The caller
        keeps the members until the source is consumed, as it keeps a contiguous ``src``."""
        p, cs = self.page_size, self.compress_stream
        rows = None
        if isinstance(src, list):
            problem = self.parts_problem(src, float_format)
            if problem is not None:
                raise ValueError(f"compressed store: {problem}")
            counts = [t.numel() // p for _, t in src]
            nbytes = sum(counts) * p
        else:
            nbytes = src.numel()
        full = nbytes // p
        if cs is not None and not self.arena.pin:  # before any state changes
            raise RuntimeError("compressed store: the GPU writes the pages into page-locked "
                               "host memory, which this process cannot allocate "
                               "(torch_pagecomp.pools.can_pin() is False)")
        if cs is not None:
            handoff(producer, cs)
        slices = []
        with on_stream(cs):
            if isinstance(src, list):  # made and read on this stream only
                rows = _decode.ramps([t.data_ptr() for _, t in src], counts, p,
                                     src[0][1].device, self.uploads)
            tail = tail_sum = None
            try:
                for first, n in self._slices(full):
                    slices.append(self._store_slice(src, rows, first, n, element_size,
                                                    float_format))
                if nbytes % p:
                    tail = torch.empty(nbytes % p, dtype=torch.uint8, pin_memory=self.arena.pin)
                    tail.copy_(src[full * p:], non_blocking=True)
                    if self.checksum:
                        tail_sum = _decode.tail_checksum(src[full * p:], p)
            except BaseException:  # the slices stored before the failure have no owner:
                for sl in slices:  # given back as a free would (held for good before)
                    self.arena.release(sl, self.restore_stream)
                raise
            # the last slice's hand-off to the pack stream marks the end of the source's reads
            # when nothing followed it on this stream: one event recorded, not two
            consumed = self._handed if tail is None and slices else mark(cs)
        return PagedStored(nbytes, p, slices, tail, consumed, tail_sum,
                           exp=float_format is not None)

    def stores_now(self, nbytes: int) -> bool:
        """Whether :meth:`offload` of ``nbytes`` would start without the host waiting for
        slices in flight to be placed, and without more than ``BACKLOG_BYTES`` queued for the
        link before it: false when the arena's chunks are spoken for by the worst cases of
        slices not yet placed, when the next slice's payload still holds pages whose
        placement the GPU has not published, or when the bytes on their way to host memory
        pass ``BACKLOG_BYTES`` (the link is behind the host). A due batch then stays held on
        the GPU (``_batch``), where the backward reads it in place, sparing the host a store
        and a restore. (The pack kernel's slices counted as in flight until packed, so this
        held batches while the link was behind; the copy engine's are placed once planned,
        and without the backlog bound every due batch was stored. With it, interleaved on one
        H200, BERT-large, ViT-B/16, GPT-2 and encoder-2048 ran 5-10 points faster; encoder-1024
        did not, its deferred batches stored at a later saved tensor all the same,
        ``bench/results/h200_session61``.)"""
        return self.refusal(nbytes) is None

    def refusal(self, nbytes: int) -> str | None:
        """Why :meth:`stores_now` of ``nbytes`` is false: ``"room"`` (the arena's chunks are
        spoken for by slices not yet placed), ``"backlog"`` (more than ``BACKLOG_BYTES`` on
        their way to host memory) or ``"payload"`` (the next slice's payload holds pages
        whose placement the GPU has not published: the GPU, not the link, is behind the
        host); None where the store starts now. The hooks count each refusal by its reason
        (``refused_<reason>``)."""
        arena = self.arena
        if not arena.room_now(self.worst_case(nbytes)):  # (confirms what it can first)
            return "room"
        if arena.backlog() > BACKLOG_BYTES:
            return "backlog"
        last = self._slots[0].last
        return None if last is None or last.send is None or last.known() else "payload"

    def worst_case(self, nbytes: int) -> int:
        """The arena bytes :meth:`offload` of ``nbytes`` backs before its slices are placed:
        each slice's :func:`slice_upper`, as ``_store_slice`` backs it (the pages alone, before
        the metadata went behind them, said there was room where backing then waited)."""
        return sum(slice_upper(n, self.page_size, self.checksum)
                   for _, n in self._slices(nbytes // self.page_size))

    def _slices(self, pages: int):
        """``(first page, pages)`` of each slice ``pages`` whole pages are stored in."""
        most = self.slice_pages
        return ((first, min(most, pages - first)) for first in range(0, pages, most))

    def _store_slice(self, src, rows: torch.Tensor | None, first: int, n: int,
                     element_size: int, float_format: str | None) -> _Slice:
        """Compress pages ``first .. first + n`` of ``src`` (read through the row table
        ``rows`` where given) and place them in the arena: the exponent codec's pages laid end
        to end by the encoder and sent by the copy engine once the host has read where they go
        (:meth:`VirtualArena.confirm`), LZ4's packed by a kernel."""
        p, cs, ps, arena = self.page_size, self.compress_stream, self.pack_stream, self.arena
        slot = self._slot(n * p)
        last = slot.last
        if last is not None:
            if last.send is not None:
                # its copies queued: the wait below is for them
                arena.confirm(through=last, why="payload")
            # bound the scratch in flight: the payload's last pages have left it by then, and
            # a restore that decoded them from it (``restore``) is done reading
            _wait(cs, last.stored)
            _wait(cs, last.read)
        device = (src if rows is None else rows).device
        payload = self._payload(slot, n, device)
        # the metadata the restore needs (:func:`_meta_bytes`), copied into the arena behind
        # the pages and let go from the device once the slice is placed
        meta = torch.empty(meta_span(n, self.checksum), dtype=torch.uint8, device=device)
        sl = _Slice(first, n, meta, self.checksum)
        # on the GPU the kernels take addresses (views cost the host microseconds apiece, and
        # this runs for every saved tensor); views are made only where a path needs them
        m = meta.data_ptr()
        rel, desc, sizes, kinds, _ = (m + o if o is not None else None
                                      for o in _meta_offsets(n, self.checksum))
        placed = float_format is not None  # end to end, for the copy engine
        self._compress_slice(src, rows, sl, payload, (sizes, kinds, rel),
                             slot.end if placed else None, element_size, float_format)
        try:
            k, upper = self._place_slice(src, sl, slot, payload, placed,
                                         (m, rel, desc, sizes))
        except BaseException:
            if placed:  # the placement never read and zeroed the encoder's counter: the
                # slot's next slice would lay its pages from this one's end, past its payload
                with on_stream(cs):
                    slot.end.zero_()
            raise
        arena.parity ^= 1  # the next slice's (only once this one's kernel is queued)
        stored = mark(ps)
        if ps is not None:  # made on the compress stream, read here (and by a sent slice's
            meta.record_stream(ps)  # copy, which is done before the slice lets it go)
        slot.last = sl
        sl.host_desc, sl.stored = k, stored
        sl.send = payload if placed else None  # held until its copies are queued
        arena.add(sl, upper)
        return sl

    def _place_slice(self, src, sl: _Slice, slot: _PayloadSlot, payload: torch.Tensor,
                     placed: bool, addrs: tuple) -> tuple[int, int]:
        """:meth:`_store_slice`'s part from its compress to the launch that places the slice's
        pages in the arena (the exponent codec's, :meth:`_place`) or packs them there (LZ4's);
        ``addrs``: the addresses of the slice's metadata, its ``rel``, descriptor and sizes.
        Returns ``(descriptor slot, arena bytes backed)``. The arena's host state is left
        valid should it raise: chunks backed for it stay backed."""
        first, n, p = sl.first, sl.n, self.page_size
        cs, ps, arena, meta, device = (self.compress_stream, self.pack_stream, self.arena,
                                       sl.meta, payload.device)
        m, rel, desc, sizes = addrs
        if self.checksum:
            _decode.checksums(_pages(src, first, n, p), sl.sums)
        self.scratch_bytes = max(self.scratch_bytes,
                                 len(self._slots) * n * p + self._scratch_held)
        if ps is not None:  # the pack stream waits for the compress kernel
            self._handed = mark(cs)
            ps.wait_event(self._handed)
        k = arena.host_desc()
        upper = slice_upper(n, p, self.checksum)
        arena.back(upper, ps)
        parity, limit = arena.parity, arena.limit
        if placed:
            self._place(sl, slot.end, k, parity, limit, desc)
        elif ps is not None:
            from ..kernels.host_pack import pack_slice_at

            # page-locked host memory is read and written at its host address (unified
            # addressing: the arena's chunk table holds host addresses too)
            pack_slice_at(device.index, ps, min(n, self._link_programs), n, p, arena.chunk,
                          (payload.data_ptr(), sizes, rel, arena.state.data_ptr(), desc,
                           arena.desc_addr(k), arena.table.data_ptr(), m), arena.table.numel(),
                          parity, limit, (meta.numel(), desc - m),
                          lambda: (_rows(payload, n, p), sl.sizes, sl.rel, arena.state, sl.desc,
                                   arena.descs[k], arena.table, meta, n, parity, limit,
                                   meta.numel(), desc - m))
        else:
            from ..kernels.host_pack import pack_slice

            pack_slice(_rows(payload, n, p), sl.sizes, sl.rel, arena.state, parity, limit, sl.desc,
                       arena.descs[k], arena.table, arena.chunk, meta, desc - m)
        return k, upper

    def _place(self, sl: _Slice, end: torch.Tensor, k: int, parity: int, limit: int,
               desc: int) -> None:
        """Reserve ``sl``'s pages, laid end to end by the placed encoder (``end``: their
        bytes), and its metadata at the arena's end, on the pack stream
        (``kernels.host_pack.place_slice``), publishing the placement to descriptor ``k`` and
        to the slice's device descriptor (at address ``desc``)."""
        arena, ps, meta = self.arena, self.pack_stream, sl.meta
        if ps is None:
            from ..kernels.host_pack import place_slice

            place_slice(end, arena.state, parity, limit, sl.desc, arena.descs[k], arena.chunk,
                        meta.numel())
            return
        from ..kernels.host_pack import place_slice_at

        place_slice_at(meta.device.index, ps,
                       (end.data_ptr(), arena.state.data_ptr(), desc, arena.desc_addr(k)),
                       parity, limit, meta.numel(), arena.chunk,
                       lambda: (end, arena.state, sl.desc, arena.descs[k], parity, limit,
                                meta.numel()))

    def _compress_slice(self, src, rows: torch.Tensor | None, sl: _Slice, payload,
                        addrs: tuple, end: torch.Tensor | None, element_size: int,
                        float_format: str | None) -> None:
        """Compress ``sl``'s pages of ``src`` (through the row table ``rows`` where given)
        into ``payload`` and ``sl``'s sizes and kinds (at ``addrs``: ``(sizes, kinds, rel)``)
        on the current stream: the exponent codec's end to end (``end``: the payload's
        counter; ``rel`` written), LZ4's at a fixed stride. On the GPU the kernels by
        address; on the CPU LZ4 by the ops' reference path, the exponent codec by its kernel
        (the interpreter)."""
        first, n, p = sl.first, sl.n, self.page_size
        sizes, kinds, rel = addrs
        if float_format:
            from ..kernels.exp_codec import compress_exp_placed, compress_exp_placed_at

            fp16 = float_format == "fp16"
            if not (src if rows is None else rows).is_cuda:
                compress_exp_placed(_pages(src, first, n, p), fp16,
                                    (payload[:n * p], sl.sizes, sl.kinds, sl.rel, end))
                return
            pages = (rows.data_ptr() + 8 * first if rows is not None
                     else src.data_ptr() + first * p)
            compress_exp_placed_at(
                end.device.index, n, p, fp16, rows is not None,
                (pages, payload.data_ptr(), sizes, kinds, rel, end.data_ptr()),
                lambda: ((rows[first:first + n] if rows is not None else _pages(src, first, n, p)),
                         _rows(payload, n, p), sl.sizes, sl.kinds, sl.rel, end))
        elif rows is not None:
            self._compress_rows(rows, sl, payload, (sizes, kinds), element_size)
        elif src.is_cuda:
            from ..kernels.lz4_compress import compress_at

            scratch = self._scratch(src, element_size)
            programs, meta_of = self._lz4_launch[element_size]
            # the pages' offset in ``src``'s storage (at its start) decides the shuffle's
            # load width, as ``compress_pages`` reads it from a view
            compress_at(src.device.index, min(n, programs), n, meta_of[first * p % 8 == 0],
                        (src.data_ptr() + first * p, payload.data_ptr(), sizes, kinds,
                         scratch[0].data_ptr(), scratch[1].data_ptr()),
                        lambda: (_pages(src, first, n, p), _rows(payload, n, p), sl.sizes,
                                 sl.kinds, *scratch, n))
        else:
            _compress(_pages(src, first, n, p), element_size,
                      (_rows(payload, n, p), sl.sizes, sl.kinds))

    def _compress_rows(self, rows: torch.Tensor, sl: _Slice, payload, addrs: tuple,
                       element_size: int) -> None:
        """:meth:`_compress_slice` of LZ4 pages read through the row table ``rows``."""
        from ..kernels.lz4_compress import compress_config, compress_rows_at

        first, n, p = sl.first, sl.n, self.page_size
        sizes, kinds = addrs
        at, index = rows.data_ptr() + 8 * first, rows.device.index
        scratch = self._scratch(rows, element_size)
        programs = self._lz4_launch[element_size][0]
        compress_rows_at(index, min(n, programs), n, compress_config(p, element_size),
                         (at, payload.data_ptr(), sizes, kinds, scratch[0].data_ptr(),
                          scratch[1].data_ptr()),
                         lambda: (rows[first:first + n], _rows(payload, n, p), sl.sizes,
                                  sl.kinds, *scratch, n))

    def _pick(self, nbytes: int) -> _PayloadSlot:
        """The payload slot the next slice (``nbytes`` of pages) takes: the first whose last
        slice's pages have left it (the first slot before the others), else the one used
        longest ago (its pages leave first); a slot other than the first only where it holds
        a buffer already or one fits under the GPU's peak (:meth:`_below_peak`)."""
        for i, slot in enumerate(self._slots):
            if slot.last is None or slot.last.done():
                if i == 0 or slot.buf is not None or self._below_peak(nbytes):
                    return slot
        return min((s for i, s in enumerate(self._slots)
                    if i == 0 or s.buf is not None), key=lambda s: s.used)

    def _below_peak(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of GPU memory now stay under the peak that the caching
        allocator reached in the last step (:meth:`end_step`; False before one ended, and off
        a GPU)."""
        if self.step_peak is None:
            return False
        counts = gpu_memory(self.device)
        return counts is not None and counts[0] + nbytes <= self.step_peak

    def end_step(self) -> None:
        """At the end of a step (the offloader's backward): note the GPU's peak since its
        last reset (the step's, where the caller resets it each step), under which the next
        steps may hold a second payload (:meth:`_slot`)."""
        counts = gpu_memory(self.device)
        self.step_peak = None if counts is None else counts[1]

    def _slot(self, nbytes: int) -> _PayloadSlot:
        """:meth:`_pick`, marked used. A second payload is taken only while the link is behind
        (the first still holds pages not sent) and only under the GPU's peak of the last step;
        held for a whole forward, two raised ResNet-50's GPU peak above a plain copy's (1.350
        against 1.315 GiB, one H200, ``bench/results/h200_session61``). It goes once
        ``IDLE_SLICES`` slices in a row found the first free (not at the first: a tensor of
        two slices takes it for its second slice, and would make it again for every tensor),
        or once it is idle and no longer fits under that peak."""
        slot = self._pick(nbytes)
        self._uses += 1
        slot.used = self._uses
        for other in self._slots[1:]:
            if other is slot or other.buf is None:
                continue
            if other.last is not None and not other.last.done():
                continue
            if (slot is self._slots[0] and self._uses - other.used >= IDLE_SLICES
                    or not self._below_peak(0)):
                other.buf = None  # (freed after the streams that used it: record_stream)
        return slot

    def _payload(self, slot: _PayloadSlot, n: int, device: torch.device) -> torch.Tensor:
        """A flat ``uint8`` buffer of at least ``n * P`` bytes for a slice's compressed pages
        (LZ4's at a fixed stride, the exponent codec's end to end from its start; the GPU's
        launches take its address, :func:`_rows` views it as pages): ``slot``'s buffer
        (:meth:`_slot`), whose last slice's pages the compress stream waits to have left it
        (a view of it per slice cost ~5 us of host time, once per stored slice). A payload of
        the caching allocator per slice, read on the pack stream (``record_stream``), cost
        the hooks 3-6 ms of host time a step under FSDP2 (sampled,
        ``bench/results/h200x2_91fcaaa_session49``).
        A buffer is made again where a slice needs more than it holds or less than half of
        it: kept at the largest slice so far, the ring held a ResNet-50's first 64 MiB slices
        through the whole forward, its GPU peak 0.07-0.08 GiB higher than with a payload per
        slice, above a plain copy's under FSDP2 (same folder; this rule is not measured there
        yet)."""
        p, buf = self.page_size, slot.buf
        if slot.end is None:  # (kept for the store's life: each plan leaves it at 0)
            slot.end = torch.zeros(1, dtype=torch.int64, device=device)
        if buf is None or not n * p <= buf.numel() <= 2 * n * p:
            buf = slot.buf = torch.empty(n * p, dtype=torch.uint8, device=device)
            if self.pack_stream is not None:  # freed (replaced, released) after its packs
                buf.record_stream(self.pack_stream)  # and copies (queued before: a sent
                buf.record_stream(self.send_stream)  # slice holds it until then)
        return buf

    def release_payloads(self) -> None:
        """Let the payload buffers go (:meth:`_payload`; made again by the next slice), with
        the rest of the scratch as a backward starts (:meth:`release_scratch`), which stores
        little, so that their GPU memory is not held through it. Freed after the packs queued
        so far."""
        for slot in self._slots:
            slot.buf = None

    def _scratch(self, src: torch.Tensor, element_size: int):
        """The GPU compress kernel's working memory for ``element_size`` (kept for the store's
        life, used on its compress stream only, so launches reuse it in order)."""
        scratch = self._scratches.get(element_size)
        if scratch is None:
            from ..kernels.lz4_compress import compress_config, compress_scratch, known_settings

            cfg = compress_config(self.page_size, element_size)
            # its launch settings beside it: programs, and the settings by 8-byte alignment
            self._lz4_launch[element_size] = known_settings(src.device, cfg)
            scratch = compress_scratch(src.device, cfg, self._lz4_launch[element_size][0])
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
        self.release_payloads()
        self._scratch_held = 0
        self.scratch_bytes = 0

    def release_idle(self) -> None:
        """Give back what an idle store holds: its GPU scratch (:meth:`release_scratch`) and
        every host chunk no stored tensor needs (``VirtualArena.release_idle``). For an
        offloader that settled on copying; the next compressed slice makes them again."""
        self.arena.release_idle(self.restore_stream)
        self.release_scratch()

    # ------------------------------------------------------------------ restore
    def restore(self, stored: PagedStored, out: torch.Tensor, count: bool = True
                ) -> torch.Tensor:
        """Decode ``stored`` into ``out`` (``uint8 [nbytes]``) on the current stream, after
        its pack (a device-side wait: the host learns nothing and waits for nothing). A slice
        whose copies into the arena are not queued yet (its placement not read: a restore
        right after the offload, as a KV cache's or a ``PageCompressor``'s can be) is decoded
        from the device buffer its pages are still in (``_Slice.send``), after its plan,
        rather than the host waiting for the placement, sending the slice down and fetching
        it back up. Returns
        the pages' statuses (``int32``, one per full page, then the partial last page's with
        ``checksum``), which ``count`` adds to :meth:`failed_restores` (then they may lie in
        a buffer the store reuses: only a caller that counts them itself reads them)."""
        from ..kernels.host_pack import fetch_from_host

        p, arena = self.page_size, self.arena
        stream = current_stream(out.device) if out.is_cuda else None  # on out's device
        arena.confirm()  # the placements known by now (never waits)
        full = stored.nbytes // p  # the slices' pages; the partial tail travels as bytes
        checked_tail = stored.tail_sum is not None
        # with ``count``, the restore stream's statuses come from the store's ring
        status, hand = (self._status(full + checked_tail, stream, out.device) if count else
                        (torch.empty(full + checked_tail, dtype=torch.int32, device=out.device),
                         False))
        by_address = _by_address(out) and not self.checksum
        for sl in stored.slices:
            if sl.base is not None and sl.base < 0:
                raise SliceNotStored(sl.n)
            meta_at = None  # where the staging buffer holds the slice's metadata, if it does
            in_place = sl.send is not None
            if in_place:  # not sent: its pages end to end in the device payload
                _wait(stream, sl.stored)  # (after the plan, itself after the compress)
                staging, total = sl.send, sl.n * p
                if stream is not None:  # (a payload let go is reused after this restore)
                    staging.record_stream(stream)
            elif sl.base is not None:  # placed: the copy engine, the metadata with the pages
                total = meta_at = sl.meta_at
                staging = torch.empty(sl.total, dtype=torch.uint8, device=out.device)
                copy_spans(staging, arena.spans(sl.base, sl.total))
            else:  # still packing: kernels read it once the pack is done
                _wait(stream, sl.stored)
                total = sl.n * p
                staging = torch.empty(slice_upper(sl.n, p, sl.checksum), dtype=torch.uint8,
                                      device=out.device)
                fetch_from_host(staging, sl.desc, arena.table, arena.chunk)
            if by_address:
                if stream is not None and meta_at is None:  # the device's metadata, let
                    sl.meta.record_stream(stream)  # go once the slice is placed
                _decode.decode_slice_at(sl, staging, total, meta_at, out, status, p, stored.exp)
            else:
                pages = out[sl.first * p:(sl.first + sl.n) * p].view(sl.n, p)
                st = status[sl.first:sl.first + sl.n]
                rel, sizes, kinds, sums = slice_meta(sl, staging, 0, stream)
                _decode._decompress_into(staging, rel, sizes, kinds, pages, st, sums, stored.exp)
            if in_place:  # the next slice into its payload waits for this read
                _wait(stream, sl.read)  # (and for an earlier one's, on another stream)
                sl.read = mark(stream)
        if stored.tail is not None:  # its status (if checked) follows the pages'
            _decode.restore_tail(stored, out[stored.nbytes - stored.tail.numel():], stream,
                                 status[full:])
        if status.numel() and hand:
            self._count_failures(status, stream)
        if stream is None:
            arena.confirm()
        return status

    def restore_group(self, group, out) -> None:
        """Decode the stored tensors of ``group`` (a ``_paged_group.StoredGroup``, which keeps
        the metadata of its placed tensors between calls: a KV cache layer's blocks) with a
        constant number of launches, back to back into ``out`` (``uint8 [group.nbytes]``) or
        into a list of one output per stored tensor (see ``_paged_group``)."""
        from ._paged_group import restore_group

        restore_group(self, group, out)

    def send_now(self, slices: list[_Slice]) -> None:
        """Read the placements known by now (never waits), then queue the copies into the
        arena of any of ``slices`` whose copies are not queued yet, the host waiting for their
        placement: a restore reads a slice from the arena (by the copy engine once placed,
        else by kernels after a device-side wait on its copies)."""
        self.arena.confirm()
        unsent = [sl for sl in slices if sl.send is not None]
        if unsent:
            self.arena.confirm(through=unsent[-1], why="restore")

    def wait_placed(self) -> None:
        """Wait until every slice stored so far is placed and confirmed (exact host sizes),
        its bytes in host memory."""
        if self.arena.pending:
            self.arena.confirm(through=self.arena.pending[-1][0])
        self.arena.settle()

    def close(self) -> None:
        """Wait for this store's streams, then unpin every chunk. Stored tensors are not
        restorable afterwards; the store must not be used again."""
        for s in (self.compress_stream, self.pack_stream, self.restore_stream, self.send_stream):
            if s is not None:
                s.synchronize()
        self.arena.confirm()  # (may queue copies of slices still unsent: waited for below)
        self.arena.settle()
        if self.uploads is not None:
            self.uploads.release()
        for mem in self.arena.backed.values():
            mem.release()
        self.arena.backed.clear()
        self.arena.trim()
        self.release_scratch()  # the compress kernels' scratch and the payloads

    def _count_failures(self, status: torch.Tensor, stream) -> None:
        """Count the failed pages of ``status`` (written on ``stream``): on the CPU at once
        (raised), on a GPU with the others held (``_statuses.StatusCount.add``)."""
        if stream is None:  # the CPU: known at once
            bad = int(torch.count_nonzero(status))
            if bad:
                raise CorruptPageError([], [], f"{bad} offloaded page(s) failed to decode")
            return
        self.statuses.add(status, stream)

    def _status(self, pages: int, stream, device: torch.device) -> tuple[torch.Tensor, bool]:
        """``(int32 [pages] on device for a restore's statuses written on stream, whether the
        caller counts them with _count_failures)``: the restore stream's come from the ring
        (``_statuses.StatusCount.take``), counted with no more said."""
        if stream is not None and self.statuses is not None:
            status = self.statuses.take(pages, stream)
            if status is not None:
                return status, False
        return torch.empty(pages, dtype=torch.int32, device=device), True

    def failed_restores(self) -> int:
        """Pages that failed to decode in restores so far, as far as the host knows (never
        blocks)."""
        return 0 if self.statuses is None else self.statuses.failed()

    # ------------------------------------------------------------------ lifetime
    def poll(self) -> None:
        """Confirm the placement of finished slices (no waiting)."""
        self.arena.confirm()

    def free(self, stored: PagedStored) -> None:
        for sl in stored.slices:
            self.arena.release(sl, self.restore_stream)
        stored.kernel = stored.kernel_bytes()  # what the class policy may still read
        stored.slices = []
        stored.tail = stored.tail_sum = None
        stored.freed = True

    def free_after_restores(self, storeds: list[PagedStored]) -> None:
        """Free (and empty) ``storeds`` once the restores queued on the restore stream so far
        have read them: their metadata was allocated on the compress and pack streams, which
        reuse it only after those restores."""
        if self.restore_stream is not None:
            handoff(self.restore_stream, self.compress_stream)
            handoff(self.restore_stream, self.pack_stream)
        free_each(storeds, self.free)

    def stats(self) -> dict:
        a = self.arena
        return {
            "host_used_bytes": a.used,
            "host_held_bytes": a.held_bytes,
            "host_peak_held_bytes": a.peak_held,
            "host_peak_used_bytes": a.peak_used,
            "scratch_bytes": self.scratch_bytes,
            # the restore stream's decode statuses (``_statuses``), held for the store's life
            "status_bytes": 0 if self.statuses is None else self.statuses.ring_bytes,
            "pending_slices": len(a.pending),
            "host_wait_us": round(a.wait_s * 1e6),
            "host_wait_us_by": {k: round(v * 1e6) for k, v in a.wait_by.items()},
        }


def _pages(src: torch.Tensor, first: int, n: int, p: int) -> torch.Tensor:
    """Pages ``[first, first + n)`` of ``src`` (``uint8``) as ``uint8 [n, p]``."""
    if first == 0 and src.numel() == n * p:
        return src.view(n, p)  # one op, not two
    return src[first * p:(first + n) * p].view(n, p)


def _rows(payload: torch.Tensor, n: int, p: int) -> torch.Tensor:
    """The first ``n`` pages of a payload buffer (``uint8``, flat) as ``uint8 [n, p]``: made
    only where a launcher takes views (the CPU's, and a launch's first, which compiles); the
    GPU's launches take the buffer's address."""
    return payload[:n * p].view(n, p)


def _compress(pages: torch.Tensor, element_size: int, out: tuple) -> None:
    """``pagecomp.compress`` (LZ4) of CPU pages the store cut itself, written into ``out``
    (``payload, sizes, kinds``): the op's reference path (on the GPU the store launches the
    kernels by address, and the exponent codec's pages go through its placed kernel:
    ``PagedStore._compress_slice``)."""
    _ops.compress_cpu_direct(pages, element_size, None, out)


def _by_address(out: torch.Tensor) -> bool:
    """Whether a restore into ``out`` launches its decoders by address (the GPU's direct
    launches; the CPU's checked launchers take views)."""
    return out.is_cuda
