"""Compressed pages straight into page-locked host memory, placed on the device.

The activation offload stores each slice of compressed pages in a *virtual arena*: a byte
range ``[0, 2**63)`` cut into chunks of ``CHUNK`` bytes, each backed (by the host, ahead of
use) by a buffer of page-locked host memory whose address sits in a table the kernels read.
The device keeps the arena's end; the host never needs a slice's size to place or copy it,
so nothing waits for the host between a compress kernel and the bytes landing in host memory.

One kernel per slice, :func:`pack_slice`, a few persistent programs on one stream:

* plan (every program alike, so none waits for another): pads each page's size to ``ALIGN``
  bytes, scans them to per-page offsets, and reserves the slice's bytes at the arena's end.
  If the reservation would pass the backed limit it reserves nothing and marks the slice
  failed. Program 0 writes ``desc = (base, total)`` to the device and to a host
  descriptor, and the new end. The end lives in two slots used in turn (slice ``k`` reads
  slot ``k % 2``, writes the other), so no program reads a slot that its own launch writes;
  the launch before, on the same stream, finished writing it.
* pack: copies each page's stored bytes from the fixed-stride payload to arena byte
  ``base + offset``, 16-byte aligned words; stores from a handful of SMs keep the link busy
  while the rest of the GPU computes.
* metadata (with ``meta``): the slice's page offsets, then its sizes, kinds and checksums as
  the compress wrote them, behind the pages in one chunk (the next one where they would
  cross a boundary), so the host keeps a placed slice's metadata where its pages are and the
  GPU keeps none; the reservation and ``total`` include it.

A slice may straddle two chunks (it is at most one chunk long): the arena is filled end to
end. When slices had to fit inside one chunk, a slice whose compressed bytes did not fit the
rest of a chunk moved to the next one and left the rest empty; with slices of up to a chunk
that emptied about a third of every chunk, and the arena held as much page-locked memory as
an uncompressed copy (``bench/results/h200_2dfbc6f_arena``). Each program reads the two
chunk addresses once per slice; a page that crosses the boundary is copied in two parts.

(Planning in the same launch spares the host a second launch per slice, a cost the activation
hooks would pay for every saved tensor.)

:func:`place_slice` is the plan alone, for pages the exponent encoder already laid end to end
on the device (``exp_codec.compress_exp_placed``): the host reads the placement and the copy
engine moves the bytes, at the link's rate and without SMs (``torch_pagecomp.offload._arena``).

A slice comes back the same way: :func:`fetch_from_host` (a few persistent programs) reads
its ``total`` bytes from the chunk into a device buffer, taking ``base``/``total`` from the
device descriptor, and the decoder reads them with the per-page offsets (relative to
``base``); see ``torch_pagecomp.offload._paged``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import (
    frozen_meta,
    int_class,
    interpreting,
    launch,
    launch_known,
    ptr_class,
)

ALIGN = 16  # bytes: every page starts 16-byte aligned in host memory (vector stores)
PLAN_BLOCK = 1024  # pages scanned per step of the plan
PACK_WORDS = 256  # 8-byte words per copy step (2 KiB, 16 bytes per lane of 4 warps)
PACK_WARPS = 4


@triton.jit
def _copy_words(dst, src, words, WORDS: tl.constexpr):
    """``words`` 8-byte words from ``src`` to ``dst`` (both ``int64`` pointers)."""
    w = tl.arange(0, WORDS)
    for w0 in range(0, words, WORDS):
        idx = w0 + w
        m = idx < words
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)


@triton.jit
def _slice_chunks(table_ptr, base, total, CHUNK: tl.constexpr, TABLE: tl.constexpr):
    """``(first, second, split)``: word pointers to the slice's bytes in the chunk its
    ``base`` lies in and in the next one (read from the table only if the slice reaches it),
    and the slice's word at which the second chunk starts. Word ``i`` of the slice is
    ``first + i`` below ``split``, ``second + (i - split)`` from it."""
    k = base // CHUNK
    at = base % CHUNK
    first = tl.load(table_ptr + k % TABLE).to(tl.pointer_type(tl.int64)) + at // 8
    crosses = at + total > CHUNK
    second = tl.load(table_ptr + (k + 1) % TABLE, mask=crosses, other=0)
    return first, second.to(tl.pointer_type(tl.int64)), (CHUNK - at) // 8


@triton.jit
def _padded_sizes(sizes_ptr, idx, m, P: tl.constexpr, ALIGN: tl.constexpr):
    """The bytes each page ``idx`` takes in the arena: its stored size, clamped to a row and
    padded to ``ALIGN``."""
    size = tl.load(sizes_ptr + idx, mask=m, other=0).to(tl.int64)
    size = tl.minimum(tl.maximum(size, 0), P)  # never copy past a row
    return (size + (ALIGN - 1)) // ALIGN * ALIGN


@triton.jit
def _reserve(ends_ptr, parity, limit, pages, meta_bytes, CHUNK: tl.constexpr):
    """``(base, meta_at, end, ok)`` of a slice of ``pages`` bytes of pages and ``meta_bytes``
    of metadata at the arena's end (slot ``parity`` of ``ends``): the metadata follows the
    pages within one chunk (moved to the next one where it would cross: the host reads it
    there as one buffer once the slice is placed); ``ok`` where it all stays under
    ``limit``."""
    base = tl.load(ends_ptr + parity)
    meta_at = base + pages
    meta_at = tl.where(meta_at % CHUNK + meta_bytes > CHUNK, (meta_at // CHUNK + 1) * CHUNK,
                       meta_at)
    end = meta_at + meta_bytes
    return base, meta_at, end, end <= limit


@triton.jit
def _publish(ends_ptr, parity, desc_ptr, host_desc_ptr, base, end, ok):
    """Store the arena's new end (unchanged where the slice did not fit) in the other slot of
    ``ends`` and ``(base, total)`` (``base = -1`` where it did not fit) in both descriptors."""
    tl.store(ends_ptr + (1 - parity), tl.where(ok, end, base))
    placed = tl.where(ok, base, -1)
    tl.store(desc_ptr, placed)
    tl.store(desc_ptr + 1, end - base)
    tl.store(host_desc_ptr, placed)
    tl.store(host_desc_ptr + 1, end - base)


@triton.jit
def _pack_slice_kernel(payload_ptr, sizes_ptr, rel_ptr, ends_ptr, desc_ptr, host_desc_ptr,
                       table_ptr, meta_ptr, n, parity, limit, meta_bytes, meta_from,
                       P: tl.constexpr, CHUNK: tl.constexpr, TABLE: tl.constexpr,
                       ALIGN: tl.constexpr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # plan: the same in every program; each stores the offsets of the pages it copies
    carry = tl.zeros((), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        m = idx < n
        padded = _padded_sizes(sizes_ptr, idx, m, P, ALIGN)
        incl = tl.cumsum(padded, 0)
        tl.store(rel_ptr + idx, carry + incl - padded, mask=m & (idx % programs == pid))
        carry += tl.sum(padded, 0)
    base, meta_at, end, ok = _reserve(ends_ptr, parity, limit, carry, meta_bytes, CHUNK)
    if pid == 0:
        _publish(ends_ptr, parity, desc_ptr, host_desc_ptr, base, end, ok)
    tl.debug_barrier()  # this program's offsets, stored by its threads, read back below
    if ok:
        first, second, split = _slice_chunks(table_ptr, base, carry, CHUNK, TABLE)
        src = payload_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        for page in range(pid, n, programs):
            size = tl.load(sizes_ptr + page)
            size = tl.minimum(tl.maximum(size, 0), P)
            words = (size + (ALIGN - 1)) // ALIGN * (ALIGN // 8)
            at = tl.multiple_of(tl.load(rel_ptr + page) // 8, ALIGN // 8)
            row = src + page * (P // 8)  # a slice is at most one chunk: no int32 overflow
            head = tl.minimum(tl.maximum(split - at, 0), words)  # words before the boundary
            _copy_words(first + at, row, head, WORDS)
            _copy_words(second + (at + head - split), row + head, words - head, WORDS)
        if meta_bytes > 0:
            dst = (tl.load(table_ptr + (meta_at // CHUNK) % TABLE).to(tl.pointer_type(tl.int64))
                   + (meta_at % CHUNK) // 8)
            # the offsets, planned again: each program writes whole blocks of them
            rel_at = tl.zeros((), dtype=tl.int64)
            for start in range(0, n, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                m = idx < n
                padded = _padded_sizes(sizes_ptr, idx, m, P, ALIGN)
                if (start // BLOCK) % programs == pid:
                    tl.store(dst + idx, rel_at + tl.cumsum(padded, 0) - padded, mask=m)
                rel_at += tl.sum(padded, 0)
            # the rest (sizes, kinds, checksums) as the compress kernel wrote it: a share each
            lo = meta_from // 8
            share = (meta_bytes // 8 - lo + programs - 1) // programs
            w0 = lo + pid * share
            count = tl.maximum(tl.minimum(share, meta_bytes // 8 - w0), 0)
            meta = meta_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
            _copy_words(dst + w0, meta + w0, count, WORDS)


@triton.jit
def _place_slice_kernel(end_ptr, ends_ptr, desc_ptr, host_desc_ptr, parity, limit, meta_bytes,
                        CHUNK: tl.constexpr):
    # the plan of _pack_slice_kernel for pages the placed encoder laid end to end: their bytes
    # (``end``) reserved at the arena's end, the metadata behind them in one chunk
    pages = tl.load(end_ptr)
    base, _, end, ok = _reserve(ends_ptr, parity, limit, pages, meta_bytes, CHUNK)
    _publish(ends_ptr, parity, desc_ptr, host_desc_ptr, base, end, ok)
    tl.store(host_desc_ptr + 2, pages)
    tl.store(end_ptr, 0)  # the next slice of this payload starts at its byte 0


@triton.jit
def _fetch_from_host_kernel(dst_ptr, desc_ptr, table_ptr, CHUNK: tl.constexpr,
                            TABLE: tl.constexpr, WORDS: tl.constexpr):
    base = tl.load(desc_ptr)
    if base >= 0:
        total = tl.load(desc_ptr + 1)
        total_words = total // 8
        first, second, split = _slice_chunks(table_ptr, base, total, CHUNK, TABLE)
        dst = dst_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        w = tl.arange(0, WORDS)
        step = tl.num_programs(0) * WORDS
        for w0 in range(tl.program_id(0) * WORDS, total_words, step):
            idx = w0 + w
            m = idx < total_words
            lo = tl.load(first + idx, mask=m & (idx < split))
            hi = tl.load(second + (idx - split), mask=m & (idx >= split))
            tl.store(dst + idx, tl.where(idx < split, lo, hi), mask=m)


@triton.jit
def _pack_small_kernel(src_ptr, dst_ptr, ends_ptr, parity, head_words, WORDS: tl.constexpr):
    # a small store's block (``torch_pagecomp.offload._small_store``): the metadata ahead of
    # the pages (``head_words`` words, header included) and the pages the placed encoder laid
    # end to end (their bytes in ``ends[parity]``), copied in 8-byte words by every program
    # in turn, so that the stores across the link are wide and many are in flight
    end = tl.load(ends_ptr + parity)
    total = head_words + end // 8
    src = src_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    dst = dst_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    w = tl.arange(0, WORDS)
    step = tl.num_programs(0) * WORDS
    for w0 in range(tl.program_id(0) * WORDS, total, step):
        idx = w0 + w
        m = (idx < total) & (idx >= 2)  # (words 0 and 1: the header, written below)
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
    if tl.program_id(0) == 0:
        tl.store(dst, end)
        # the next offload's counter (this launch reads the other one): zero before its encode
        tl.store(ends_ptr + (1 - parity), 0)


def link_programs(device: torch.device) -> int:
    """Programs of the kernels that move bytes over the link: a few dozen programs come close
    to a copy engine's rate and leave the rest of the GPU to the model."""
    if device.type != "cuda" or interpreting():
        return 2
    return 32


