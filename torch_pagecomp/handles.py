"""What ``PageCompressor`` hands back and counts: :class:`OffloadHandle` (one offloaded
tensor, over any ``Storage``: the ring's batches or the kernel-only store's slices) and
:class:`RestoreFailures` (pages that failed to decode in GPU restores, counted on the device
without a host sync; the activation store counts its restores' failures with it too), and the
per-page checksums a checked restore compares.
"""

from __future__ import annotations

import operator
import threading
import weakref

import torch

from . import format as fmt
from ._events import handoff
from .api import checksum_status, page_checksums
from .format import PageCompError
from .storage import Storage


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view (any dtype, 0-d included)."""
    return t.reshape(-1).view(torch.uint8)


def _page_sums(data: torch.Tensor, page_size: int) -> torch.Tensor:
    """The format's checksum of each page of ``data`` (``uint8 [nbytes]``; a partial last
    page counts as zero-padded to a whole one): ``int32 [ceil(nbytes / P)]`` on ``data``'s
    device, on its current stream."""
    full, rest = divmod(data.numel(), page_size)
    sums = [page_checksums(data[:full * page_size].view(full, page_size))] if full else []
    if rest:
        last = torch.zeros((1, page_size), dtype=torch.uint8, device=data.device)
        last[0, :rest] = data[full * page_size:]
        sums.append(page_checksums(last))
    return sums[0] if len(sums) == 1 else torch.cat(sums)


def _checked(status: torch.Tensor, dst: torch.Tensor, handle: OffloadHandle) -> torch.Tensor:
    """``status`` (``int32``, one per page of the restore) with ``STATUS_CHECKSUM`` where a page
    decoded without error to bytes whose checksum is not the stored one (device work only)."""
    got = _page_sums(dst, handle.page_size)
    if got.numel() != status.numel():  # the statuses do not cover the pages one to one
        raise RuntimeError(f"restore: {status.numel()} statuses for {got.numel()} pages")
    return checksum_status(status, got, handle.checksums)


class OffloadHandle:
    """One offloaded tensor. ``state``: "pending" (batches in flight), "ready", "failed",
    "freed". ``nbytes`` is the uncompressed size, ``stored_nbytes`` the host bytes held
    (packed payload + metadata; final once ready). ``page_size`` and ``element_size`` are
    those it was stored with (a restore checks the page size). Dropping the handle frees its
    storage.
    """

    __slots__ = ("_storage", "_shape", "_dtype", "_nbytes", "_page_size", "_element_size",
                 "checksums", "_free", "__weakref__")

    def __init__(self, storage: Storage, shape, dtype, nbytes, page_size, element_size):
        self._storage = storage
        self._shape = torch.Size(shape)
        self._dtype = dtype
        self._nbytes = nbytes
        self._page_size = page_size
        self._element_size = element_size
        self.checksums: torch.Tensor | None = None  # int32 [pages] with ``checksum=True``
        self._free = weakref.finalize(self, storage.release)

    # read-only: a restore allocates and decodes by them, so a handle told another shape or
    # dtype would hand back memory that no page was decoded into
    shape = property(operator.attrgetter("_shape"), doc="torch.Size of the tensor offloaded")
    dtype = property(operator.attrgetter("_dtype"), doc="its dtype")
    nbytes = property(operator.attrgetter("_nbytes"), doc="its size in bytes, uncompressed")
    page_size = property(operator.attrgetter("_page_size"), doc="bytes per page it was stored with")
    element_size = property(operator.attrgetter("_element_size"),
                            doc="the bit-shuffle width it was stored with")

    @property
    def state(self) -> str:
        if not self._free.alive:
            return "freed"
        if not self._storage.ready():
            return "pending"
        return "failed" if self._storage.error is not None else "ready"

    def ready(self) -> bool:
        """True once every batch is stored on the host (never blocks)."""
        return self._storage.ready()

    def wait(self) -> None:
        """Block until stored; raise if a batch failed, or if the compressor stopped (closed,
        broken, forked) before storing it."""
        self._storage.wait()
        if self._storage.error is not None:
            raise RuntimeError(f"offload failed: {self._storage.error}") from self._storage.error

    def free(self) -> None:
        """Give the host storage back (at once, or when in-flight copies of it end)."""
        self._free()

    @property
    def stored_nbytes(self) -> int:
        """Host bytes it holds: 0 until stored and once freed."""
        return self._storage.stored_nbytes if self._free.alive else 0

    @property
    def ratio(self) -> float:
        return self.nbytes / max(1, self.stored_nbytes)

    @property
    def codec(self) -> str:
        """``"exp"`` (the exponent codec's pages) or ``"lz4"``: which decoder reads them."""
        return self._storage.codec

    def kernel_bytes(self) -> tuple[int, int]:
        """``(page bytes, stored bytes)`` of the batches stored so far that went through the
        kernel, leaving out those the pipeline stored raw without trying (an incompressible
        stream's bypass, ``max_raw_share``): how well the data compresses. ``(0, 0)``: none."""
        return self._storage.kernel_bytes(self.page_size)

    def compressed(self) -> fmt.CompressedPages:
        """The stored pages as one packed CPU ``CompressedPages`` (a copy; waits if pending).
        Raises ``PageCompError`` for a handle freed before or while it reads."""
        if not self._free.alive:  # its bytes are gone: an empty container would be a lie
            raise PageCompError("this handle was freed")
        self.wait()
        pages = self._storage.compressed(self.page_size)
        # freed by another thread while the store read: each store reads under a hold (the
        # ring's readers, the kernel-only store's lock), so ``pages`` were copied before the
        # blocks went back; but a freed handle's pages are not handed out
        if not self._free.alive:
            raise PageCompError("this handle was freed")
        return pages

    def __repr__(self) -> str:
        return (
            f"OffloadHandle(shape={tuple(self.shape)}, dtype={self.dtype}, state={self.state}, "
            f"nbytes={self.nbytes}, stored_nbytes={self.stored_nbytes})"
        )


class RestoreFailures:
    """Pages that failed to decode in GPU restores made without ``check=True``.

    Counted on the device in the restoring stream's order (no host sync); :meth:`poll` reads a
    value at most one poll old through a pinned copy and never blocks, :meth:`total` waits.
    Both read the count after every stream that added to it: a copy queued on the caller's
    stream alone could read it before a restore stream's count ran, and a corrupt page went
    unreported one backward longer than promised (seen under load on a shared GPU).
    The statuses of up to ``HELD`` restores are held and counted together (two launches per
    restore were a tenth of a small restore's host time).
    """

    HELD = 32

    def __init__(self, device: torch.device):
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self._host = torch.zeros((), dtype=torch.int64).pin_memory()
        self._event: torch.cuda.Event | None = None
        self._seen = 0
        self._held: list[tuple[list[torch.Tensor], torch.cuda.Stream]] = []
        self._counted: set = set()  # streams that added to ``count`` since the last read
        # the stream of the last write of ``count`` (its zeros: the current one); see _add
        self._last = torch.cuda.current_stream(device)
        self._lock = threading.Lock()

    def add(self, statuses: list[torch.Tensor], stream: torch.cuda.Stream,
            recorded: bool = False) -> None:
        """Count ``statuses`` (written in ``stream``'s order) with the next batch;
        ``recorded``: their memory is kept for ``stream``'s use already (made there, or
        ``record_stream``-ed by their maker)."""
        if not statuses:
            return
        if not recorded:
            for s in statuses:
                s.record_stream(stream)  # made on the kernel stream, read on this one
        with self._lock:
            self._held.append((statuses, stream))
            full = len(self._held) >= self.HELD
        if full:
            self.flush()

    def count_now(self, statuses: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Count ``statuses`` now, on the current stream, which is ``stream``: for a caller
        that writes them there again only after this count, in that stream's order (no
        ``record_stream``, no stream switch)."""
        self._add(torch.count_nonzero(statuses), stream)

    def _add(self, n: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """``count += n`` on ``stream`` (the current stream), queued after the last add on
        any stream: every stream's adds read and write the one ``count``, and two that ran at
        once could both read the old value, the later write dropping the other's failures (a
        corrupt page left unreported). One stream's adds need no wait."""
        with self._lock:
            if self._last != stream:
                handoff(self._last, stream)
                self._last = stream
            self.count += n
            self._counted.add(stream)

    def flush(self) -> None:
        """Count the statuses held now (queued on their streams; frees them after)."""
        with self._lock:
            held, self._held = self._held, []
        self._count(held)

    def _count(self, held: list) -> None:
        by_stream: dict = {}
        for statuses, stream in held:
            by_stream.setdefault(stream, []).extend(statuses)
        for stream, statuses in by_stream.items():
            with torch.cuda.stream(stream):
                joined = statuses[0] if len(statuses) == 1 else torch.cat(statuses)
                self._add(torch.count_nonzero(joined), stream)

    def _after_counts(self) -> None:
        """The current stream waits for every count queued so far (a device-side wait)."""
        current = torch.cuda.current_stream(self.count.device)
        with self._lock:
            streams, self._counted = self._counted, set()
        for stream in streams:
            if stream != current:
                handoff(stream, current)

    def poll(self) -> int:
        """Failures known to the host so far (never blocks); schedules the next read."""
        self.flush()
        if self._event is not None and self._event.query():
            self._seen = int(self._host)
            self._event = None
        if self._event is None:
            self._after_counts()
            self._host.copy_(self.count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return self._seen

    def total(self) -> int:
        """All failures so far (waits for the restores queued before the call)."""
        self.flush()
        self._after_counts()
        self._seen = int(self.count)
        return self._seen
