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
  before any unpack or wait (``ActivationOffloader._flush_batches``): one ``torch.cat`` on the
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

import torch

from ._streams import on_stream

BATCH_BYTES = 64 << 20  # the store's slice (``_paged.SLICE_BYTES``): a batch is one compress
# launch and one pack, and its ``torch.cat`` holds at most this much GPU memory twice


class Batch:
    """Storages (``uint8 [n_i]``, whole pages each) waiting to be stored as one ``entry``
    (the ``_Entry`` every member's saved tensor holds). ``key``: ``(device, compute stream,
    float format, element size)``, what the members share."""

    __slots__ = ("key", "entry", "parts", "nbytes", "element_size", "float_format")

    def __init__(self, key: tuple, entry, element_size: int, float_format: str | None):
        self.key, self.entry = key, entry
        self.element_size, self.float_format = element_size, float_format
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
