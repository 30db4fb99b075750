"""The host side of compressed activation storage: page-locked chunks behind a device-side
bump allocator (:class:`VirtualArena`), and the slices placed in it.

A *slice* is one compress launch and one pack launch: up to ``SLICE_BYTES`` of pages, which
belong to one stored tensor or (the activation hooks batch the tensors a block saves) to
several. Each stored tensor's share of a slice is a :class:`_Part`: its pages are consecutive
in the slice, so are their bytes in host memory, and the pack kernel publishes every page's
offset to the host as well, so that a part alone can be brought back with its exact bytes.
"""

from __future__ import annotations

import collections

import torch

from ..pools import HostMemory, can_pin

CHUNK_BYTES = 64 << 20
TABLE_SIZE = 1 << 14  # chunks addressable at once (a window of TABLE_SIZE * CHUNK_BYTES)
DESC_SLOTS = 1024  # pinned placement descriptors, reused in order (one per slice in flight)


class SliceNotStored(RuntimeError):
    """A slice of a stored tensor did not fit the host arena: its data was not stored."""

    def __init__(self, pages: int):
        super().__init__(f"compressed store: a slice of {pages} pages did not fit the host "
                         "arena; its data was not stored")


def _record(stream) -> torch.cuda.Event | None:
    return stream.record_event() if stream is not None else None


