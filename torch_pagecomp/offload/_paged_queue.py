"""Several small stored tensors compressed as one slice of a :class:`~._paged.PagedStore`.

Each slice costs the host a handful of launches and allocations both ways (compress, pack,
its metadata), and the activation hooks store most saved tensors one at a time: per tensor
that host time, not the kernels, sets the step of models with many small activations. So a
store *queues* tensors smaller than half a slice (``offload(..., coalesce=True)``) and stores
the queue as one slice once it holds a slice's pages, or as soon as anyone needs one of its
tensors on the way (a wait for a source to be read, a restore, another element size):

* the queued sources are copied back to back into one staging buffer (one launch; their
  partial last pages into their own page-locked tails), after which they may be dropped;
* the staging buffer is compressed and packed as one slice (``PagedStore._store_slice``);
* each tensor holds a :class:`Part` of that slice: its pages' sizes, kinds and checksums are
  views of the slice's, its offsets are made relative to its own first byte, and its host
  range (:class:`Batch` bounds, copied to page-locked memory after the pack) is known once the
  slice is placed. A part restores exactly as a slice does (copy engine or host fetch, then the
  decoder). The slice's host bytes go back when its last part is freed.

A tensor freed while still queued is dropped from the queue and never compressed: the hooks'
last tensors of a forward usually are, since backward uses them in place first.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _paged
from ._streams import on_stream


class Batch:
    """One slice shared by the parts of several stored tensors: the slice (``carrier``), the
    parts still holding it, and the parts' byte bounds in it (``int64 [parts + 1]``, host)."""

    __slots__ = ("carrier", "live", "host_bounds", "_bounds")

    def __init__(self, carrier, parts: int, host_bounds: torch.Tensor):
        self.carrier, self.live, self.host_bounds = carrier, parts, host_bounds
        self._bounds: list[int] | None = None

    def bounds(self) -> list[int]:
        """Each part's first byte from the slice's base, then the slice's total (read once the
        slice is confirmed: the copy ran before its pack event)."""
        if self._bounds is None:
            self._bounds = self.host_bounds.tolist()
            self.host_bounds = None
        return self._bounds


class Part:
    """The pages of one stored tensor inside a :class:`Batch`'s slice; the interface of
    ``_paged._Slice`` (``first``, ``n``, metadata on the device, ``base`` / ``total`` once
    placed, ``stored`` / ``done``)."""

    __slots__ = ("batch", "index", "first", "n", "sizes", "kinds", "rel", "desc", "sums",
                 "freed")

    def __init__(self, batch: Batch, index: int, n: int, sizes, kinds, rel, desc, sums):
        self.batch, self.index, self.first, self.n = batch, index, 0, n
        self.sizes, self.kinds, self.rel, self.desc, self.sums = sizes, kinds, rel, desc, sums
        self.freed = False

    @property
    def base(self) -> int | None:
        base = self.batch.carrier.base
        if base is None or base < 0:
            return base
        return base + self.batch.bounds()[self.index]

    @property
    def total(self) -> int:
        if self.batch.carrier.base is None:
            return 0
        bounds = self.batch.bounds()
        return bounds[self.index + 1] - bounds[self.index]

    @property
    def stored(self):
        return self.batch.carrier.stored

    def done(self) -> bool:
        return self.batch.carrier.done()

    def release(self, arena, reader) -> None:
        """This part is no longer needed: the slice's host bytes go back with its last part."""
        if self.freed:
            return
        self.freed = True
        self.batch.live -= 1
        if self.batch.live == 0:
            arena.release(self.batch.carrier, reader)


