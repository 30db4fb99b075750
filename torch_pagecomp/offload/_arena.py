"""The host side of compressed activation storage: a *virtual arena* of page-locked host chunks
behind a device-side bump allocator, and the slices placed in it (``_paged.PagedStore``).

The host backs the arena ahead of use: before each slice it adds chunks so that the arena's
end, advanced by the slice's worst case (:func:`slice_upper`: its pages raw and its metadata),
stays backed; the device refuses (and
marks failed) a slice that would pass the backed limit, so no store ever leaves the chunks.
Before it pins a new chunk for slices still in flight it waits for them
(:meth:`VirtualArena.back`), so the chunks held follow the compressed bytes.
Slices are placed end to end, across chunk boundaries (a slice is at most a chunk long, so it
lies in one or two chunks), each with its page metadata behind its pages, in one chunk: the
arena holds the compressed bytes and little more. Chunks
behind the frontier that no live slice touches go back to a free list and back later parts of
the arena.

Placements are read back in stream order, without waiting (:meth:`VirtualArena.confirm`): a
slice's pack (or plan) publishes its ``(base, total)`` to a pinned descriptor, and the host reads
it once the kernel's event has completed. A *sent* slice (the exponent codec's pages, laid end
to end on the device) gets its copies into the arena queued then, on the copy engine; it counts
as placed (``base`` set) once they are done, and its chunks stay live until then, so no chunk
is reused while a copy still writes it.
"""

from __future__ import annotations

import collections
import functools
import time

import torch

from .._events import mark
from ..pools import SHRINK_STEPS, HostMemory, can_pin, spike_free
from ._copies import copy_to_host, host_bytes

# a 64 MiB slice (``_paged.SLICE_BYTES``) and its metadata's worst case (416 KiB for 4 KiB
# pages, :func:`slice_upper`) fit one chunk: a slice of a 64 MiB chunk left 104 pages of
# such a tensor to a second slice of their own (more launches for the host, both ways)
CHUNK_BYTES = (64 << 20) + (512 << 10)
TABLE_SIZE = 1 << 14  # chunks addressable at once (a window of TABLE_SIZE * CHUNK_BYTES)
DESC_SLOTS = 1024  # pinned placement descriptors, reused in order (one per slice in flight)


UPLOAD_SLOTS = 1 << 16  # int64 slots of the ring of small tables kernels read (UploadRing)


class UploadRing:
    """Small ``int64`` tables that kernels read straight from page-locked host memory (a
    batched restore's row table and offset shifts: three numbers per tensor or slice), written
    by the host into a ring of slots: no allocation and no host-to-device copy per table
    (``_decode.to_device`` cost a restore ~80 us a table, ``bench/results/h200_651df2a_session32``).

    The ring is two halves. When the writer moves into a half, it first waits for the kernels
    that read it the last time round: an event per stream that read it, recorded when the
    writer left it, half a ring of tables ago (long complete: the wait costs nothing). ``pin``
    False (no CUDA here): :meth:`put` gives None and callers upload as before."""

    def __init__(self, slots: int = UPLOAD_SLOTS, pin: bool = True):
        self.pin = pin
        self.buf = torch.zeros(slots if pin else 0, dtype=torch.int64, pin_memory=pin)
        self.np = self.buf.numpy()
        self.half = slots // 2
        self.at = self.cur = 0  # the next free slot, in half ``cur``
        self.readers: list[set] = [set(), set()]  # streams that read each half this time round
        self.after: list[list] = [[], []]  # events after a half's reads, taken when left

    def put(self, rows: list[list[int]], stream) -> torch.Tensor | None:
        """``rows`` (equal-length lists of ints) as an ``int64 [len(rows), k]`` tensor in the
        ring (16-byte aligned), for kernels queued on ``stream`` after this call; None if the
        ring cannot hold them (not page-locked, or more than half a ring)."""
        addr = self.put_addr(rows, stream)
        return None if addr is None else self.view_at(addr, len(rows), len(rows[0]))

    def put_addr(self, rows: list[list[int]], stream) -> int | None:
        """:meth:`put`, as the table's address (for a launch by address: no tensor made)."""
        at = self._write(rows, stream)
        return None if at is None else self.buf.data_ptr() + 8 * at

    def view_at(self, addr: int, rows: int, k: int) -> torch.Tensor:
        """The ``int64 [rows, k]`` table at ``addr`` (from :meth:`put_addr`) as a tensor."""
        at = (addr - self.buf.data_ptr()) // 8
        return self.buf[at:at + rows * k].view(rows, k)

    def _write(self, rows: list[list[int]], stream) -> int | None:
        """Write ``rows`` into the ring (see :meth:`put`); the slot of its first entry."""
        k = len(rows[0])
        need = len(rows) * k
        if not self.pin or need > self.half:
            return None
        half = self.cur
        if self.at + need > (half + 1) * self.half:  # into the other half
            # its kernels of half a ring ago waited for before the ring moves: a wait that
            # raised (an interrupt) after the move left the writer in the half it had left,
            # and the next tables went on into the other one without that wait
            for event in self.after[half ^ 1]:
                event.synchronize()
            self.after[half] = [mark(s) for s in self.readers[half]]
            half = self.cur = half ^ 1
            self.after[half], self.readers[half] = [], set()
            self.at = half * self.half
        at = self.at
        self.np[at:at + need].reshape(len(rows), k)[...] = rows
        self.at = at + need + (need & 1)  # the next table 16-byte aligned too
        self.readers[half].add(stream)
        return at

    def release(self) -> None:
        """Wait for the kernels that may still read the ring, then let it go."""
        for half in (0, 1):
            for event in self.after[half] + [mark(s) for s in self.readers[half]]:
                event.synchronize()
        self.buf = torch.zeros(0, dtype=torch.int64)
        self.np = self.buf.numpy()
        self.pin = False


