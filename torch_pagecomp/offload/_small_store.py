"""``PageCompressor``'s store for small 16-bit float tensors: one encode, one copy, one decode.

The kernel-only store (``_paged.PagedStore``) places each slice in two phases (the GPU plans
where the pages go, the host reads the plan and queues the copy engine's copies) with the
bookkeeping of a virtual arena: an ``offload`` + ``restore`` of a 1 MiB bf16 tensor took
~270 us of host time, 5.5x a pinned copy end to end (#26, ``bench/results/h200_session76``).
A tensor of at most ``SMALL_BYTES`` needs none of that. Per offload, on the compress stream:

* the placed exponent encoder lays the pages end to end in a device scratch (one for the
  store, reused in stream order) and writes their offsets, sizes and kinds ahead of them;
* one copy kernel (``kernels.host_pack.pack_small``) moves the metadata and the pages (their
  byte count read on the device) into a block of page-locked host memory reserved for the
  worst case, and writes that count at the block's head;
* the host, once the offload is done (a poll at a later call, never a wait), reads the count
  and gives the block's unused end back to the arena.

A restore is one launch of the exponent decoder reading the block over the link, on the
caller's stream after a device-side wait for the offload. A freed block goes back to the
arena once the restores queued before the free have read it.

(Session 63's probe, ``bench/dev_zero_copy.py``: the encoder writing host memory page by
page reached only 6.6-7 GB/s, hence the device scratch and the copy kernel's wide stores;
the decoder reading host memory decoded ~45 GB/s, and a 1 MiB restore took 39 us.)

Block layout (``uint8``, 16-byte aligned; the scratch the same): the pages' bytes (``int64``)
and 8 bytes of padding, ``rel`` (``int64 [n]``, each page's offset from the pages' start),
``sizes`` (``int32 [n]``), ``kinds`` (``uint8 [n]``), padding to 16, the partial last page
(``nbytes % P`` raw bytes, padded to 16), then the pages.
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque

import torch

from .. import format as fmt
from .._events import handoff, mark
from ..handles import _bytes_of
from ..kernels.launch import interpreting, launch_cached
from ..pools import HostArena, can_pin
from ._arena import _wait
from ._streams import on_stream

SMALL_BYTES = 4 << 20  # tensors up to this size take this store (the larger, ``PagedStore``)
HEAD = 16  # the header: the pages' bytes (int64), then padding
CHUNK_BYTES = 16 << 20  # page-locked chunks the blocks are carved from


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class SmallStored:
    """One tensor held by a :class:`SmallStore`: its host block and the events that order it.

    ``n`` full pages of ``page_size`` bytes and ``tail`` bytes of a partial last page;
    ``head``: the block's bytes ahead of the pages; ``pages_bytes``: the pages' bytes once
    the host read them (the block trimmed to ``head + pages_bytes``), else None."""

    exp = True

    def __init__(self, nbytes: int, page_size: int, block, done):
        self.nbytes, self.page_size = nbytes, page_size
        self.n, self.tail = divmod(nbytes, page_size)
        self.head = _head(self.n, self.tail)
        self.block, self.base = block, block.addr
        # the copy into the block is done (device event; None on the CPU or once seen done)
        self.done = done
        # per stream that restored it, the latest decode there is done (device events): a free
        # waits for each (the latest alone would let an earlier one on another stream read a
        # block given back)
        self.reads: dict = {}
        self.pages_bytes: int | None = None
        self.freed = False

    def source_read(self) -> bool:
        """The offload is done (never blocks); once seen, ``done`` is dropped, so later
        checks and restores skip it (each query is microseconds of host time)."""
        done = self.done
        if done is None or done.query():
            self.done = None
            return True
        return False

    # an event's interface, for the owner's bound on offloads in flight
    query = source_read

    def synchronize(self) -> None:
        """Block until the offload is done."""
        done = self.done
        if done is not None:
            done.synchronize()
            self.done = None

    def stored(self) -> bool:
        """The pages are in host memory and their size is known (never blocks)."""
        return self.pages_bytes is not None

    def host_nbytes(self) -> int | None:
        """Host bytes held (the block: metadata, partial page, pages) once known, else None."""
        return None if self.pages_bytes is None else self.head + self.pages_bytes

    def kernel_bytes(self) -> tuple[int, int] | None:
        """``(page bytes, stored bytes)`` of the full pages once known, else None."""
        if self.pages_bytes is None:
            return None
        return self.n * self.page_size, self.pages_bytes + 13 * self.n

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rel int64 [n], sizes int32 [n], kinds uint8 [n], pages uint8)`` of the block
        (CPU tensors on its memory; the pages' bytes known or not)."""
        b = stored_view(self.block)
        total = self.pages_bytes if self.stored() else self.n * self.page_size
        return (*_meta(b, self.n), b[self.head:self.head + total])