def pack_slice(payload: torch.Tensor, sizes: torch.Tensor, rel: torch.Tensor,
               ends: torch.Tensor, parity: int, limit: int, desc: torch.Tensor,
               host_desc: torch.Tensor, table: torch.Tensor, chunk_bytes: int,
               meta: torch.Tensor | None = None, meta_from: int = 0,
               programs: int | None = None) -> None:
    """Reserve a slice's bytes at the arena's end and copy its pages there, on the current
    stream (see the module docstring); with ``meta``, its metadata after them.

    Args:
        payload: ``uint8 [N, P]`` fixed-stride payload (8-byte aligned rows).
        sizes: ``int32 [N]`` stored bytes per page (from the compress kernel).
        rel: ``int64 [N]`` out: each page's offset from the slice's base (16-byte aligned).
        ends: ``int64 [2]`` on the device: the arena's end, in slot ``parity`` (read) and
            ``1 - parity`` (written: the end after this slice). Slices of one arena go on one
            stream with ``parity`` taking turns.
        limit: the backed limit (bytes of the arena backed by host chunks, in order).
        desc: ``int64 [2]`` out, on the device: ``(base, total)``; ``base = -1`` when the
            slice does not fit under ``limit`` (nothing is reserved or written then).
        host_desc: ``int64 [2]`` out, in page-locked host memory: the same two values.
        table: ``int64 [TABLE]`` the device can read (page-locked host memory, or device
            memory): entry ``k % TABLE`` is the address of the page-locked host buffer that
            backs chunk ``k`` (``CHUNK`` bytes, 16-byte aligned).
        chunk_bytes: the arena's chunk size (a multiple of 16 bytes, at least the slice's
            worst case, ``N * P`` and twice ``meta``'s bytes): a slice lies in at most two
            consecutive chunks, both backed up to ``limit``.
        meta: ``uint8 [M]`` (``M`` a multiple of 16), the slice's metadata buffer, or None:
            then the slice's last ``M`` bytes in the arena (``total`` counts them), in one
            chunk: ``rel`` at its start (int64, written here), bytes ``meta_from ..`` copied
            from ``meta`` (the sizes, kinds and checksums the compress wrote).
    """
    n, page_size = payload.shape
    if n == 0:
        return
    grid = (min(n, programs or link_programs(payload.device)),)
    meta_bytes = 0 if meta is None else meta.numel()
    if meta_bytes % 16 or meta_from % 8:
        raise ValueError(f"pack_slice: metadata of {meta_bytes} bytes from byte {meta_from}: "
                         "a multiple of 16 bytes from a multiple of 8 expected")
    launch(_pack_slice_kernel, grid, payload.device,
           (payload, sizes, rel, ends, desc, host_desc, table,
            rel if meta is None else meta, n, parity, limit, meta_bytes, meta_from),
           _pack_meta(page_size, chunk_bytes, table.numel()), traced=False)


