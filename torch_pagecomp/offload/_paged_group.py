"""Restoring many stored tensors of a :class:`~._paged.PagedStore` at once.

A :class:`StoredGroup` lists stored tensors that come back together, back to back in one
output (a KV cache layer's sealed blocks). :func:`restore_group` brings them all back with a
constant number of launches, however many the group holds:

* one staging buffer on the device; one copy-engine copy per run of placed slices that lie
  next to each other in one arena chunk (slices stored one after another are), and a kernel
  fetch per slice whose placement the host does not know yet (as ``PagedStore.restore``);
* one decode over every page (offsets into the staging buffer, sizes and kinds
  concatenated), into one output, or by a table of row addresses where pages are not ``P``
  apart: into one output per stored tensor (the activation hooks: each tensor keeps its own
  allocation) or into the parts of one output whose tensors end in a partial page; one status
  tensor counted as ``restore`` counts it. A group may mix LZ4 and exponent-codec tensors
  (the hooks store a bf16 model's fp32 and bf16 activations side by side): each run of
  consecutive tensors of one codec is one decode by its decoder, over its slice of the
  metadata (:func:`codec_runs`); the staging, copies and metadata stay shared.

The activation hooks restore each batch once, into one output per tensor (per member, for a
stored batch of several saved storages: ``_entry._Member``), and their slices are placed by
then: :func:`restore_placed` serves them without the cache. One launch gathers every
page's metadata and row address from the slices' own tensors (seven numbers a slice through
the store's upload ring), where building the cache concatenated them on the host side and a
second launch wrote the row table: ~0.6 ms of host time a batch, the largest part of
``prefer="memory"``'s restores on transformers' BERT (``bench/results/h200_ee8e4de_session37``).

The group keeps, for its leading stored tensors whose slices are all placed, the concatenated
metadata and the host ranges to copy, and extends them as later ones are placed: a restore of
an unchanged group costs the host a few tensor allocations, a copy per run and the decode
launch. The metadata stays on the host, as placed slices' does (in the arena, behind their
pages): one page-locked buffer, uploaded by each group restore (13 bytes a page);
:func:`restore_placed` reads each slice's where its pages' copy brings it.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _arena, _copies, _decode, _paged
from ._streams import current_stream


class StoredGroup:
    """Stored tensors (:class:`~._paged.PagedStored`) restored together, back to back in the
    order appended (see the module docstring). ``page_size``: the store's page size."""

    def __init__(self, page_size: int, storeds=()):
        self.page_size = page_size
        self.storeds: list = []
        self.starts: list[int] = []  # byte offset of each stored tensor in the output
        self.nbytes = 0
        self.ragged = 0  # stored tensors with a partial last page (their pages are not P-aligned)
        self.clear_cache()
        for s in storeds:
            self.append(s)

    def __len__(self) -> int:
        return len(self.storeds)

    def append(self, stored) -> None:
        """Add ``stored`` after the others (its bytes follow theirs in the output). Stored
        tensors of both codecs may mix: each run of consecutive ones of one codec is decoded
        by its decoder (:func:`codec_runs`), so a group costs one decode per run."""
        self.storeds.append(stored)
        self.starts.append(self.nbytes)
        self.nbytes += stored.nbytes
        self.ragged += stored.nbytes % self.page_size != 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` stored tensors."""
        if n >= len(self.storeds):
            return
        self.nbytes = self.starts[n]
        del self.storeds[n:], self.starts[n:]
        self.ragged = sum(s.nbytes % self.page_size != 0 for s in self.storeds)
        if n < self.known:
            self.clear_cache()

    def clear_cache(self) -> None:
        """Forget the cached metadata (rebuilt at the next restore)."""
        self.known = 0  # leading stored tensors whose metadata is cached
        self.pages = 0  # their full pages
        self.staged = 0  # their staging bytes (exact compressed sizes)
        # (offsets, sizes, kinds[, checksums]) of the cached pages, concatenated: views of one
        # page-locked host buffer, ``meta_buf``
        self.meta: tuple[torch.Tensor, ...] | None = None
        self.meta_buf: torch.Tensor | None = None
        # [arena offset, bytes, staging offset, its arena pieces (None until the next restore)]
        self.runs: list[list] = []


def codec_runs(group: StoredGroup) -> list[tuple[int, int, int, int, bool]]:
    """``(lo, hi, a, b, exp)`` per run of consecutive stored tensors ``lo .. hi`` of one codec
    (``exp``: the exponent codec's pages, else LZ4), whose full pages are ``a .. b`` of the
    group's (the order of its concatenated metadata). A caller that puts each codec's tensors
    together (``_backward``) gets one run per codec."""
    runs: list = []
    page = 0
    for i, stored in enumerate(group.storeds):
        n = stored.nbytes // group.page_size
        if runs and runs[-1][4] == stored.exp:
            runs[-1][1], runs[-1][3] = i + 1, page + n
        else:
            runs.append([i, i + 1, page, page + n, stored.exp])
        page += n
    return [tuple(r) for r in runs]


def _absorb(store, group: StoredGroup, device: torch.device) -> None:
    """Cache the metadata of the stored tensors after ``group.known`` whose slices are all
    placed, in order, stopping at the first that is not."""
    try:
        _absorb_placed(store, group, device)
    except BaseException:
        # half done (the runs and counts advanced, the metadata not joined: the buffer not
        # allocated, an interrupt): forgotten, rebuilt by the next restore. Kept, every
        # later restore of the group failed (no metadata, or the old tensors' only)
        group.clear_cache()
        raise


def _absorb_placed(store, group: StoredGroup, device: torch.device) -> None:
    rels, shifts, counts, sizes, kinds, sums = [], [], [], [], [], []
    at = group.known
    while at < len(group.storeds):
        stored = group.storeds[at]
        if stored.freed:
            raise RuntimeError("compressed store: a stored tensor of the group was freed")
        if any(sl.base is None for sl in stored.slices):
            break
        for sl in stored.slices:
            if sl.base < 0:
                raise _paged.SliceNotStored(sl.n)
            last = group.runs[-1] if group.runs else None
            if last is not None and last[0] + last[1] == sl.base:
                last[1] += sl.total  # the next bytes of the arena: copied together
                last[3] = None
            else:
                group.runs.append([sl.base, sl.total, group.staged, None])
            rels.append(sl.rel)
            sizes.append(sl.sizes)
            kinds.append(sl.kinds)
            if store.checksum:
                sums.append(sl.sums)
            shifts.append(group.staged)
            counts.append(sl.n)
            group.staged += sl.total
        group.pages += stored.nbytes // group.page_size
        at += 1
    group.known = at
    if not rels:
        return
    # one add for all the new slices: offsets relative to each slice's base -> into staging;
    # placed slices' metadata is in the arena, on the host, and so the group's: each slice's
    # shift repeated over its pages by numpy (torch's repeat took ~100 us a group on the
    # hooks' hot path)
    shift = torch.from_numpy(np.repeat(np.asarray(shifts, dtype=np.int64), counts))
    offsets = torch.cat(rels) + shift
    new = (offsets, torch.cat(sizes), torch.cat(kinds)) + ((torch.cat(sums),) if sums else ())
    if group.meta is not None:
        new = tuple(torch.cat([old, t]) for old, t in zip(group.meta, new))
    # one buffer: each restore uploads it with one copy, without waiting
    group.meta_buf, group.meta = _joined(new, store.arena.pin)


def _joined(tensors: tuple, pin: bool) -> tuple[torch.Tensor, tuple]:
    """``tensors`` (1-D host tensors) copied into one ``uint8`` buffer (page-locked with
    ``pin``), each at a 16-byte aligned offset: ``(buffer, their views in it)``."""
    at, spans = 0, []
    for t in tensors:
        spans.append((at, t.numel() * t.element_size()))
        at += (spans[-1][1] + 15) & ~15
    buf = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
    views = _views(buf, tensors, spans)
    for v, t in zip(views, tensors):
        v.copy_(t)
    return buf, views


def _views(buf: torch.Tensor, like: tuple, spans: list | None = None) -> tuple:
    """Views of ``buf`` with the dtypes of ``like`` at the byte ranges ``spans``; without
    ``spans``, ``like`` are views of one :func:`_joined` buffer and ``buf`` a copy of it (the
    upload of a group's metadata): the same ranges in the copy."""
    if spans is None:
        base = like[0].untyped_storage().data_ptr()
        spans = [(t.data_ptr() - base, t.numel() * t.element_size()) for t in like]
    return tuple(buf[a:a + n].view(t.dtype) for (a, n), t in zip(spans, like))


def restore_placed(store, storeds: list, outs: list) -> bool:
    """Decode ``storeds`` (``PagedStored`` of whole pages, any mix of codecs) each into its own
    output (``outs``: ``uint8 [nbytes]`` each, or a list of ``(byte offset, uint8 [n])`` parts
    at whole pages, where only the parts' pages are decoded, each into its part) on the
    current stream, when every slice is placed: one staging buffer, one copy per run of
    adjacent arena bytes (slices taken in arena order), one launch that gathers the pages'
    metadata and rows (``kernels.row_table.gather_slice_meta``), one decode per codec. Returns
    False, having queued nothing, where it does not apply (a slice not placed yet,
    checksums): :func:`restore_group` does. A placed slice's metadata comes up with its
    pages (the arena holds it behind them). Failed pages are
    counted as ``PagedStore.restore`` counts them (raised at once on the CPU)."""
    from ..kernels.row_table import gather_slice_meta

    if store.checksum or not storeds:
        return False
    p, arena = store.page_size, store.arena
    arena.confirm()  # placements known by now (never waits)
    order = []  # (slice, its first page's output row, exponent codec), LZ4 slices first
    for exp in (False, True):
        for stored, out in zip(storeds, outs):
            if stored.exp is not exp:
                continue
            for sl in stored.slices:
                if sl.base is None:
                    return False
                if sl.base < 0:
                    raise _paged.SliceNotStored(sl.n)
                # the pages a .. a + n of the slice, into the row at ``row``
                order.extend((sl, a, n, row, exp) for a, n, row in _slice_rows(sl, out, p))
    if not order:  # parts that hold none of the pages
        return True
    dev = store.device
    stream = _launch_stream(dev)
    # staging in arena order: slices stored one after another lie next to each other there
    shifts, runs, staged = {}, [], 0
    slices = sorted({id(o[0]): o[0] for o in order}.values(), key=lambda sl: sl.base)
    for sl in slices:
        shifts[id(sl)] = staged
        if runs and runs[-1][0] + runs[-1][1] == sl.base:
            runs[-1][1] += sl.total
        else:
            runs.append([sl.base, sl.total, staged])
        staged += sl.total
    # each slice's metadata comes up with its pages, at its end: the gather reads it there,
    # not over the link (see ``_decode.decode_slice_at``); on the CPU, where it lies
    staging = torch.empty(staged, dtype=torch.uint8, device=dev)
    for base, total, at in runs:
        _copies.copy_spans(staging, arena.spans(base, total, at))
    table = []  # a row per run of pages: SLICE_DESC_ROWS values, transposed below
    pages = most = lz4_pages = 0
    staged_at = staging.data_ptr()
    for sl, a, n, row, exp in order:
        m = (staged_at + shifts[id(sl)] + sl.meta_at if stream is not None
             else sl.meta.data_ptr())  # the metadata: int64 rel, int32 sizes, kinds
        rel, _, size, kind, _ = _arena._meta_offsets(sl.n, sl.checksum)
        table.append((m + rel + 8 * a, m + size + 4 * a, m + kind + a, shifts[id(sl)], pages,
                      n, row))
        pages += n
        if n > most:
            most = n
        if not exp:
            lz4_pages += n
    cols = list(zip(*table))
    status, hand = store._status(pages, stream, dev)
    # one buffer for the pages' offsets, rows, sizes and kinds: the GPU's launches take
    # addresses into it (one allocation, no views: host time per batch, ~70 a step on BERT)
    work = torch.empty(_work_bytes(pages), dtype=torch.uint8, device=dev)
    if stream is None:  # the CPU (the interpreter): the checked launcher, on views
        offsets, rows, sizes, kinds = _work_views(work, pages)
        desc = _decode.upload_table(cols, dev)
        gather_slice_meta(desc, offsets, sizes, kinds, rows, p, most, traced=False)
        for a, b, exp in ((0, lz4_pages, False), (lz4_pages, pages, True)):
            if a < b:
                _decode.decode_rows(staging, offsets[a:b], sizes[a:b], kinds[a:b], rows[a:b],
                                    p, status[a:b], exp)
    else:
        _gather_and_decode_at(store, cols, staging, staged, work, status, (p, most, lz4_pages))
    if hand:
        store._count_failures(status, stream)
    if stream is None:
        arena.confirm()
    return True


def _slice_rows(sl, out, p: int):
    """``(first page in the slice, pages, address of the first's output)`` of each run of
    ``sl``'s pages that ``out`` (see :func:`restore_placed`) holds: one run into a tensor;
    into parts, a run per part that overlaps the slice (its pages ``sl.first ..`` of the
    stored tensor's)."""
    if isinstance(out, torch.Tensor):
        return [(0, sl.n, out.data_ptr() + sl.first * p)]
    lo, hi, runs = sl.first, sl.first + sl.n, []
    for base, buf in out:
        first = base // p
        a, b = max(lo, first), min(hi, first + buf.numel() // p)
        if a < b:
            runs.append((a - lo, b - a, buf.data_ptr() + (a - first) * p))
    return runs


def _launch_stream(device: torch.device):
    """The stream :func:`restore_placed` launches on by address: the current one on CUDA;
    None on the CPU, where it launches the checked launchers on views instead."""
    return current_stream(device) if device.type == "cuda" else None


def _work_offsets(pages: int) -> tuple:
    """Byte offsets of ``(offsets int64, rows int64, sizes int32, kinds uint8)`` of ``pages``
    pages in a batched restore's work buffer, each part 16-byte aligned."""
    a8 = _arena._align16(8 * pages)
    return 0, a8, 2 * a8, 2 * a8 + _arena._align16(4 * pages)


def _work_bytes(pages: int) -> int:
    """Bytes of a batched restore's work buffer (:func:`_work_offsets`)."""
    return _work_offsets(pages)[3] + pages


def _work_views(work: torch.Tensor, pages: int) -> tuple:
    """``(offsets, rows, sizes, kinds)``: the parts of a work buffer (:func:`_work_offsets`)."""
    o, r, s, k = _work_offsets(pages)
    return (work[o:o + 8 * pages].view(torch.int64), work[r:r + 8 * pages].view(torch.int64),
            work[s:s + 4 * pages].view(torch.int32), work[k:k + pages])


def _gather_and_decode_at(store, cols: list, staging: torch.Tensor, staged: int,
                          work: torch.Tensor, status: torch.Tensor, counts: tuple) -> None:
    """:func:`restore_placed`'s launches on the GPU, by address: the slices' table ``cols``
    into the upload ring, the metadata gathered into ``work`` (:func:`_work_bytes`), then one
    decode per codec from the first ``staged`` bytes of ``staging`` (the pages; metadata may
    follow them) into the rows, statuses into ``status``. ``counts``:
    ``(page size, most pages of a slice, LZ4 pages)``; the LZ4 slices' pages come first.
    Tensors are made only for a launch that goes the usual way (its first, to compile)."""
    from ..kernels.row_table import gather_slice_meta_at

    p, most, lz4_pages = counts
    pages, index = status.numel(), status.device.index
    table, table_tensor = _decode.table_addr(cols, status.device, store.uploads)
    w = work.data_ptr()
    offs, rows, szs, kds = (w + o for o in _work_offsets(pages))

    def gather_args():
        offsets, rws, sz, kd = _work_views(work, pages)
        return table_tensor(), offsets, sz, kd, rws, len(cols[0])

    gather_slice_meta_at(index, len(cols[0]), most, p, (table, offs, szs, kds, rows),
                         gather_args)
    st, payload, total = status.data_ptr(), staging.data_ptr(), staged
    for a, b, exp in ((0, lz4_pages, False), (lz4_pages, pages, True)):
        if a < b:
            def decode_args(a=a, b=b):
                offsets, rws, sz, kd = _work_views(work, pages)
                return (staging[:total], offsets[a:b], sz[a:b], kd[a:b], rws[a:b],
                        status[a:b], total)

            _decode.decode_rows_at(exp, index, p, b - a,
                                   (payload, offs + 8 * a, szs + 4 * a, kds + a, rows + 8 * a,
                                    st + 4 * a), total, decode_args)


def restore_group(store, group: StoredGroup, out) -> None:
    """Decode every stored tensor of ``group`` into ``out`` on the current stream, after their
    packs (device-side waits: the host waits for nothing): ``uint8 [group.nbytes]``, back to
    back in the group's order, or a list of one ``uint8 [nbytes]`` tensor per stored tensor
    (each its own allocation; whole pages only). Failed pages are counted as
    ``PagedStore.restore`` counts them (raised at once on the CPU)."""
    from ..kernels.host_pack import fetch_from_host

    p, arena = store.page_size, store.arena
    if isinstance(out, (list, tuple)):
        outs = list(out)
        if group.ragged:
            raise ValueError("restore into separate outputs takes whole pages only")
        if [o.numel() for o in outs] != [s.nbytes for s in group.storeds]:
            raise ValueError(f"outputs of {[o.numel() for o in outs]} bytes for stored "
                             f"tensors of {[s.nbytes for s in group.storeds]}")
        if not outs:
            return
        dev = outs[0].device
    else:
        if out.numel() != group.nbytes:
            raise ValueError(f"out has {out.numel()} bytes, the group {group.nbytes}")
        dev = out.device
        # a ragged group's tensors do not start P apart in out: their whole pages are decoded
        # into their own parts of it, by row address (the partial last pages: below)
        outs = ([out[start:start + stored.nbytes // p * p]
                 for stored, start in zip(group.storeds, group.starts)]
                if group.ragged else None)
    stream = current_stream(dev) if dev.type == "cuda" else None
    # placements known by now (never waits), and the copies of slices not sent yet queued
    store.send_now([sl for stored in group.storeds[group.known:] for sl in stored.slices])
    _absorb(store, group, dev)

    # the stored tensors not cached yet (placement unknown): their own staging space
    rest, staged, pages = [], group.staged, group.pages
    for stored in group.storeds[group.known:]:
        for sl in stored.slices:
            if sl.base is not None and sl.base < 0:
                raise _paged.SliceNotStored(sl.n)
            size = sl.total if sl.base is not None else _arena.slice_upper(sl.n, p, sl.checksum)
            rest.append((sl, staged, size))
            staged += size
        pages += stored.nbytes // p
    staging = torch.empty(staged, dtype=torch.uint8, device=dev)
    for run in group.runs:
        if run[3] is None:
            run[3] = arena.spans(*run[:3])
        _copies.copy_spans(staging, run[3])
    extra = []
    for sl, at, size in rest:
        if sl.base is not None:  # placed since the last absorb: the copy engine
            _copies.copy_spans(staging, arena.spans(sl.base, sl.total, at))
        else:  # still packing: kernels read it once the pack is done
            _arena._wait(stream, sl.stored)
            fetch_from_host(staging[at:at + size], sl.desc, arena.table, arena.chunk)
        rel, sizes, kinds, sums = _arena.slice_meta(sl, staging, at, stream)
        extra.append((rel + at, sizes, kinds) + ((sums,) if store.checksum else ()))

    if pages:
        meta = group.meta
        if meta is not None:  # kept on the host: uploaded
            meta = _views(group.meta_buf.to(dev, non_blocking=True), meta)
        if extra:
            parts = ([] if meta is None else [meta]) + extra
            meta = tuple(torch.cat([q[i] for q in parts]) for i in range(len(parts[0])))
        offsets, sizes, kinds = meta[:3]
        sums = meta[3] if store.checksum else None
        status = torch.empty(pages, dtype=torch.int32, device=dev)
        for lo, hi, a, b, exp in codec_runs(group):  # its pages are a..b of the metadata
            if a == b:
                continue
            part = slice(a, b)
            args = (staging, offsets[part], sizes[part], kinds[part])
            run_sums = None if sums is None else sums[part]
            if outs is not None:  # each tensor's pages into its own output (or part of out)
                _decode._decompress_rows(*args, outs[lo:hi], p, status[part], run_sums, exp,
                                         ring=store.uploads)
            else:
                _decode._decompress_into(*args, out.view(pages, p)[part], status[part],
                                         run_sums, exp)
        store._count_failures(status, stream)
    if group.ragged:  # partial last pages travel as plain bytes
        tails = [(s, start) for s, start in zip(group.storeds, group.starts)
                 if s.tail is not None]
        status = (torch.empty(len(tails), dtype=torch.int32, device=dev) if store.checksum
                  else None)
        for i, (stored, start) in enumerate(tails):
            end = start + stored.nbytes
            _decode.restore_tail(stored, out[end - stored.tail.numel():end], stream,
                                 None if status is None else status[i:i + 1])
        if status is not None:
            store._count_failures(status, stream)
    if stream is None:
        arena.confirm()