def _align16(nbytes: int) -> int:
    return (nbytes + 15) & ~15


def _wait(stream, event) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _sync(event) -> None:
    """The host waits for ``event`` (None: nothing)."""
    if event is not None:
        event.synchronize()


REL, DESC, SIZES, KINDS, SUMS = range(5)  # the parts of a slice's metadata buffer


def _part(k: int, doc: str) -> property:
    """A :class:`_Slice` attribute: part ``k`` of its metadata (:meth:`_Slice.parts`)."""
    return property(lambda self: self.parts()[k], doc=doc)


class _Slice:
    """Pages ``[first, first + n)`` of one stored storage: its metadata for the decoder and
    the placement the pack kernel chose (``base``/``total`` on the host once confirmed).

    The metadata is one buffer, ``meta`` (:func:`_meta_bytes`): on the device, where the
    compress and pack kernels write it, until the slice is placed; from then on the copy the
    pack wrote into the arena, the slice's last :func:`meta_span` bytes (page-locked host
    memory, in one chunk: :meth:`VirtualArena.confirm`), and the device buffer is let go. A
    restore copies it up with the pages, in the same span. Kept on the device until the
    tensor was restored, it held 13 bytes a stored page there: at the backward's GPU peak 1
    MiB on BERT-large and 6-10 MiB on ResNet-50 above a plain copy's
    (``bench/results/h200x2_fd0815b_session57``); copied to a page-locked buffer of its own
    (an allocation, a copy and an event a slice), the hooks' steps were slower
    (``bench/results/h200x2_824437a_session55``). Its parts are views made when first asked
    for (:attr:`rel`, :attr:`sizes`, ...): the store's launches take their addresses
    (``meta``'s plus :func:`_meta_offsets`), and cutting the views for every stored slice
    cost the hooks ~20 us a saved tensor. ``host_desc``: the arena's descriptor slot the pack
    publishes the placement to (:meth:`VirtualArena.host_desc`), until confirmed.

    ``send``: a slice whose pages the GPU laid end to end in a device buffer (the placed
    exponent encoder, ``_paged``) holds that buffer here until the host has read its placement
    and queued the copy engine's copies of it into the arena (:meth:`VirtualArena.confirm`);
    ``stored`` is the event after the plan until then, after those copies from then on. A
    restore that comes before then decodes the pages from ``send`` itself
    (``PagedStore.restore``); ``read`` is the event after it, which the next slice to take
    that buffer waits for.
    ``base``/``total`` are set once the bytes are in host memory, so that whatever reads a
    placed slice on the host or by the copy engine finds them there."""

    __slots__ = ("first", "n", "meta", "checksum", "_parts", "host_desc", "stored", "base",
                 "total", "freed", "send", "read")

    def __init__(self, first: int, n: int, meta, checksum: bool = False, host_desc=None,
                 stored=None):
        self.first, self.n = first, n
        self.meta, self.checksum = meta, checksum  # uint8 [meta_span(n, checksum)]
        self._parts = None  # _meta_views(meta), made on first use
        self.host_desc, self.stored = host_desc, stored
        self.base: int | None = None
        self.total = 0
        self.freed = False
        # the payload buffer (flat) whose first bytes are its pages, until their copies are queued
        self.send: torch.Tensor | None = None
        self.read = None  # an event after the last restore that decoded ``send`` in place

    def parts(self) -> tuple:
        """:func:`_meta_views` of ``meta``: ``(rel, desc, sizes, kinds, sums)``; once placed
        ``desc`` is the arena copy's, which the pack does not write (nothing reads it then:
        the placement is known)."""
        if self._parts is None:
            self._parts = _meta_views(self.meta, self.n, self.checksum)
        return self._parts

    rel = _part(REL, "``int64 [n]``: each page's offset from the slice's base.")
    desc = _part(DESC, "``int64 [2]`` on the device: ``(base, total)`` as the pack wrote them.")
    sizes = _part(SIZES, "``int32 [n]``: each page's stored bytes.")
    kinds = _part(KINDS, "``uint8 [n]``: each page's kind.")
    sums = _part(SUMS, "``int32 [n]`` page checksums (the store's ``checksum``), or None.")

    @property
    def meta_at(self) -> int:
        """Where the metadata lies in the slice's placed bytes (``total`` known)."""
        return self.total - meta_span(self.n, self.checksum)

    def known(self) -> bool:
        """Its latest event has completed: before :meth:`VirtualArena.confirm` read it, its
        placement is in the descriptor; after, a sent slice's bytes are in host memory."""
        return self.stored is None or self.stored.query()

    def done(self) -> bool:
        """Its bytes are in host memory (whether or not the host has read the placement)."""
        return self.send is None and self.known()

    def placed_at(self, meta: torch.Tensor) -> None:
        """Placed: read the metadata from the arena (``meta``, its copy there) from now on
        and let the device buffer go. A restore queued before still reads the device one: it
        recorded its stream on it (:func:`slice_meta`)."""
        self.meta, self._parts = meta, None