def part_tables(rel: torch.Tensor, desc: torch.Tensor, counts: list[int], pin: bool):
    """On the pack stream, after the slice's pack: per part its offsets relative to its own
    first byte (``int64 [N]``), its device descriptor (``int64 [parts, 2]``: base, or the
    slice's negative base if it failed, and bytes), and its bounds copied to the host."""
    m = len(counts)
    starts = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    # positions in (rel, total): the parts' bounds, then each page's part's first page
    index = np.concatenate([starts, np.repeat(starts[:-1], counts)])
    picked = torch.cat([rel, desc[1:]])[_paged.to_device(torch.from_numpy(index), rel.device)]
    bounds, first = picked[:m + 1], picked[m + 1:]
    lo = bounds[:-1]
    base = torch.where(desc[0] < 0, desc[0], desc[0] + lo)  # a failed slice fails every part
    part_desc = torch.stack([base, bounds[1:] - lo], dim=1)
    host_bounds = torch.empty(m + 1, dtype=torch.int64, pin_memory=pin)
    host_bounds.copy_(bounds, non_blocking=True)
    return rel - first, part_desc, host_bounds


class OffloadQueue:
    """The tensors a :class:`~._paged.PagedStore` holds back to store together (see the module
    docstring). Each queued tensor's ``PagedStored`` has ``queued`` set to this queue."""

    def __init__(self, store):
        self.store = store
        self.items: list[tuple] = []  # (stored, source, producer event)
        self.pages = 0
        self.element_size = 0

    def takes(self, nbytes: int) -> bool:
        """Whether a source of ``nbytes`` is queued (at least one page, under half a slice)."""
        return 0 < nbytes // self.store.page_size < max(2, self.store.slice_pages // 2)

    def add(self, src: torch.Tensor, element_size: int, producer) -> _paged.PagedStored:
        """Queue ``src`` (``uint8 [nbytes]``): read after ``producer``'s work so far."""
        p = self.store.page_size
        pages = src.numel() // p
        if self.items and (element_size != self.element_size
                           or self.pages + pages > self.store.slice_pages):
            self.flush()
        stored = _paged.PagedStored(src.numel(), p, [], None, None, queued=self)
        self.items.append((stored, src, _paged._record(producer)))
        self.pages += pages
        self.element_size = element_size
        if self.pages >= self.store.slice_pages:
            self.flush()
        return stored

    def drop(self, stored) -> None:
        """``stored`` was freed while queued: it is never stored."""
        for i, item in enumerate(self.items):
            if item[0] is stored:
                del self.items[i]
                self.pages -= stored.nbytes // self.store.page_size
                break
        stored.queued = None

    def clear(self) -> None:
        for item in self.items:
            item[0].queued = None
        self.items, self.pages = [], 0

    def flush(self) -> None:
        """Store every queued tensor now (see the module docstring); never waits."""
        items, self.items, self.pages = self.items, [], 0
        if not items:
            return
        store = self.store
        p, cs = store.page_size, store.compress_stream
        counts = [stored.nbytes // p for stored, _, _ in items]
        n = sum(counts)
        with on_stream(cs):
            for _, src, event in items:
                _paged._wait(cs, event)
                if cs is not None:  # the queue's reference goes below: read here first
                    src.record_stream(cs)
            staging = torch.empty(n * p, dtype=torch.uint8, device=store.device)
            torch.cat([src[:c * p] for (_, src, _), c in zip(items, counts)], out=staging)
            for stored, src, _ in items:
                if stored.nbytes % p:
                    stored.tail = torch.empty(stored.nbytes % p, dtype=torch.uint8,
                                              pin_memory=store.arena.pin)
                    stored.tail.copy_(src[stored.nbytes - stored.nbytes % p:],
                                      non_blocking=True)
            consumed = _paged._record(cs)  # the sources are read: they may go
            parts = store._store_slice(staging, 0, n, self.element_size,
                                       parts=counts)
        # the staging buffer is scratch too, for as long as the compress kernel reads it
        store.scratch_bytes = max(store.scratch_bytes,
                                  (_paged.SCRATCH_SLICES + 1) * n * p + store._scratch_held)
        for (stored, _, _), part in zip(items, parts):
            stored.slices, stored.consumed, stored.queued = [part], consumed, None
