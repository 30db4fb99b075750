"""Small saved storages stored together: one compressed offload for several.

A compressed offload costs the host about the same whatever its size: the store's two
launches and events each way, its allocations, and the hooks' book-keeping of an entry
(stash, ledger, group, restore). One by one, that was 110-180 us a tensor of 1-16 MiB on an
H200 host; four tensors stored as one took 47-56 us a tensor, sixteen 14-38 us
(``bench/results/h200_0991b9a_session42/batch_offload_0991b9a.txt``). On the stock models the
hooks' host time per saved tensor is what a compressed step waits for (#21), so the offloader
gathers the storages of one codec, element size and compute stream, up to
:data:`BATCH_BYTES`, and stores them as one entry (interleaved steps, against each storage
stored alone: ResNet-50 1.24x -> 1.10x a plain copy's step, BERT-large 1.37x -> 1.09x,
encoder-1024 and the ResNet-style model 5-7% faster; same directory):

* each member is a storage of whole pages, so it starts at a page-aligned byte offset of the
  batch; its saved tensor is a view of the batch's storage there (``_Packed``'s offset);
* the batch is stored when it is full, when a prefetch group ends, when the pass ends, and
  before any unpack or wait (:meth:`Batcher.flush_all`; not while a CUDA graph is captured):
  one ``torch.cat`` on the
  compute stream the members were saved on (HBM time, a small part of the link time the bytes
  then take), after which the members' storages go back to the allocator in stream order;
* the batch's restore is one buffer; it lives until autograd has released every member's
  saved tensor (the members come from one group: one block's backward);
* a batch that cannot be stored (its ``cat`` out of GPU memory, its store failing) keeps its
  members where they are: each saved tensor is then served from its own storage until the end
  of backward, as a single offload that fails is.

Tensors of a class still being sampled by the ratio policy are stored alone (a sample's size
is measured per stored tensor), as are storages with a partial last page and those larger
than half a batch (one slice of their own: nothing to gain).
"""

from __future__ import annotations

import weakref

import torch

from ._entry import _capturing, _Entry
from ._streams import current_stream, on_stream

BATCH_BYTES = 64 << 20  # the store's slice (``_paged.SLICE_BYTES``): a batch is one compress
# launch and one pack, and its ``torch.cat`` holds at most this much GPU memory twice


class Batch:
    """Storages (``uint8 [n_i]``, whole pages each) waiting to be stored as one ``entry``
    (the ``_Entry`` every member's saved tensor holds). ``key``: ``(device, compute stream,
    float format, element size)``, what the members share."""

    __slots__ = ("key", "entry", "parts", "nbytes")

    def __init__(self, key: tuple, entry):
        self.key, self.entry = key, entry
        self.parts: list[torch.Tensor] = []
        self.nbytes = 0

    def add(self, src: torch.Tensor) -> int:
        """Append ``src``; returns its byte offset in the batch."""
        base = self.nbytes
        self.parts.append(src)
        self.nbytes += src.numel()
        return base

    def joined(self) -> torch.Tensor:
        """The members' bytes back to back, queued on the compute stream they were saved on
        (the one member itself, else one ``torch.cat``). The members stay in ``parts`` (a
        failed ``cat``, out of GPU memory, leaves them where they are)."""
        if len(self.parts) == 1:
            return self.parts[0]
        with on_stream(self.entry.stream):
            return torch.cat(self.parts)

    def bases(self) -> list[tuple[int, torch.Tensor]]:
        """``(byte offset, storage bytes)`` of each member."""
        out, at = [], 0
        for p in self.parts:
            out.append((at, p))
            at += p.numel()
        return out


class Batcher:
    """The batches of one :class:`~._hooks.ActivationOffloader` (``offloader._batcher``): a
    part it owns, reaching its state (pass, stores, stash, counters) through a weak reference,
    as ``_backward.Backward`` does. Called under the offloader's lock."""

    def __init__(self, offloader):
        self._owner = weakref.ref(offloader)
        self.batches: dict[tuple, Batch] = {}  # waiting to be stored, by key
        self.nbytes = 0  # their bytes (held where they are until then)

    def takes(self, nbytes: int, cls: tuple) -> bool:
        """Whether a compressed storage of ``nbytes`` of class ``cls`` waits to be stored with
        others: whole pages, at most half a batch, of a class the ratio policy has decided (a
        sample is measured alone)."""
        off = self._owner()
        return (nbytes % off.page_size == 0 and nbytes <= BATCH_BYTES // 2
                and cls in off.policy.decided)

    def add(self, src: torch.Tensor, esize: int, ff: str | None) -> tuple[_Entry, int]:
        """Add ``src`` (``uint8 [n]``, a saved storage) to the batch of its key: ``(the
        batch's entry, src's byte offset in it)``. The batch is stored first if ``src`` would
        overflow it, and after if the GPU bytes held pass ``max_in_flight_bytes`` or its
        members reach ``max_in_flight_tensors`` (torchtune's ``max_fwd_stash_size``; the stash
        counts a batch's members, not one)."""
        off = self._owner()
        dev = src.device
        stream = current_stream(dev) if dev.type == "cuda" else None
        key = (dev, stream, ff, esize)
        batch = self.batches.get(key)
        if batch is not None and batch.nbytes + src.numel() > BATCH_BYTES:
            self.flush(batch)
            batch = None
        if batch is None:
            ps = off._pass
            entry = _Entry(off._sink, 0, dev, ps, len(ps.groups) - 1)
            entry.stream = stream
            entry.store = off._paged_store(dev) if stream is not None else off._cpu_compressed
            batch = self.batches[key] = Batch(key, entry)
        entry, base = batch.entry, batch.add(src)
        self.nbytes += src.numel()
        most = off.max_in_flight_tensors
        if ((most is not None and len(batch.parts) >= most) or stream is not None
                and off._stash_bytes + self.nbytes > off._in_flight_limit()):
            self.flush(batch)  # then bounded as any offload
        off._group_bytes_add(src.numel())
        return entry, base

    def flush_all(self) -> None:
        """Store every waiting batch; not while the current stream captures a CUDA graph (its
        launches and events would go into the graph): the next flush after the capture does."""
        if not self.batches or _capturing():
            return
        while self.batches:
            self.flush(next(iter(self.batches.values())))

    def flush(self, batch: Batch) -> None:
        """Store ``batch`` as one entry; if that fails, keep its members in place."""
        off = self._owner()
        del self.batches[batch.key]
        self.nbytes -= batch.nbytes
        entry, members = batch.entry, len(batch.parts)
        _, _, ff, esize = batch.key
        entry.nbytes, entry.members = batch.nbytes, members
        try:
            src = batch.joined()
            if entry.stream is not None:
                entry.stored = entry.store.offload(src, esize, producer=entry.stream,
                                                   float_format=ff)
            else:
                entry.stored = off._store_cpu(entry.store, src, esize, ff)
        except Exception as exc:  # noqa: BLE001 - the members stay where they are (unpack
            # serves each from its own storage until the end of backward): nothing lost
            off.counters["offload_failed"] += members
            off._last_error = repr(exc)
            entry.error, entry.parts = exc.with_traceback(None), batch.bases()
            off._failed.add(entry)
            return
        finally:
            batch.parts = []
        off.counters["batched"] += members
        off._count(entry, ff, members, entry.nbytes)
        off._track(entry, src)