def slice_meta(sl: _Slice, staging: torch.Tensor, at: int, stream) -> tuple:
    """``(rel, sizes, kinds, sums)`` of ``sl`` for a restore queued on ``stream`` that copied
    or fetched its bytes into ``staging`` at ``at``: of a placed slice, views of the copy of
    its metadata that came with them; else the slice's own device tensors (their allocation
    then also waits for ``stream`` before reuse: it is let go once the slice is placed)."""
    if sl.base is not None:
        rel, _, sizes, kinds, sums = _meta_views(staging[at + sl.meta_at:at + sl.total],
                                                 sl.n, sl.checksum)
        return rel, sizes, kinds, sums
    if stream is not None:
        sl.meta.record_stream(stream)
    return sl.rel, sl.sizes, sl.kinds, sl.sums


@functools.lru_cache(maxsize=4096)
def _meta_offsets(n: int, checksum: bool) -> tuple:
    """Byte offsets of ``(rel, desc, sizes, kinds, sums)`` in a slice's metadata buffer
    (:func:`_meta_bytes`; ``sums`` None without ``checksum``)."""
    a = _align16(8 * n)
    b = a + 16 + _align16(4 * n)
    return 0, a, a + 16, b, (b + _align16(n) if checksum else None)


def _meta_views(buf: torch.Tensor, n: int, checksum: bool) -> tuple:
    """``(rel int64 [n], desc int64 [2], sizes int32 [n], kinds uint8 [n], sums int32 [n] or
    None)``: the parts of a slice's metadata buffer (:func:`_meta_bytes` or more: the
    padding to :func:`meta_span`), cut by one ``split_with_sizes`` (a slice per part cost the
    hooks ~20 us a stored tensor)."""
    rel, desc, sizes, kinds, sums = _meta_offsets(n, checksum)
    cuts = [8 * n, desc - 8 * n, 16, 4 * n, kinds - sizes - 4 * n, n]
    if checksum:
        cuts += [sums - kinds - n, 4 * n]
    cuts.append(buf.numel() - sum(cuts))
    parts = buf.split_with_sizes(cuts)
    return (parts[0].view(torch.int64), parts[2].view(torch.int64), parts[3].view(torch.int32),
            parts[5], parts[7].view(torch.int32) if checksum else None)


