"""The host bytes that offloaded tensors hold, each at its stored size, and their peak.

A compressed tensor's stored size reaches the host only once its pages are placed, after the
host has issued more work. Counting such a tensor at its uncompressed size until then would
make the peak depend on how far the host runs ahead of the device (a faster host, more tensors
in flight, a higher "peak"). The ledger keeps the order in which tensors came and went and
settles the running total in that order as the sizes become known: the peak is that of the
stored sizes, whenever they are learnt. A tensor freed before its size was learnt (a batch
served in place at the start of a backward, its pages still packing) is counted at its stored
size too, once its placement is read, where its stored object says how
(``size_when_placed``); else at its uncompressed size.
"""

from __future__ import annotations

import collections


class HostLedger:
    """Running total and peak of the stored bytes of live offloaded tensors."""

    def __init__(self) -> None:
        self._events: collections.deque = collections.deque()  # (record, +1 | -1), in order
        self.now = 0  # settled total: every event up to the first unsized one
        self.peak = 0

    def add(self, stored, nbytes: int) -> list:
        """A tensor of ``nbytes`` now lives in ``stored`` (``host_nbytes()`` is its stored
        size, or None until known). Returns its record, for :meth:`remove`."""
        rec = [stored, nbytes, None]
        self._events.append((rec, 1))
        self.settle()
        return rec

    def remove(self, rec: list) -> None:
        """The tensor of ``rec`` is gone (call before its storage is freed)."""
        _size(rec, final=True)
        self._events.append((rec, -1))
        self.settle()

    def settle(self) -> None:
        """Apply, in order, every event whose size is known."""
        events = self._events
        while events:
            rec, sign = events[0]
            size = _size(rec, final=False)
            if size is None:
                return
            events.popleft()
            self.now += sign * size
            if self.now > self.peak:
                self.peak = self.now

    def reset_peak(self) -> None:
        self.settle()
        self.peak = self.now


def _size(rec: list, final: bool) -> int | None:
    """``rec``'s stored size, once known; ``final``: the tensor is freed now (its stored
    object's ``size_when_placed`` then stands in for it until the size is known; without one,
    it counts at its uncompressed size)."""
    if rec[2] is None:
        src = rec[0]
        if src is None:
            size = 0
        elif callable(src):  # a freed tensor's size_when_placed
            size = src()
        else:
            size = src.host_nbytes()
        if size is None and final:
            later = None if callable(src) else getattr(src, "size_when_placed", None)
            if later is not None:
                rec[0] = later()  # the record no longer keeps the stored object
                return None
            size = rec[1]
        if size is not None:
            rec[2], rec[0] = size, None  # the record no longer keeps the storage alive
    return rec[2]