def _wait(stream, event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


class _Slice:
    """Pages ``[0, n)`` of one compress launch: device metadata for the decoder (``rel``
    int64, ``sizes`` int32, ``kinds`` uint8, ``sums`` int32 or None, ``[n]`` each), the
    placement the pack kernel chose (``base``/``total`` on the host once confirmed), and the
    first page of each of its parts (``ats``; their byte offsets ``starts`` once confirmed)."""

    __slots__ = ("n", "sizes", "kinds", "rel", "desc", "host_desc", "host_rel", "stored",
                 "base", "total", "freed", "sums", "ats", "starts", "users")

    def __init__(self, n: int, sizes, kinds, rel, desc, host_desc, stored, sums=None,
                 ats: tuple = (0,), host_rel=None):
        self.n = n
        self.sizes, self.kinds, self.rel, self.desc = sizes, kinds, rel, desc
        self.sums = sums
        self.host_desc, self.stored = host_desc, stored
        self.host_rel = host_rel  # pinned int64 [n]: ``rel`` on the host (several parts)
        self.ats = ats
        self.starts: list[int] | None = None
        self.users = len(ats)  # parts not freed yet
        self.base: int | None = None
        self.total = 0
        self.freed = False

    def done(self) -> bool:
        return self.stored is None or self.stored.query()

    def placed(self, base: int, total: int) -> None:
        """The pack kernel's placement, read from the host descriptors once it finished."""
        self.base, self.total = base, total
        if len(self.ats) == 1:
            self.starts = [0, total]
        elif base >= 0:
            rel = self.host_rel.numpy()
            self.starts = [int(rel[a]) for a in self.ats] + [total]
        self.host_desc = self.host_rel = self.stored = None


class _Part:
    """Pages ``[at, at + n)`` of slice ``sl`` (its part ``k``): pages ``[first, first + n)``
    of one stored tensor. ``base``/``total``: where its bytes lie in the arena once the slice
    is placed (None before; ``base`` -1 when the slice did not fit)."""

    __slots__ = ("sl", "k", "at", "n", "first", "freed")

    def __init__(self, sl: _Slice, k: int, at: int, n: int, first: int):
        self.sl, self.k, self.at, self.n, self.first = sl, k, at, n, first
        self.freed = False

    def done(self) -> bool:
        return self.sl.done()

    @property
    def base(self) -> int | None:
        b = self.sl.base
        return b if b is None or b < 0 else b + self.sl.starts[self.k]

    @property
    def start(self) -> int:
        """Its first byte's offset from the slice's base (once placed)."""
        return self.sl.starts[self.k]

    @property
    def total(self) -> int:
        st = self.sl.starts
        return 0 if st is None else st[self.k + 1] - st[self.k]

    def meta(self) -> tuple:
        """``(rel, sizes, kinds, sums)`` of its pages (``rel`` from the slice's base; ``sums``
        None without checksums): the slice's own tensors when it is the whole slice."""
        sl = self.sl
        if self.at == 0 and self.n == sl.n:
            return sl.rel, sl.sizes, sl.kinds, sl.sums
        a, b = self.at, self.at + self.n
        return (sl.rel[a:b], sl.sizes[a:b], sl.kinds[a:b],
                None if sl.sums is None else sl.sums[a:b])

    @property
    def sizes(self):
        return self.meta()[1]

    @property
    def kinds(self):
        return self.meta()[2]

    @property
    def rel(self):
        return self.meta()[0]


class VirtualArena:
    """Page-locked host chunks behind a device-side bump allocator (see the module docstring).

    ``state`` (device ``int64 [2]``): the arena's end, in slot ``parity`` for the next slice
    (``kernels.host_pack.pack_slice``: the slots take turns); ``limit``: the backed limit,
    passed with each slice; ``table`` (device
    ``int64 [TABLE_SIZE]``): the host address of each backed chunk. Host-side, ``bound`` is
    never below the device's end once every planned slice has run; ``frontier`` is the end as
    of the last confirmed slice (slices are confirmed in stream order).
    """

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        self.device, self.chunk = device, chunk_bytes
        self.pin = device.type == "cuda" and can_pin()
        self.state = torch.zeros(2, dtype=torch.int64, device=device)
        self.table = torch.zeros(TABLE_SIZE, dtype=torch.int64, device=device)
        self.backed: dict[int, HostMemory] = {}
        self.free: list[tuple[HostMemory, torch.cuda.Event | None]] = []
        self.live: collections.Counter[int] = collections.Counter()
        self.pending: collections.deque[tuple[_Slice, int]] = collections.deque()
        self.limit = self.bound = self.frontier = 0
        self.used = 0  # host bytes of live, confirmed slices
        self.peak_held = 0
        self.peak_backed = 0  # chunks backed at once since the last shrink
        self.placed_since_shrink = False
        # where the pack kernel publishes each slice's (base, total): one pinned ring, not a
        # pinned allocation per slice
        self.descs = torch.empty((DESC_SLOTS, 2), dtype=torch.int64, pin_memory=self.pin)
        self._next_desc = 0
        self.parity = 0  # the slot of ``state`` that holds the end for the next slice

    # ---------------------------------------------------------------- placement
    def _advance(self, pos: int, size: int) -> int:
        if pos % self.chunk + size > self.chunk:
            pos = (pos // self.chunk + 1) * self.chunk
        return pos + size

    def back(self, upper: int, stream) -> None:
        """Before planning a slice of at most ``upper`` bytes (on ``stream``): back every chunk
        the arena's end can reach and raise the limit (passed with the slice) to match."""
        self.bound = self._advance(self.bound, upper)
        self.placed_since_shrink = True
        last = (self.bound - 1) // self.chunk
        first = max(self.limit // self.chunk, self.frontier // self.chunk)
        for k in range(first, last + 1):
            if k not in self.backed:
                self._back_chunk(k, stream)
        self.limit = max(self.limit, (last + 1) * self.chunk)  # passed with the slice
        self.peak_held = max(self.peak_held, self.held_bytes)
        self.peak_backed = max(self.peak_backed, len(self.backed))

    def _back_chunk(self, k: int, stream) -> None:
        if self.free:
            mem, last_read = self.free.pop()
            _wait(stream, last_read)  # restores of its previous slices read it first
        else:
            mem = HostMemory(self.chunk, pin=self.pin)
        if (k - TABLE_SIZE) in self.backed:
            raise RuntimeError("activation offload: host arena window exceeded")
        self.backed[k] = mem
        self.table[k % TABLE_SIZE : k % TABLE_SIZE + 1].fill_(mem.tensor.data_ptr())

    def host_desc(self) -> torch.Tensor:
        """The pinned ``int64 [2]`` the next slice's placement is published to. Slot ``k`` is
        reused ``DESC_SLOTS`` slices later, once the slice before has been confirmed."""
        if len(self.pending) >= DESC_SLOTS:
            self.confirm(through=self.pending[len(self.pending) - DESC_SLOTS][0])
        k = self._next_desc
        self._next_desc = (k + 1) % DESC_SLOTS
        return self.descs[k]

    def add(self, sl: _Slice, upper: int) -> None:
        self.pending.append((sl, upper))

    # -------------------------------------------------------------- confirmation
    def confirm(self, through: _Slice | None = None) -> None:
        """Read the placement of finished slices in stream order (all up to ``through``,
        waiting for it if needed; else only those already finished, without waiting)."""
        confirmed = False
        while self.pending:
            sl, _ = self.pending[0]
            if not sl.done():
                if through is None or through.base is not None:
                    break
                sl.stored.synchronize()
            self.pending.popleft()
            confirmed = True
            base, total = (int(v) for v in sl.host_desc.tolist())
            sl.placed(base, total)
            if base >= 0:
                self.frontier = base + total
                if not sl.freed:
                    self.live[base // self.chunk] += 1
                    self.used += total
            if sl is through:
                break
        if confirmed:  # the bound from the confirmed end, tighter
            self.bound = self.frontier
            for _, upper in self.pending:
                self.bound = self._advance(self.bound, upper)
        self.placed_since_shrink = True

    def release(self, part: _Part, reader) -> None:
        """``part`` is no longer needed. Once no part of its slice is, chunks behind the
        frontier with nothing live go back to the free list (reused after the restores queued
        on ``reader`` so far)."""
        if part.freed:
            return
        part.freed = True
        sl = part.sl
        sl.users -= 1
        if sl.users > 0:
            return
        if sl.base is None:
            sl.freed = True  # its placement is still unknown: dropped when confirmed
            return
        if sl.base < 0 or sl.freed:
            return
        sl.freed = True
        k = sl.base // self.chunk
        self.live[k] -= 1
        if self.live[k] <= 0:
            del self.live[k]
        self.used -= sl.total
        event = None
        for k in sorted(self.backed):
            if k >= self.frontier // self.chunk:
                break
            if k not in self.live:
                event = event or _record(reader)
                self.free.append((self.backed.pop(k), event))

    @property
    def held_bytes(self) -> int:
        return (len(self.backed) + len(self.free)) * self.chunk

    def trim(self, keep: int = 0) -> None:
        """Unpin free chunks beyond ``keep`` (the oldest first)."""
        while len(self.free) > keep:
            mem, event = self.free.pop(0)
            if event is not None:
                event.synchronize()  # a restore may still read it
            mem.release()

    def shrink(self) -> None:
        """Keep as many chunks as the busiest moment since the last call needed; unpin the
        rest (after a step whose offloads were smaller, or a first step that was larger). A
        step that placed nothing here (it copied: ``prefer="speed"``'s trials) says nothing
        about the next compressing one: the chunks stay."""
        if not self.placed_since_shrink:
            return
        self.trim(keep=max(0, self.peak_backed - len(self.backed)))
        self.peak_backed = len(self.backed)
        self.placed_since_shrink = False