def _meta_bytes(n: int, checksum: bool) -> int:
    """Bytes of a slice's metadata buffer: ``rel | desc | sizes | kinds (| sums)``, each part
    16-byte aligned (Triton compiles a kernel per pointer alignment: parts placed by ``n``
    alone would compile new variants mid-training)."""
    c = _align16(8 * n) + 16 + _align16(4 * n) + _align16(n)
    return c + 4 * n if checksum else c - _align16(n) + n


def meta_span(n: int, checksum: bool) -> int:
    """Bytes a slice's metadata takes (on the device, and at the end of its arena bytes):
    :func:`_meta_bytes` rounded up to 16 (the pack kernel copies it in 8-byte words)."""
    return _align16(_meta_bytes(n, checksum))


def slice_upper(n: int, page_size: int, checksum: bool) -> int:
    """The most arena bytes a slice of ``n`` pages takes: its pages stored raw, then its
    metadata, moved to the next chunk where it would cross into it (fewer than
    :func:`meta_span` bytes skipped)."""
    return n * page_size + 2 * meta_span(n, checksum)


class VirtualArena:
    """Page-locked host chunks behind a device-side bump allocator (see the module docstring).

    ``state`` (device ``int64 [2]``): the arena's end, in slot ``parity`` for the next slice
    (``kernels.host_pack.pack_slice``: the slots take turns); ``limit``: the backed limit,
    passed with each slice; ``table`` (``int64 [TABLE_SIZE]``, page-locked host memory the
    kernels read): the host address of each backed chunk. Host-side, ``frontier`` is the end
    as of the last confirmed slice (slices are confirmed in stream order), and ``frontier +
    pending_upper`` is never below the device's end once every planned slice has run.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        self.device, self.chunk = device, chunk_bytes
        self.pin = device.type == "cuda" and can_pin()
        self.state = torch.zeros(2, dtype=torch.int64, device=device)
        # chunk addresses: in page-locked host memory where the kernels can read it (one read
        # per program and slice), so backing a chunk is a host store, not a ``fill_`` launch
        # on the hooks' hot path; on the CPU, and on a GPU that cannot pin, an ordinary tensor
        # on ``device`` written in stream order
        host_table = device.type == "cpu" or self.pin
        self.table = torch.zeros(TABLE_SIZE, dtype=torch.int64, pin_memory=self.pin,
                                 device="cpu" if host_table else device)
        self._table_np = self.table.numpy() if host_table else None
        self.backed: dict[int, HostMemory] = {}
        self.free: list[tuple[HostMemory, torch.cuda.Event | None]] = []
        self.live: collections.Counter[int] = collections.Counter()
        self.pending: collections.deque[tuple[_Slice, int]] = collections.deque()
        # the sum of the pending slices' worst cases, kept as they come and go: the hooks
        # confirm before every saved tensor, which would otherwise add up every slice in flight
        self.pending_upper = 0
        self.limit = self.frontier = 0
        self.used = 0  # host bytes of live, confirmed slices
        # the most bytes stored at once: slices in the host's order of stores and frees, at
        # their placed sizes (:meth:`_fold`). ``used`` alone missed the slices the GPU had
        # placed and the host not yet confirmed when others were freed, and those freed
        # before their confirmation: on llama-2048 a peak of 3.23 GiB for 4.41 stored
        # (``bench/results/h200x2_055904c_stock``)
        self.peak_used = 0
        self._log: collections.deque[tuple[int, _Slice]] = collections.deque()  # (+1 stored
        # / -1 freed, slice) not folded yet: from the first slice of unknown size on
        self._stored = 0  # the folded events' bytes
        self.peak_held = 0
        self.pins = 0  # chunks made (pinned) so far: a step that made one paid for it
        self.unpins = 0  # chunks unpinned so far (``trim``)
        self.peak_backed = 0  # chunks backed at once since the last shrink
        self.peaks: list[int] = []  # ``peak_backed`` at each of the last SHRINK_STEPS shrinks
        self.placed_since_shrink = False
        # where the pack kernel publishes each slice's (base, total) (and the placed
        # encoder's slices the bytes of their pages): one pinned ring, not a pinned
        # allocation per slice; rows of four (32 bytes), so that every slot's address has the
        # same 16-byte alignment, which the direct launches key their compiled kernels on
        self.descs = torch.empty((DESC_SLOTS, 4), dtype=torch.int64, pin_memory=self.pin)
        self._descs_np = self.descs.numpy()
        self._next_desc = 0
        self.parity = 0  # the slot of ``state`` that holds the end for the next slice
        # sent slices whose copies into the arena are queued, in order: (slice, base, total)
        self.sending: collections.deque[tuple[_Slice, int, int]] = collections.deque()
        self.sending_bytes = 0  # their totals: the link's backlog the host has queued
        # the stream the copies of sent slices go on (``PagedStore.send_stream``) and the one
        # restores read the arena on; set by the store (None on the CPU)
        self.sender = self.reader = None
        # seconds the host spent waiting for packs in ``confirm(through=...)`` (which ``back``
        # and ``host_desc`` call before pinning or reusing), by why it waited (``confirm``'s
        # ``why``: a payload to reuse, room in the arena, a descriptor slot, a restore, a
        # caller's settle): a step's host time not spent working
        self.wait_by: collections.Counter = collections.Counter()

    @property
    def wait_s(self) -> float:
        """Seconds the host spent waiting for packs, whatever the reason (:attr:`wait_by`)."""
        return sum(self.wait_by.values())

    # ---------------------------------------------------------------- placement
    def chunks_of(self, base: int, total: int) -> range:
        """The chunks that arena bytes ``[base, base + total)`` lie in (one for an empty
        range)."""
        return range(base // self.chunk, (base + max(total, 1) - 1) // self.chunk + 1)

    def spans(self, base: int, total: int, at: int = 0) -> list[tuple[int, int, int]]:
        """The page-locked host bytes ``[base, base + total)`` of the arena (backed), one
        ``(offset, host address, bytes)`` per chunk they lie in, in order: ``offset`` is where
        the span goes in a buffer whose byte ``at`` takes byte ``base`` (what
        ``_copies.copy_spans`` takes: no tensor view made per span)."""
        out = []
        for k in self.chunks_of(base, total):
            start = k * self.chunk
            lo, hi = max(base, start), min(base + total, start + self.chunk)
            out.append((at + lo - base, self.backed[k].addr + lo - start, hi - lo))
        return out

    def _address(self, at: int) -> int:
        """The host address of arena byte ``at`` (backed)."""
        return self.backed[at // self.chunk].addr + at % self.chunk

    def pieces(self, base: int, total: int, at: int = 0) -> list[tuple[int, torch.Tensor]]:
        """:meth:`spans` as ``(offset, uint8 view)``: views of the chunks' host memory, for
        callers that read or write the bytes on the host while the arena holds them."""
        return [(off, host_bytes(addr, n)) for off, addr, n in self.spans(base, total, at)]

    def back(self, upper: int, stream) -> None:
        """Before planning a slice of at most ``upper`` bytes (on ``stream``): back every chunk
        the arena's end can reach and raise the limit (passed with the slice) to match.

        The end can reach as far as the worst case of every slice not yet confirmed. Where
        that would pin a new chunk (none free), the host first waits for the oldest of those
        slices, whose placement tightens the bound, and pins only what the confirmed end and
        the slices left still need. Without the wait, a host running ahead of the pack stream
        pinned chunks for its whole lead at full size: on GPU-bound steps the arena held
        about what an uncompressed copy holds (``bench/results/h200_2dfbc6f_arena``). A pinned
        chunk costs tens of milliseconds and stays held; the wait costs the host some of its
        lead, on steps that pin."""
        self.placed_since_shrink = True
        for k in self._room(upper):
            self._back_chunk(k, stream)
        # the limit passed with the slice
        self.limit = max(self.limit, (self._last_chunk(upper) + 1) * self.chunk)
        self.peak_held = max(self.peak_held, self.held_bytes)
        self.peak_backed = max(self.peak_backed, len(self.backed))

    def _room(self, upper: int) -> list[int]:
        """The chunks to pin for one more slice of ``upper`` bytes, after waiting for the
        slices in flight, the oldest first, while they would need more than the free list
        holds (:meth:`back`)."""
        new = self._unbacked(upper)
        while self.pending and len(new) > len(self.free):
            self.confirm(through=self.pending[0][0], why="room")
            new = self._unbacked(upper)
        return new

    def backlog(self) -> int:
        """Bytes stored but not yet in host memory, as far as the host knows: the sent
        slices' copies not seen done, and the worst cases of the slices not yet placed."""
        return self.sending_bytes + self.pending_upper

    def room_now(self, upper: int) -> bool:
        """Whether slices of ``upper`` bytes in all can be planned now without :meth:`back`
        waiting: nothing is in flight (a chunk is pinned if need be), or the free chunks cover
        every chunk the arena's end can reach with them. Confirms the finished slices first
        (never waits)."""
        self.confirm()
        return not self.pending or len(self._unbacked(upper)) <= len(self.free)

    def _unbacked(self, upper: int) -> list[int]:
        """The chunks not backed yet that the arena's end can reach with one more slice of
        ``upper`` bytes: from the confirmed end through the worst case of every slice in
        flight and that one."""
        first = max(self.limit // self.chunk, self.frontier // self.chunk)
        return [k for k in range(first, self._last_chunk(upper) + 1) if k not in self.backed]

    def _last_chunk(self, upper: int) -> int:
        """The last chunk the arena's end can reach with one more slice of ``upper`` bytes:
        the confirmed end plus the worst case of every slice in flight and of that one."""
        return (self.frontier + self.pending_upper + upper - 1) // self.chunk

    def _back_chunk(self, k: int, stream) -> None:
        # checked before a chunk is taken: raised after, the chunk taken was in neither
        # ``free`` nor ``backed`` (uncounted, unpinned whenever it was collected)
        if (k - TABLE_SIZE) in self.backed:
            raise RuntimeError("activation offload: host arena window exceeded")
        if self.free:
            mem, last_read = self.free.pop()
            _wait(stream, last_read)  # restores of its previous slices read it first
            mem.last_use = last_read  # still theirs if it goes back to the free list unused
        else:
            mem = HostMemory(self.chunk, pin=self.pin)
            self.pins += 1
        self.backed[k] = mem
        if self._table_np is not None:  # read by kernels launched after this store
            self._table_np[k % TABLE_SIZE] = mem.addr
        else:
            self.table[k % TABLE_SIZE : k % TABLE_SIZE + 1].fill_(mem.addr)

    def host_desc(self) -> int:
        """The slot ``k`` of ``descs`` (pinned ``int64 [2]`` rows) the next slice's placement is
        published to. Slot ``k`` is reused ``DESC_SLOTS`` slices later, once the slice before
        has been confirmed."""
        if len(self.pending) >= DESC_SLOTS:
            self.confirm(through=self.pending[len(self.pending) - DESC_SLOTS][0], why="desc")
        k = self._next_desc
        self._next_desc = (k + 1) % DESC_SLOTS
        return k

    def desc_addr(self, k: int) -> int:
        """The address of descriptor slot ``k`` (:meth:`host_desc`)."""
        return self.descs.data_ptr() + 32 * k

    def add(self, sl: _Slice, upper: int) -> None:
        self.pending.append((sl, upper))
        self.pending_upper += upper
        self._log.append((1, sl))

    def _fold(self) -> None:
        """Apply the logged stores and frees whose slices' sizes are known, in order, to the
        stored bytes and their peak (a slice that did not fit counts nothing)."""
        log = self._log
        while log and log[0][1].base is not None:
            sign, sl = log.popleft()
            if sl.base >= 0:
                self._stored += sign * sl.total
                self.peak_used = max(self.peak_used, self._stored)

    # -------------------------------------------------------------- confirmation
    def confirm(self, through: _Slice | None = None, why: str = "caller") -> None:
        """Read the placement of finished slices in stream order (all up to ``through``,
        waiting for it if needed; else only those already finished, without waiting). A sent
        slice's copies into the arena are queued here; it counts as placed once they are
        done (:meth:`_publish`, never waiting; :meth:`settle` waits). ``why``: what a wait is
        counted as in :attr:`wait_by`."""
        while self.pending:
            sl, _ = self.pending[0]
            if not sl.known():
                if through is None or through.host_desc is None:  # (read already)
                    break
                t0 = time.perf_counter()
                sl.stored.synchronize()
                self.wait_by[why] += time.perf_counter() - t0
            self.pending_upper -= self.pending.popleft()[1]
            base, total, pages, _ = self._descs_np[sl.host_desc].tolist()
            sl.host_desc = None
            if base >= 0:
                self.frontier = base + total
                if not sl.freed:  # its chunks are written (sent: once the copies are done)
                    self.live.update(self.chunks_of(base, total))
                    self.used += total
            if sl.send is not None and base >= 0 and not sl.freed:
                self._send(sl, base, total, pages)
            else:
                sl.send = None  # (a slice freed before it was read is not sent)
                self._placed(sl, base, total)
            if sl is through:
                break
        self._publish()
        self._fold()

    def _send(self, sl: _Slice, base: int, total: int, pages: int) -> None:
        """Queue the copies of a sent slice into the arena: its pages (``pages`` bytes, end
        to end from its buffer's start) at ``base``, its metadata (the device buffer, whose
        ``rel`` the encoder wrote) at its end, in one chunk."""
        meta = meta_span(sl.n, sl.checksum)
        spans = self.spans(base, pages) if pages else []
        copy_to_host(sl.send, spans, self.sender)
        copy_to_host(sl.meta, [(0, self._address(base + total - meta), meta)], self.sender)
        sl.stored, sl.send = mark(self.sender), None
        self.sending.append((sl, base, total))
        self.sending_bytes += total

    def _publish(self) -> None:
        """Sent slices whose copies are done are placed, in order (never waits)."""
        while self.sending and self.sending[0][0].known():
            self.sending_bytes -= self.sending[0][2]
            self._placed(*self.sending.popleft(), sent=True)

    def settle(self) -> None:
        """Wait for the copies of every sent slice read so far, and place them."""
        for sl, _, _ in self.sending:
            _sync(sl.stored)
        self._publish()

    def _placed(self, sl: _Slice, base: int, total: int, sent: bool = False) -> None:
        """``sl``'s bytes are in host memory at ``base`` (``base < 0``: it did not fit).
        ``sent``: its copies were queued by :meth:`_send`, when it was live."""
        sl.base, sl.total, sl.stored = base, total, None
        if base < 0:
            return
        if sl.freed:  # freed while its copies ran: let its chunks go now (freed before
            if sent:  # it was read, it never held them)
                self._unlive(sl)
        else:
            sl.placed_at(host_bytes(self._address(base + sl.meta_at),
                                    meta_span(sl.n, sl.checksum)))

    def release(self, sl: _Slice, reader) -> None:
        """``sl`` is no longer needed; chunks behind the frontier with nothing live go back to
        the free list (reused after the restores queued on ``reader`` so far)."""
        if sl.freed:
            return
        sl.freed = True
        self._log.append((-1, sl))
        self._fold()
        if sl.base is None or sl.base < 0:  # placement unknown (dropped when confirmed, or
            return  # once its copies are done), or nothing placed
        self._unlive(sl, reader)

    def _unlive(self, sl: _Slice, reader=None) -> None:
        """Take placed ``sl``'s bytes off its chunks (see :meth:`release`)."""
        span = self.chunks_of(sl.base, sl.total)
        self.live.subtract(span)
        for k in span:
            if self.live[k] <= 0:
                del self.live[k]
        self.used -= sl.total
        event = None
        for k in sorted(self.backed):
            if k >= self.frontier // self.chunk:
                break
            if k not in self.live:
                event = event or mark(reader or self.reader)
                self.free.append((self.backed.pop(k), event))

    def reset_peaks(self) -> None:
        """Start ``peak_held`` and ``peak_used`` (reported in the store's stats) from now."""
        self.peak_held, self.peak_used = self.held_bytes, self._stored

    @property
    def held_bytes(self) -> int:
        return (len(self.backed) + len(self.free)) * self.chunk

    def trim(self, keep: int = 0) -> None:
        """Unpin free chunks beyond ``keep`` (the oldest first)."""
        while len(self.free) > keep:
            mem, event = self.free[0]
            # a restore may still read it; waited for while it is listed: a wait that raises
            # (an interrupt) leaves it free, not lost (out of the counts, pinned until collected)
            _sync(event)
            del self.free[0]
            mem.release()
            self.unpins += 1

    def release_idle(self, reader=None) -> None:
        """Unpin every chunk no slice needs: the free ones, and, once no slice is in flight or
        live, the backed ones too (the chunk at the end, and those backed ahead of it for
        slices in flight then). For an offloader that settled on copying: ``trim`` alone left
        the backed ones pinned (0.38 GiB on encoder-1024, ``bench/results/h200_2dfbc6f_arena``).
        Restores queued on ``reader`` so far may still read them: unpinned after those. The
        next slice backs its chunks anew (the limit drops to the end's chunk)."""
        self.confirm()
        if not self.pending and not self.sending and not self.live and self.backed:
            event = mark(reader)
            self.free.extend((mem, event) for mem in self.backed.values())
            self.backed.clear()
            self.limit = self.frontier // self.chunk * self.chunk
        self.trim()
        self.peak_backed = len(self.backed)
        self.peaks = []

    def _free_lead(self) -> None:
        """With no slice in flight, put the chunks backed past the end's chunk (backed for
        the worst cases of slices since placed) on the free list, and the limit back to the
        end's chunk: they hold nothing, and kept backed they stayed until the arena's end
        passed them, so a step that saved more than the next ones (a gradient check, whose
        SDPA math kernel saves the attention matrix) held them for several steps more
        (0.5-0.9 GiB under FSDP2, ``bench/results/h200x2_96f5538_session48``)."""
        self.confirm()
        if self.pending:
            return
        end = self.frontier // self.chunk
        lead = [k for k in self.backed if k > end and k not in self.live]
        for k in lead:  # unused since backed: its earlier slices' restores are the last reads
            mem = self.backed.pop(k)
            self.free.append((mem, mem.last_use))
        if lead:  # the limit never claims a chunk that is not backed
            self.limit = min(self.limit, (end + (end in self.backed)) * self.chunk)

    def shrink(self) -> None:
        """Once a step (the end of a backward): keep the chunks that the busiest moment of the
        last ``SHRINK_STEPS`` steps needed, plus a headroom (1/16 of them, at least 2); unpin
        the rest. A lone spike of the window is not counted (``pools.spike_free``: a first
        step or a gradient check lets its extra chunks go at the next shrink); steps whose
        sizes change from one to the next (a new sequence length each) all are. Until
        session 78 every step over 1.25 times the window's upper median was left
        out, and with a new length each step the longest steps' chunks went and were pinned
        again a few steps later (GPT-2: 2.3 pinned and 2.5 unpinned a step,
        ``bench/results/h200_session78``).

        Pinning and unpinning are what cost: on an H200 host a 64 MiB chunk's
        ``cudaHostRegister`` took 37 ms, and its ``cudaHostUnregister`` waits for the whole
        device (507 ms beside a 0.5 s kernel; 1.5 ms idle), then unmapping takes 9 ms
        (``bench/results/h200x2_91fcaaa_session49``, ``bench.dev_pin_cost``). Keeping only
        the last step's busiest moment (before) unpinned, and pinned again, whenever the
        chunks a step needs moved by more than the headroom, which they do with timing (the
        worst-case reservations of the slices in flight): under FSDP2 the backward's tail
        then waited for the GPU (GPT-2: 10 ms of a 150 ms step's host time, sampled).
        Without a placement since the last call nothing changes: a step that only copied
        (``prefer="speed"``'s trials alternate copied and compressed steps) keeps the chunks
        for the next compressing step. Giving them back there made every compressed trial pin
        them again (~0.7 s a step on encoder-1024, ``h200_668a96c_stock``), so the tuner
        chose copying where compressing was faster. An offloader that settles on copying
        unpins its free chunks then (``ActivationOffloader._tuned_arm``)."""
        if not self.placed_since_shrink:
            return
        self._free_lead()
        self.peaks = [*self.peaks, self.peak_backed][-SHRINK_STEPS:]
        busiest = max(self.peaks[i] for i in spike_free(self.peaks))
        need = busiest + max(2, busiest // 16)
        self.trim(keep=max(0, need - len(self.backed)))
        self.peak_backed = len(self.backed)
        self.placed_since_shrink = False