def stored_view(block) -> torch.Tensor:
    """A block's ``uint8 [nbytes]`` view (made here where it was allocated without one)."""
    if block.tensor is not None:
        return block.tensor
    return block.chunk.mem.tensor[block.offset:block.offset + block.nbytes]


def _head(n: int, tail: int) -> int:
    """Bytes of a block ahead of its pages: header, metadata of ``n`` pages, partial page."""
    return _round16(HEAD + 13 * n) + _round16(tail)


class SmallStore:
    """Tensors of at most ``SMALL_BYTES`` compressed by the exponent codec into page-locked
    blocks (see the module docstring), on ``stream`` (the compress stream; None on the CPU,
    where every call completes before it returns, the kernels in Triton's interpreter).
    Not thread-safe: its owner (``_direct.DirectPath``) calls it under its lock."""

    def __init__(self, device: torch.device, page_size: int, stream):
        self.device, self.page_size, self.stream = device, page_size, stream
        self.index = device.index
        cuda = stream is not None
        # empty chunks are kept (pinned) until :meth:`release_idle` (``empty_cache()``,
        # ``close()``): dropping one unregisters it, which waits for the whole device, inside
        # whichever offload or free emptied it, and the next offload past it pins a chunk
        # again (milliseconds); with one kept, a caller cycling more than two chunks' worth
        # of small tensors paid both every cycle
        self.arena = HostArena(pin=cuda and can_pin(), chunk_bytes=CHUNK_BYTES)
        self.usable = not cuda or self.arena.pin  # the GPU writes the blocks by address
        self.scratch: torch.Tensor | None = None
        self.ends: torch.Tensor | None = None  # the encoder's counters, used in turn
        self.parity = 0
        self._untrimmed: deque[SmallStored] = deque()  # in stream order
        self._freeing: list[SmallStored] = []
        self._launches: dict = {}  # compiled entries (``launch.launch_cached``)
        # each launch's (kernel, settings, argument classes), looked up once (#26: host time)
        self._table = launch_table(page_size) if cuda else {}
        self._programs = None  # the copy kernel's programs for a block's words
        if cuda:
            from ..kernels.host_pack import small_programs

            self._programs = functools.partial(small_programs, interpret=interpreting())

    # ------------------------------------------------------------------ offload
    def offload(self, src: torch.Tensor, fp16: bool, producer) -> SmallStored | None:
        """Store ``src``'s bytes (a contiguous tensor of any dtype and shape, at most
        ``SMALL_BYTES``) after ``producer``'s work; None where the block's memory could not
        be page-locked (the caller stores it another way)."""
        p, cs = self.page_size, self.stream
        nbytes = src.numel() * src.element_size()
        n, tail = divmod(nbytes, p)
        head = _head(n, tail)
        scratch, ends = self._scratch(head + n * p)  # (before the block: nothing to give back)
        block = self.arena.alloc(head + n * p, view=cs is None)
        if cs is not None and not block.chunk.mem.pinned:
            self.arena.free(block)
            return None
        try:
            return self._offload_into(src, fp16, producer, n, tail, head, block, scratch, ends)
        except BaseException:
            self._abandon(block, ends)
            raise

    def _abandon(self, block, ends: torch.Tensor) -> None:
        """After an offload failed between its block's allocation and its last launch: the
        counters zeroed (each pack zeroes the one the next offload starts from: without it, the
        next offload of that parity would lay its pages from a stale offset, past the scratch
        and its block) and the block given back once nothing queued can still write it (the
        stream waited for: an error path)."""
        try:
            if self.stream is not None:
                with on_stream(self.stream):
                    ends.zero_()
                self.stream.synchronize()
            else:
                ends.zero_()
        finally:  # (a sticky CUDA error raises here too: the block is given back all the same)
            self.arena.free(block)

    def _offload_into(self, src, fp16: bool, producer, n: int, tail: int, head: int, block,
                      scratch, ends) -> SmallStored:
        """:meth:`offload`'s encode and copy into ``block`` (allocated for it)."""
        p, cs, nbytes = self.page_size, self.stream, n * self.page_size + tail
        parity = self.parity
        self.parity ^= 1
        if cs is None:
            self._encode_cpu(_bytes_of(src.detach()), n, tail, head, block, scratch, ends,
                             parity, fp16)
            stored = SmallStored(nbytes, p, block, None)
            self.settle(stored)
            return stored
        handoff(producer, cs)
        s, e, index = scratch.data_ptr(), ends.data_ptr(), self.index
        if tail:
            with on_stream(cs):
                at = head - _round16(tail)
                scratch[at:at + tail].copy_(_bytes_of(src.detach())[n * p:])
        if n:
            key, values = encode_at(src.data_ptr(), s, e, n, head, parity, fp16)
            kernel, meta, classes = self._table[key[0]]
            launch_cached(self._launches, key, kernel, (n,), index, meta,
                          lambda: classes(*values), values,
                          lambda: _encode_args(_bytes_of(src.detach()), scratch, ends, n, p,
                                               head, parity), cs)
        upper = head + n * p
        key, values = pack_at(s, block.addr, e, parity, head)
        kernel, meta, classes = self._table["pack"]
        launch_cached(self._launches, key, kernel, (self._programs(upper // 8),), index,
                      meta, lambda: classes(*values), values,
                      lambda: (scratch[:upper], stored_view(block), ends, parity, head // 8), cs)
        stored = SmallStored(nbytes, p, block, mark(cs))
        self._untrimmed.append(stored)
        return stored

    def _encode_cpu(self, src, n, tail, head, block, scratch, ends, parity, fp16) -> None:
        """:meth:`offload`'s kernels on the CPU (the interpreter), through their checked
        launchers."""
        from ..kernels.exp_codec import compress_exp_placed
        from ..kernels.host_pack import pack_small

        p = self.page_size
        if tail:
            scratch[head - _round16(tail):head - _round16(tail) + tail].copy_(src[n * p:])
        if n:
            pages, *out = _encode_args(src, scratch, ends, n, p, head, parity)
            compress_exp_placed(pages, fp16, tuple(out))
        pack_small(scratch[:head + n * p], stored_view(block), ends, parity, head)

    def _scratch(self, nbytes: int):
        """The device scratch (at least ``nbytes``; made larger as needed) and the counters.
        Used on the compress stream only, so a new one is reused after the kernels queued."""
        device = self.device
        if self.ends is None:
            self.ends = torch.zeros(2, dtype=torch.int64, device=device)
            if self.stream is not None:
                self.ends.record_stream(self.stream)
        if self.scratch is None or self.scratch.numel() < nbytes:
            self.scratch = torch.empty(_round16(nbytes), dtype=torch.uint8, device=device)
            if self.stream is not None:  # (made on the caller's stream: its memory goes back
                self.scratch.record_stream(self.stream)  # only after the kernels queued here)
        return self.scratch, self.ends

    # ------------------------------------------------------------------ restore
    def restore(self, stored: SmallStored, out: torch.Tensor, stream) -> torch.Tensor:
        """Decode ``stored`` into ``out`` (a contiguous tensor of ``stored.nbytes`` bytes, any
        dtype and shape, on the device) on ``stream`` (the current one; None on the CPU) after
        its offload; returns the full pages' statuses (``int32 [n]``, written on ``stream``)."""
        p, n = self.page_size, stored.n
        _wait(stream, stored.done)
        status = torch.empty(n, dtype=torch.int32, device=self.device)
        total = stored.pages_bytes if stored.pages_bytes is not None else n * p
        base = stored.base
        if n and stream is not None:
            key, values = decode_at(base, stored.head, n, out.data_ptr(), status.data_ptr(),
                                    total)
            kernel, meta, classes = self._table["decode"]
            launch_cached(self._launches, key, kernel, (n,), self.index, meta,
                          lambda: classes(*values), values,
                          lambda: (*_block_args(stored, total),
                                   _bytes_of(out.detach())[:n * p].view(n, p), status, total),
                          stream)
        elif n:
            from ..kernels.exp_codec import decompress_exp_into

            pages, rel, sizes, kinds = _block_args(stored, total)
            decompress_exp_into(pages, rel, sizes, kinds,
                                _bytes_of(out.detach())[:n * p].view(n, p), status,
                                traced=False)
        if stored.tail:
            at = stored.head - _round16(stored.tail)
            _bytes_of(out.detach())[n * p:].copy_(
                stored_view(stored.block)[at:at + stored.tail], non_blocking=True)
        if stream is not None:
            stored.reads[stream.cuda_stream] = mark(stream)
        return status

    # ------------------------------------------------------------------ host side
    def poll(self) -> None:
        """Trim the blocks of finished offloads (in stream order; never waits) and give back
        the freed blocks no restore reads any more."""
        while self._untrimmed and self._untrimmed[0].source_read():
            self.settle(self._untrimmed.popleft())
        for stored in list(self._freeing):
            if stored.source_read() and all(e.query() for e in stored.reads.values()):
                self.settle(stored)  # (freed before a poll saw it done: its size now)
                # off the list before its block goes back: should anything raise from here
                # (an interrupt), the next poll does not give the block back a second time
                self._freeing.remove(stored)
                self.arena.free(stored.block)

    def settle(self, stored: SmallStored) -> None:
        """Once ``stored``'s offload is done (the caller saw ``done`` complete): read the pages'
        bytes from the block's header (the owner counts it by them, and settles past it) and,
        unless it was freed, give the block's unused end back. A freed block is read before
        :meth:`poll` gives it back, so one given back is never read."""
        if stored.pages_bytes is not None:
            return
        pages = ctypes.c_int64.from_address(stored.base).value
        stored.pages_bytes = pages
        if not stored.freed:
            self.arena.shrink(stored.block, stored.head + pages)

    def free(self, stored: SmallStored) -> None:
        """Give ``stored``'s block back once its offload and the restores queued so far are
        done (:meth:`poll`)."""
        if stored.freed:
            return
        self._freeing.append(stored)
        stored.freed = True
        self.poll()

    def compressed(self, stored: SmallStored) -> fmt.CompressedPages:
        """``stored`` as one packed CPU ``CompressedPages`` (a partial last page becomes a
        RAW page, zero-padded); its offload done (:meth:`settle`)."""
        self.settle(stored)
        rel, sizes, kinds, pages = (t.clone() for t in stored.views())
        payloads, size_parts, kind_parts = [gather_pages(pages, rel, sizes)], [sizes], [kinds]
        if stored.tail:
            at = stored.head - _round16(stored.tail)
            page = torch.zeros(self.page_size, dtype=torch.uint8)
            page[:stored.tail] = stored_view(stored.block)[at:at + stored.tail]
            payloads.append(page)
            size_parts.append(torch.tensor([self.page_size], dtype=torch.int32))
            kind_parts.append(torch.tensor([fmt.KIND_RAW], dtype=torch.uint8))
        return fmt.packed_pages(payloads, size_parts, kind_parts, self.page_size, "exp")

    def release_idle(self) -> None:
        """Free the device scratch and every empty chunk (made again by the next offload)."""
        self.scratch = None
        self.arena.trim()

    def close(self) -> None:
        """Unpin every chunk (the stream waited for by the owner); blocks are not restorable
        afterwards."""
        self.poll()
        self.arena.unpin()
        self.scratch = None

    def stats(self) -> dict:
        a = self.arena.stats()
        return {"small_host_held_bytes": a["held_bytes"], "small_host_used_bytes": a["used_bytes"],
                "small_scratch_bytes": (0 if self.scratch is None else self.scratch.numel())
                + (0 if self.ends is None else 16)}


def gather_pages(blob: torch.Tensor, rel: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The pages at ``blob[rel[i]:rel[i] + sizes[i]]`` (CPU) back to back, in page order."""
    lens = sizes.to(torch.int64)
    ends = torch.cumsum(lens, 0)
    if not ends.numel():
        return torch.empty(0, dtype=torch.uint8)
    shift = torch.repeat_interleave(rel.to(torch.int64) - (ends - lens), lens)
    return blob[torch.arange(int(ends[-1])) + shift]


def launch_table(page_size: int) -> dict:
    """``{name: (kernel, settings, classes)}`` of the small store's launches (``"encode_bf16"``,
    ``"encode_fp16"``, ``"pack"``, ``"decode"``): ``classes(*values)`` gives the argument
    classes of a launch with ``values`` (``launch.known_args``' rule). The kernels' modules
    import Triton, which a CPU install may lack: imported here, for a GPU's store."""
    from ..kernels.exp_codec import into_launches, placed_encode_classes, placed_encode_launch
    from ..kernels.host_pack import small_pack_classes, small_pack_launch
    from ..kernels.lz4_decompress import decode_classes

    (decode,) = into_launches(page_size)
    encode = lambda *a: placed_encode_classes(a)  # noqa: E731 - one of the table's
    return {
        "encode_bf16": (*placed_encode_launch(page_size, False), encode),
        "encode_fp16": (*placed_encode_launch(page_size, True), encode),
        "pack": (*small_pack_launch(), lambda s, d, e, parity, head_words:
                 small_pack_classes((s, d, e), parity, 8 * head_words)),
        "decode": (*decode, lambda *a: decode_classes(a[:6], a[6], False)),
    }


# Each launch's key for its kept entry (``launch.launch_cached``) names what decides its
# arguments' classes, and its values are what the launch takes. The scratch, the counters,
# the statuses and the blocks are 16-byte aligned and the pages' bytes multiples of 16, so
# the classes follow from the source's or output's alignment, n % 4 (the metadata's parts
# start 8n and 12n bytes in), the counter's parity and the head's size in words
# (``tests/test_direct.py`` checks each key against the classes of the tensors' launch).
def encode_at(src: int, scratch: int, ends: int, n: int, head: int, parity: int,
              fp16: bool) -> tuple[tuple, tuple]:
    """``(key, values)`` of the placed encoder's launch: ``n`` pages at address ``src`` into
    the scratch at ``scratch`` (block layout), counter ``ends[parity]``."""
    values = (src, scratch + head, scratch + HEAD + 8 * n, scratch + HEAD + 12 * n,
              scratch + HEAD, ends + 8 * parity)
    return ("encode_fp16" if fp16 else "encode_bf16", src & 15 == 0, n % 4, parity), values


def pack_at(scratch: int, block: int, ends: int, parity: int, head: int) -> tuple[tuple, tuple]:
    """``(key, values)`` of the copy kernel's launch into the block at ``block``."""
    return ("pack", parity, (head // 8) & 15 == 0), (scratch, block, ends, parity, head // 8)


def decode_at(base: int, head: int, n: int, out: int, status: int,
              total: int) -> tuple[tuple, tuple]:
    """``(key, values)`` of the decoder's launch reading the block at ``base`` (its pages'
    ``total`` bytes) into ``out``, statuses into ``status``."""
    values = (base + head, base + HEAD, base + HEAD + 8 * n, base + HEAD + 12 * n, out, status,
              total)
    return ("decode", out & 15 == 0, n % 4, status & 15 == 0), values


def _meta(buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rel, sizes, kinds)`` views of a block-layout buffer for ``n`` pages."""
    return (buf[HEAD:HEAD + 8 * n].view(torch.int64),
            buf[HEAD + 8 * n:HEAD + 12 * n].view(torch.int32), buf[HEAD + 12 * n:HEAD + 13 * n])


def _encode_args(src, scratch, ends, n: int, p: int, head: int, parity: int) -> tuple:
    """The placed encoder's ``(pages, payload, sizes, kinds, rel, end)`` for :meth:`SmallStore
    .offload` (views; the GPU's launches take addresses)."""
    rel, sizes, kinds = _meta(scratch, n)
    return (src[:n * p].view(n, p), scratch[head:head + n * p], sizes, kinds, rel,
            ends[parity:parity + 1])


def _block_args(stored: SmallStored, total: int) -> tuple:
    """``(pages, rel, sizes, kinds)`` of ``stored``'s block for the decoder's checked path."""
    b = stored_view(stored.block)
    rel, sizes, kinds = _meta(b, stored.n)
    return b[stored.head:stored.head + total], rel, sizes, kinds
