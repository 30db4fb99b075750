"""The compressed store's decode statuses, counted on the device without a host sync.

Every restore's decoder writes a status per page (``int32``, 0 when the page decoded). The
store counts the non-zero ones into a :class:`~torch_pagecomp.handles.RestoreFailures`
(read at the end of each backward, ``PagedStore.failed_restores``), never per restore: a
count is a few launches, and BERT-large restores ~60 batches a step.

* **The restore stream's ring.** Restores issued on the store's ``restore_stream`` (the
  activation hooks' restores, batched or single) write their statuses into one ``int32
  [STATUS_PAGES]`` buffer on the device, taken in order. When the next restore's pages do not
  fit, the written part is counted in one go on that stream, and the ring is taken again
  from its start: in the stream's order, after that count. Before the ring, each restore
  allocated its statuses and the store held them per stream until ``STATUS_PAGES`` pages
  were held, then joined and counted them: ~330 us of host time per count and ~50 for the
  statuses' allocation and hand-over (line-profiled on BERT-large,
  ``bench/results/h200x2_a242d2b_session56``), for the same bound on the GPU memory they take.
* **Other streams** (a restore on a caller's stream) hand their own status tensors in: held
  per stream, counted together once ``STATUS_PAGES`` pages are held (4 bytes a page held for a
  whole backward raised BERT-large's GPU peak by 3 MiB,
  ``bench/results/h200x2_824437a_session55``) or when read.
"""

from __future__ import annotations

import torch

from ..handles import RestoreFailures
from ._streams import on_stream

# Decode statuses held on the device before they are counted, per store (4 bytes a page)
STATUS_PAGES = 1 << 16


class StatusCount:
    """Decode failures of one store's restores on CUDA device ``device``; ``ring_stream``: the
    stream whose restores take their statuses from the ring (:meth:`take`)."""

    def __init__(self, device: torch.device, ring_stream: torch.cuda.Stream):
        self.device, self.ring_stream = device, ring_stream
        with on_stream(ring_stream):
            self.failures = RestoreFailures(device)
        # made by the first restore on ring_stream (so allocated there: used in that stream's
        # order only); a store whose restores run elsewhere never makes it
        self._ring: torch.Tensor | None = None
        self._at = 0  # statuses the ring holds, not counted yet
        self._held: dict = {}  # another stream -> its status tensors not counted yet
        self._held_pages = 0

    @property
    def ring_bytes(self) -> int:
        """GPU bytes the ring holds (``4 * STATUS_PAGES`` once a restore has taken it)."""
        return 0 if self._ring is None else self._ring.numel() * self._ring.element_size()

    def take(self, pages: int, stream) -> torch.Tensor | None:
        """``int32 [pages]`` of the ring for a restore's statuses, written on ``stream`` (the
        current stream): counted later, with no more said. None where the ring does not serve
        (another stream, or more pages than it holds): the caller allocates and :meth:`add`
        hands them in."""
        if pages > STATUS_PAGES or stream != self.ring_stream:
            return None
        if self._ring is None:
            self._ring = torch.zeros(STATUS_PAGES, dtype=torch.int32, device=self.device)
        if self._at + pages > self._ring.numel():
            self._count_ring()  # (on the current stream: the ring's)
        at = self._at
        self._at = at + pages
        return self._ring[at:at + pages]

    def add(self, status: torch.Tensor, stream) -> None:
        """Count ``status`` (written on ``stream``) with the others held, once ``STATUS_PAGES``
        pages are held or at :meth:`failed`; it stays alive until then."""
        self._held.setdefault(stream, []).append(status)
        self._held_pages += status.numel()
        if self._held_pages >= STATUS_PAGES:
            self._hand_held()
            self.failures.flush()

    def failed(self) -> int:
        """Pages that failed to decode so far, as far as the host knows (never blocks): what
        is held is counted now, read by a later call."""
        if self._at:
            with on_stream(self.ring_stream):
                self._count_ring()
        self._hand_held()
        return self.failures.poll()

    def _count_ring(self) -> None:
        self.failures.count_now(self._ring[:self._at], self.ring_stream)
        self._at = 0

    def _hand_held(self) -> None:
        for stream, statuses in self._held.items():
            self.failures.add(statuses, stream)
        self._held.clear()
        self._held_pages = 0