def pack_slice_at(index: int, stream, programs: int, n: int, page_size: int, chunk_bytes: int,
                  addrs: tuple, table_len: int, parity: int, limit: int, meta_span: tuple,
                  args) -> None:
    """:func:`pack_slice` without its checks (``launch.launch_known``), given the addresses
    ``addrs`` of ``(payload, sizes, rel, ends, desc, host_desc, table, meta)`` on CUDA device
    ``index`` (``table`` of ``table_len`` entries; the device reads page-locked host memory at
    its host address) and ``meta_span``, ``(meta's bytes, meta_from)``, on ``stream`` (a
    ``torch.cuda.Stream``, or None: the current one) with ``programs`` programs (at most
    :func:`link_programs`, at most ``n``). For the activation store, which cuts a slice's
    metadata by address; ``args`` (the tensors, or a function that makes them) as for
    ``launch.launch_known``."""
    payload, sizes, rel, ends, desc, host_desc, table, meta = addrs
    classes = (ptr_class(torch.uint8, payload), ptr_class(torch.int32, sizes),
               ptr_class(torch.int64, rel), ptr_class(torch.int64, ends),
               ptr_class(torch.int64, desc), ptr_class(torch.int64, host_desc),
               ptr_class(torch.int64, table), ptr_class(torch.uint8, meta), int_class(n),
               int_class(parity), int_class(limit), int_class(meta_span[0]),
               int_class(meta_span[1]))
    launch_known(_pack_slice_kernel, (programs,), index,
                 _pack_meta(page_size, chunk_bytes, table_len), classes,
                 (*addrs, n, parity, limit, *meta_span), args, stream)


