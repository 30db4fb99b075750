"""Decoding a compressed store's pages on the device or the CPU: the decoders' launches by
address and by row table (a table of page addresses built by a kernel, :func:`ramps`), small
tables handed to kernels (:func:`upload_table`), page checksums and the partial last page.

Used by :class:`._paged.PagedStore`'s restores and by the batched restores of
``_paged_group``; split from ``_paged`` (the store and its offload path) to keep each module
readable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import _ops, cpu_codec
from ..api import checksum_status
from ..pools import can_pin
from ._arena import UploadRing, _meta_offsets, _meta_views, _Slice, _wait
from ._copies import host_bytes
from ._streams import current_stream

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._paged import PagedStored


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without making the host wait: on CUDA it goes up
    from page-locked memory (a copy from pageable memory waits for the stream), staged by a
    host copy into a new page-locked tensor. ``Tensor.pin_memory()`` would first ask the
    driver whether the tensor is page-locked already: ~100 us a call on the hooks' restores,
    beside the arena's registered chunks (``bench/results/h200_5b2a6fe_session30``), against
    a few for the page-locked allocator's cached blocks."""
    if device.type == "cuda" and can_pin():
        staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staged.copy_(host)
        host = staged
    return host.to(device, non_blocking=True)


def decode_slice_at(sl: _Slice, staging: torch.Tensor, total: int, meta_at: int | None,
                    out: torch.Tensor, status: torch.Tensor, p: int, exp: bool) -> None:
    """Decode slice ``sl`` from the first ``total`` bytes of ``staging`` (its host bytes,
    copied or fetched) into its pages of ``out`` and statuses on the current CUDA stream, by
    address: the views :meth:`PagedStore.restore` would cut per slice (its pages, statuses and
    metadata parts) cost a ResNet-50 step's restores about 12 tensor operations a slice. The
    metadata is the slice's own on the device, or (``meta_at``) its copy at that offset of
    ``staging``: read where it is kept in page-locked memory, by the decoders' threads over
    the link that the restores' copies fill, it made a Llama-style decoder's step 6% slower
    (``bench/results/h200x2_824437a_session55``)."""
    n, first = sl.n, sl.first
    m = sl.meta.data_ptr() if meta_at is None else staging.data_ptr() + meta_at
    rel, _, sizes, kinds, _ = _meta_offsets(n, sl.checksum)
    addrs = (staging.data_ptr(), m + rel, m + sizes, m + kinds,
             out.data_ptr() + first * p, status.data_ptr() + 4 * first)

    def args():  # the tensors, for a launch that goes the usual way (its first, to compile)
        meta = sl.meta if meta_at is None else staging[meta_at:meta_at + sl.meta.numel()]
        r, _, sz, kd, _ = _meta_views(meta, n, sl.checksum)
        return (staging[:total], r, sz, kd, out[first * p:(first + n) * p].view(n, p),
                status[first:first + n], total)

    decode_rows_at(exp, out.device.index, p, n, addrs, total, args, rows=False)