def place_slice(end: torch.Tensor, ends: torch.Tensor, parity: int, limit: int,
                desc: torch.Tensor, host_desc: torch.Tensor, chunk_bytes: int,
                meta_bytes: int) -> None:
    """Reserve a slice whose pages the placed encoder laid end to end
    (``kernels.exp_codec.compress_exp_placed``) at the arena's end, on the current stream, as
    :func:`pack_slice` plans one, copying nothing: the copy engine moves the bytes once the
    host has read the placement (``torch_pagecomp.offload._arena``).

    Args:
        end: ``int64 [1]`` on the device: the pages' bytes (the encoder's counter); set to 0.
        ends, parity, limit, desc, chunk_bytes: as for :func:`pack_slice`.
        host_desc: ``int64 [3]`` out, in page-locked host memory: ``(base, total, pages'
            bytes)``; ``total`` counts the metadata (``meta_bytes``, a multiple of 16) behind
            the pages, moved to the next chunk where it would cross into it.
    """
    launch(_place_slice_kernel, (1,), end.device,
           (end, ends, desc, host_desc, parity, limit, meta_bytes),
           _place_meta(chunk_bytes), traced=False)


def place_slice_at(index: int, stream, addrs: tuple, parity: int, limit: int,
                   meta_bytes: int, chunk_bytes: int, args) -> None:
    """:func:`place_slice` given the addresses of ``(end, ends, desc, host_desc)`` on CUDA
    device ``index``, on ``stream``, without its checks (as :func:`pack_slice_at`)."""
    classes = tuple(ptr_class(torch.int64, a) for a in addrs) + (
        int_class(parity), int_class(limit), int_class(meta_bytes))
    launch_known(_place_slice_kernel, (1,), index, _place_meta(chunk_bytes), classes,
                 (*addrs, parity, limit, meta_bytes), args, stream)


@functools.cache
def _place_meta(chunk_bytes: int):
    return frozen_meta((("CHUNK", chunk_bytes), ("num_warps", 1)))


@functools.cache
def _pack_meta(page_size: int, chunk_bytes: int, table: int):
    # built once per setting: a launch per stored slice would otherwise hash it anew
    return frozen_meta((("P", page_size), ("CHUNK", chunk_bytes), ("TABLE", table),
                        ("ALIGN", ALIGN), ("WORDS", PACK_WORDS), ("BLOCK", PLAN_BLOCK),
                        ("num_warps", PACK_WARPS)))


def fetch_from_host(dst: torch.Tensor, desc: torch.Tensor, table: torch.Tensor,
                    chunk_bytes: int, programs: int | None = None) -> None:
    """Read a placed slice's bytes back from host memory, on the current stream.

    Args:
        dst: ``uint8 [>= total]`` on the device, 8-byte aligned (``total`` is at most the
            slice's ``N * P``); bytes ``[0, total)`` are written.
        desc, table, chunk_bytes: as for :func:`pack_slice`; nothing is read or written
            when ``desc[0] < 0``.
    """
    grid = (programs or link_programs(dst.device),)
    launch(_fetch_from_host_kernel, grid, dst.device, (dst, desc, table),
           frozen_meta((("CHUNK", chunk_bytes), ("TABLE", table.numel()),
                        ("WORDS", PACK_WORDS * 2), ("num_warps", PACK_WARPS))), traced=False)


def small_programs(words: int, interpret: bool | None = None) -> int:
    """Programs of :func:`pack_small` for a block of at most ``words`` 8-byte words: a step of
    ``PACK_WORDS`` each, at most 128 (many stores in flight for a small block's latency);
    ``interpret``: whether Triton's interpreter runs it (None: read now)."""
    if interpreting() if interpret is None else interpret:
        return 2
    return max(1, min(128, -(-words // PACK_WORDS)))


def pack_small(src: torch.Tensor, dst: torch.Tensor, ends: torch.Tensor, parity: int,
               head_bytes: int, programs: int | None = None) -> None:
    """Copy a small store's metadata and pages into its host block, on the current stream.

    Args:
        src: ``uint8`` on the device, 16-byte aligned: the header (16 bytes, not read), the
            metadata (up to ``head_bytes``), then the pages the placed encoder laid end to end
            (``exp_codec.compress_exp_placed``).
        dst: ``uint8`` the device can write (page-locked host memory), 16-byte aligned, of at
            least ``head_bytes + ends[parity]`` bytes: gets the same layout; its first 8
            bytes the pages' bytes (``int64``).
        ends: ``int64 [2]`` on the device: ``ends[parity]`` the pages' bytes (the encoder's
            counter); ``ends[1 - parity]`` is set to 0 for the next offload.
        head_bytes: bytes ahead of the pages, a multiple of 16.
    """
    if head_bytes % 16 or src.data_ptr() % 16 or dst.data_ptr() % 16:
        raise ValueError("pack_small: 16-byte aligned buffers and head_bytes, got "
                         f"head_bytes={head_bytes}")
    programs = programs or small_programs(src.numel() // 8)
    launch(_pack_small_kernel, (programs,), src.device,
           (src, dst, ends, parity, head_bytes // 8), _SMALL_META, traced=False)


def small_pack_launch() -> tuple:
    """``(kernel, settings)`` of :func:`pack_small`'s launch, for a caller that keeps its
    compiled entry (``launch.launch_cached``)."""
    return _pack_small_kernel, _SMALL_META


def small_pack_classes(addrs: tuple, parity: int, head_bytes: int) -> tuple:
    """The argument classes of :func:`pack_small`'s launch with the addresses ``addrs`` of
    ``(src, dst, ends)`` (``launch.known_args``' rule)."""
    return (ptr_class(torch.uint8, addrs[0]), ptr_class(torch.uint8, addrs[1]),
            ptr_class(torch.int64, addrs[2]), int_class(parity), int_class(head_bytes // 8))


_SMALL_META = frozen_meta((("WORDS", PACK_WORDS), ("num_warps", PACK_WARPS)))