def checksums(pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
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
    return checksums(page)


def verify(status: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    """``api.checksum_status`` written into ``status`` (a part of the restore's statuses)."""
    status.copy_(checksum_status(status, got, want))


def _row_table(outs: list, page_size: int, ring: UploadRing | None = None) -> torch.Tensor:
    """``int64 [pages]`` on the outputs' (CUDA) device: the address of every page of ``outs``
    in order (:func:`ramps`)."""
    return ramps([o.data_ptr() for o in outs], [o.numel() // page_size for o in outs],
                 page_size, outs[0].device, ring)


def ramps(bases: list[int], counts: list[int], stride: int, device: torch.device,
          ring: UploadRing | None = None) -> torch.Tensor:
    """``int64 [sum(counts)]`` on CUDA ``device``: ``bases[j] + i * stride`` for ``i <
    counts[j]``, segment after segment, written by a kernel from three numbers a segment (no
    host wait), not built per element on the host and uploaded. The kernel reads the numbers
    from ``ring`` (the store's :class:`~._arena.UploadRing`, page-locked) at their address
    where given, else from an upload of them (:func:`table_addr`). (Through the ring's tensor
    and the launcher's own argument checks this took 69 us of host time a call, once per
    batch of saved tensors stored: ``bench/results/h200_session72``.)"""
    from ..kernels.row_table import fill_row_table_at

    firsts, total = [], 0
    for n in counts:
        firsts.append(total)
        total += n
    out = torch.empty(total, dtype=torch.int64, device=device)
    if total == 0:
        return out
    k = len(counts)
    desc, desc_tensor = table_addr([bases, firsts, counts], device, ring)
    fill_row_table_at(device.index, k, stride, max(counts), (desc, out.data_ptr()),
                      lambda: (desc_tensor(), out, k))
    return out


def table_addr(rows: list[list[int]], device: torch.device,
               ring: UploadRing | None = None) -> tuple[int, Callable[[], torch.Tensor]]:
    """``rows`` (equal-length lists of ints) as the ``int64 [len(rows), k]`` table a kernel
    queued next on ``device``'s current stream reads by address: ``(its address, a function
    that gives it as a tensor)`` (for a launch that goes the usual way, its first). In
    ``ring`` (page-locked, written by the host: no tensor made, nothing uploaded) where it
    takes them, else uploaded to ``device``."""
    if ring is not None:
        addr = ring.put_addr(rows, current_stream(device))
        if addr is not None:
            return addr, lambda: ring.view_at(addr, len(rows), len(rows[0]))
    table = upload_table(rows, device)  # no ring, or more than half of it
    return table.data_ptr(), lambda: table


def upload_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """``rows`` (equal-length lists of ints) as an ``int64 [len(rows), k]`` table uploaded to
    ``device`` (read by a kernel queued next on its current stream)."""
    return to_device(torch.tensor(rows, dtype=torch.int64), device)


def _decompress_rows(payload, offsets, sizes, kinds, outs: list, page_size: int,
                     status, sums=None, exp: bool = False, ring: UploadRing | None = None
                     ) -> None:
    """Decode the pages of several outputs (``uint8 [n_i * P]`` each, back to back in the
    metadata's order) with one decoder call, each page into its own output: on the GPU the
    decoder takes a table of row addresses (LZ4: one launch pair; ``exp``, exponent-codec
    pages: one launch); on the CPU the pages are decoded aside and copied. ``sums``
    (``int32 [pages]``): check the decoded pages against them (:func:`verify`)."""
    if outs[0].is_cuda:
        table = _row_table(outs, page_size, ring)
        decode_rows(payload, offsets, sizes, kinds, table, page_size, status, exp)
        if sums is not None:
            from ..kernels.checksum import row_checksums

            if all(o.data_ptr() % 4 == 0 for o in outs):
                got = torch.empty_like(sums)
                row_checksums(table, page_size, got)
            else:  # the kernel reads 32-bit words: rows of a ragged group's later tensors
                # may start anywhere, so those pages are checked from an aligned copy
                got = checksums(torch.cat([o.view(-1, page_size) for o in outs]))
            verify(status, got, sums)
        return
    pages = torch.empty((status.numel(), page_size), dtype=torch.uint8)
    _decompress_into(payload, offsets, sizes, kinds, pages, status, sums, exp)
    at = 0
    for o in outs:
        n = o.numel() // page_size
        o.view(n, page_size).copy_(pages[at:at + n])
        at += n


def decode_rows(payload, offsets, sizes, kinds, rows, page_size: int, status, exp: bool
                ) -> None:
    """Decode pages into the rows at the addresses ``rows`` (``int64``), ``exp``: the exponent
    codec's decoder: the by-address kernel on the GPU; on the CPU (the interpreter's tests)
    each page decoded aside, then copied to its row."""
    if payload.is_cuda:
        if exp:
            from ..kernels.exp_codec import decompress_exp_rows_known as decode
        else:
            from ..kernels.lz4_decompress import decompress_rows_known as decode
        decode(payload, offsets, sizes, kinds, rows, page_size, status)
        return
    pages = torch.empty((status.numel(), page_size), dtype=torch.uint8)
    _decompress_into(payload, offsets, sizes, kinds, pages, status, exp=exp)
    for page, addr in zip(pages, rows.tolist()):
        host_bytes(addr, page_size).copy_(page)


def decode_rows_at(exp: bool, index: int, page_size: int, n: int, addrs: tuple, total: int,
                   args, rows: bool = True) -> None:
    """:func:`decode_rows` on CUDA device ``index`` given the addresses of ``(payload,
    offsets, sizes, kinds, rows, status)`` (``n`` pages, ``payload`` of ``total`` bytes);
    ``args`` (a function that makes the tensors) as for ``kernels.launch.launch_known``.
    Without ``rows``, the fifth address is that of ``uint8 [n, page_size]`` output pages."""
    if exp:
        from ..kernels import exp_codec as k

        decode = k.decompress_exp_rows_at if rows else k.decompress_exp_into_at
    else:
        from ..kernels import lz4_decompress as k

        decode = k.decompress_rows_at if rows else k.decompress_into_at
    decode(index, page_size, n, addrs, total, args)


def _decompress_into(payload, offsets, sizes, kinds, pages, status, sums=None,
                     exp: bool = False) -> None:
    """``pagecomp.decompress_into`` (``exp``: the exponent codec's decoder) of a slice's own
    metadata (see ``_paged._compress``); ``sums`` (``int32 [n]``): then check the decoded pages
    against them (:func:`verify`)."""
    if pages.is_cuda:
        if exp:
            from ..kernels.exp_codec import decompress_exp_into_known

            decompress_exp_into_known(payload, offsets, sizes, kinds, pages, status)
        else:
            from ..kernels.lz4_decompress import decompress_into_known

            decompress_into_known(payload, offsets, sizes, kinds, pages, status)
    else:
        _ops.decompress_into_eager(payload, offsets, sizes, kinds, pages, status, exp=exp)
    if sums is not None:
        verify(status, checksums(pages), sums)
