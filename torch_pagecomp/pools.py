"""Host and device memory pools for the offload pipeline.

* :class:`HostMemory`: page-aligned host memory at an exact size (anonymous ``mmap``), pinned
  with ``cudaHostRegister`` when CUDA is usable. PyTorch's caching host allocator rounds every
  pinned block up to a power of two (20 GiB asked can lock 32 GiB); registering our own
  mapping locks exactly ``round_up(nbytes, 4096)`` bytes, and that is what the stats report.
* :class:`HostArena`: compressed pages are stored in chunks of :class:`HostMemory`, carved at
  exact sizes (``ALIGN``-byte granularity, first fit, coalescing free list). Chunks are kept
  and reused, so after warm-up an offload registers nothing.
* :class:`DeviceBufferPool`: ``uint8`` device (or CPU) buffers reused by size.
* :class:`CpuOutputPool`: the CPU codec's large outputs, reused once the tensors handed out die.
* :class:`InflightLimiter`: a byte budget with back-pressure: ``acquire`` blocks until the
  bytes fit, it never drops work and never over-allocates.
"""

from __future__ import annotations

import collections
import copy
import math
import mmap
import operator
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from . import _numa

HOST_PAGE = 4096
ALIGN = 256  # arena allocation granularity (DMA-friendly, keeps int64 views aligned)
DEFAULT_CHUNK_BYTES = 64 << 20


# Once a step, the activation hooks' page-locked memory lets go of what it no longer needs:
# the compressed store's chunks keep what the busiest of the last SHRINK_STEPS steps needed
# (``offload._arena.VirtualArena.shrink``), the plain copies' chunks those used in the last
# 4 * SHRINK_STEPS (``offload._copy_arena``). Pinning costs tens of milliseconds a buffer and
# unpinning waits for the whole device, and what a step needs moves with timing
# (bench/results/h200x2_91fcaaa_session49 for the arena; h200_8198fbc_session59 for the
# plain copies' pinned buffers).
SHRINK_STEPS = 8
SPIKE = 1.5  # a lone step needing over this times every other step of a window: not counted


def spike_free(needs: list[int]) -> list[int]:
    """The indices of the steps of a shrink window that count for the compressed store's
    page-locked chunks (``offload._arena.VirtualArena.shrink``): every step but a lone
    spike, one needing over ``SPIKE`` times the most any other step of the window needed (a
    first step, a gradient check whose SDPA math kernel saves the attention matrix: 1.9x
    GPT-2's usual step under FSDP2, ``bench/results/h200x2_91fcaaa_session49``), whose extra
    goes at the next shrink. Steps whose sizes change from one to the next (dynamic padding:
    a new sequence length each step) all count: the rule before session 78, which left out
    every step over 1.25 times the window's upper median, let the longest steps' chunks go and
    pinned them again a few steps later (0.3-2.5 chunks a step on encoder-1024, GPT-2 and
    BERT-large with lengths drawn from [seq / 4, seq], ``bench/results/h200_session78``)."""
    if len(needs) < 2:
        return list(range(len(needs)))
    top = max(range(len(needs)), key=needs.__getitem__)
    if needs[top] > SPIKE * max(n for i, n in enumerate(needs) if i != top):
        return [i for i in range(len(needs)) if i != top]
    return list(range(len(needs)))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def byte_count(nbytes, what: str) -> int:
    """``nbytes`` as an ``int``, or a ``TypeError`` / ``ValueError`` naming ``what``: a negative
    count sliced a view from the end of its chunk (``alloc(-1)``: all of the chunk but a byte,
    other blocks' bytes with it), and a float left its bytes carved when the view then raised."""
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"{what}: nbytes must be an integer, got "
                        f"{type(nbytes).__name__}") from None
    if n < 0:
        raise ValueError(f"{what}: nbytes must be >= 0, got {n}")
    return n


def can_pin() -> bool:
    """True when host memory can be registered with the CUDA driver here."""
    return torch.cuda.is_available()


class HostMemory:
    """``nbytes`` of page-aligned host memory; ``tensor`` is its ``uint8 [nbytes]`` view.

    ``pin=True`` registers it with ``cudaHostRegister`` (page-locked, DMA-able: ``tensor``
    reports ``is_pinned()``), on a host of several NUMA nodes after giving its pages the
    current CUDA device's node (``numa_node``; ``_numa``); ``release()`` unregisters.
    ``held_bytes`` is what is mapped.
    """

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = byte_count(nbytes, "HostMemory")
        self.held_bytes = round_up(max(self.nbytes, 1), HOST_PAGE)
        self._map = mmap.mmap(-1, self.held_bytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[: self.nbytes]
        self.addr = self.tensor.data_ptr()
        self.pinned = False
        self.last_use: torch.cuda.Event | None = None  # the GPU's last use (reuse waits on it)
        self.numa_node: int | None = None  # the node its pages were given (None: not set)
        if pin:
            ptr = self.tensor.data_ptr()
            self.numa_node = _numa.place(ptr, self.held_bytes)  # before the pages are touched
            try:
                rc = torch.cuda.cudart().cudaHostRegister(ptr, self.held_bytes, 0)
                code = int(getattr(rc, "value", rc))
            except (AttributeError, RuntimeError) as exc:
                rc, code = exc, -1
            if code != 0:  # e.g. RLIMIT_MEMLOCK: stay correct, copies become synchronous
                self.numa_node = None  # (its pages are wherever the kernel put them)
                warnings.warn(
                    f"cudaHostRegister({self.held_bytes} bytes) failed ({rc}); using pageable "
                    "host memory",
                    stacklevel=2,
                )
            else:
                self.pinned = True

    def release(self) -> None:
        """Unregister (the mapping itself goes when the last tensor view is dropped)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.addr)
            self.pinned = False

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@dataclass
class HostBlock:
    """A range of an arena chunk: ``tensor`` is ``uint8 [nbytes]`` (``size`` bytes reserved),
    or None for a block allocated without a view (:meth:`HostArena.alloc`). ``freed``: given
    back (a second give-back raises: once its bytes were carved again, the free-range check
    of ``_Chunk.give_back`` passed it, and it gave back another block's bytes)."""

    chunk: _Chunk
    offset: int
    size: int
    nbytes: int
    tensor: torch.Tensor | None
    freed: bool = field(default=False, repr=False)

    def check_live(self) -> None:
        """Raise for a block given back already (:attr:`freed`)."""
        if self.freed:
            raise RuntimeError(f"host pool: a block ({self.size} bytes at {self.offset}) is "
                               "given back while free (a block freed twice)")

    def give_back(self) -> None:
        """Return the block's bytes to its chunk, once (a second give-back raises)."""
        self.check_live()
        self.chunk.give_back(self.offset, self.size)
        self.freed = True

    @property
    def addr(self) -> int:
        """The block's host address."""
        return self.chunk.mem.addr + self.offset


@dataclass
class _Chunk:
    """A chunk of host memory that blocks are carved from (:class:`HostArena`,
    ``offload._copy_arena``): its free ranges, the largest of them, and the bytes carved."""

    mem: HostMemory
    free: list[list[int]] = field(default_factory=list)  # sorted [offset, size]
    used: int = 0
    largest: int = 0  # the largest free range

    def __post_init__(self):
        self.free = [[0, self.mem.nbytes]]
        self.largest = self.mem.nbytes

    def carve(self, size: int) -> int | None:
        """The offset of ``size`` bytes taken from the first free range that holds them (None
        if none does)."""
        if size > self.largest:
            return None
        i = next(i for i, (_, room) in enumerate(self.free) if room >= size)
        off, room = self.free[i]
        if room == size:
            del self.free[i]
        else:
            self.free[i] = [off + size, room - size]
        if room == self.largest:
            self.largest = max((r for _, r in self.free), default=0)
        self.used += size
        return off

    def give_back(self, offset: int, size: int) -> None:
        """Return ``size`` bytes at ``offset`` to the free ranges, merged with their
        neighbours. Bytes that are free already (a block given back twice) raise, the ranges
        unchanged: kept, the next two carves would share them, and one stored tensor would be
        written over by another."""
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        if (offset < 0 or offset + size > self.mem.nbytes
                or i < len(free) and offset + size > free[i][0]
                or i > 0 and free[i - 1][0] + free[i - 1][1] > offset):
            raise RuntimeError(f"host pool: bytes {offset}..{offset + size} of a chunk are "
                               "given back while free (a block freed twice)")
        self.used -= size
        free.insert(i, [offset, size])
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1][1] += free.pop(i)[1]
            i -= 1
        self.largest = max(self.largest, free[i][1])


class HostArena:
    """Exact-size host storage for compressed batches, in reusable (pinned) chunks.

    ``alloc(n)`` reserves ``round_up(n, ALIGN)`` bytes from the first chunk with room (a *hit*)
    or registers a new chunk of ``max(chunk_bytes, n)`` (a *miss*). ``free`` coalesces; empty
    chunks are kept for reuse (at most ``keep_free_chunks`` of them when set) until
    :meth:`trim`. Thread-safe.
    """

    def __init__(
        self, pin: bool, chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep_free_chunks: int | None = None
    ):
        self.pin = pin
        self.chunk_bytes = round_up(chunk_bytes, HOST_PAGE)
        self.keep_free_chunks = keep_free_chunks
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        self.hits = self.misses = self.allocs = self.frees = 0
        self.used_bytes = 0

    def alloc(self, nbytes: int, view: bool = True) -> HostBlock:
        """A block of ``nbytes``; ``view=False``: without its ``tensor`` (a view costs the host
        microseconds; the small store addresses its blocks, ``offload._small_store``)."""
        nbytes = byte_count(nbytes, "HostArena.alloc")
        size = round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            self.allocs += 1
            for chunk in self._chunks:
                block = self._carve(chunk, size, nbytes, view)
                if block is not None:
                    self.hits += 1
                    return block
            self.misses += 1
            chunk = _Chunk(HostMemory(max(self.chunk_bytes, round_up(size, HOST_PAGE)), self.pin))
            self._chunks.append(chunk)
            return self._carve(chunk, size, nbytes, view)

    def _carve(self, chunk: _Chunk, size: int, nbytes: int, view: bool = True
               ) -> HostBlock | None:
        off = chunk.carve(size)
        if off is None:
            return None
        self.used_bytes += size
        return HostBlock(chunk, off, size, nbytes,
                         chunk.mem.tensor[off : off + nbytes] if view else None)

    def free(self, block: HostBlock) -> None:
        with self._lock:
            chunk = block.chunk
            block.give_back()  # (raises for a block freed twice)
            self.frees += 1
            self.used_bytes -= block.size
            if chunk.used == 0 and self.keep_free_chunks is not None:
                empty = [c for c in self._chunks if c.used == 0]
                if len(empty) > self.keep_free_chunks:
                    self._drop(chunk)

    def shrink(self, block: HostBlock, nbytes: int) -> None:
        """Give back the end of ``block`` past its first ``nbytes`` (rounded up to ``ALIGN``):
        for a block reserved for a worst case whose use turned out smaller."""
        nbytes = byte_count(nbytes, "HostArena.shrink")
        size = round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            block.check_live()  # (its end may be another block's by now)
            if size >= block.size:
                return
            block.chunk.give_back(block.offset + size, block.size - size)
            self.used_bytes -= block.size - size
            block.size = size
            if nbytes < block.nbytes:
                block.nbytes = nbytes
                if block.tensor is not None:
                    block.tensor = block.tensor[:block.nbytes]

    def _drop(self, chunk: _Chunk) -> None:
        self._chunks.remove(chunk)
        chunk.mem.release()

    def trim(self) -> int:
        """Release every empty chunk; returns the bytes released."""
        with self._lock:
            empty = [c for c in self._chunks if c.used == 0]
            for c in empty:
                self._drop(c)
            return sum(c.mem.held_bytes for c in empty)

    def unpin(self) -> None:
        """Unregister every chunk from the CUDA driver; stored blocks stay readable (as
        pageable memory). At interpreter exit, before CUDA is torn down: left to ``__del__``
        during finalization, the unregistering would call into a dying runtime."""
        with self._lock:
            for c in self._chunks:
                c.mem.release()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(c.mem.held_bytes for c in self._chunks)

    def stats(self) -> dict:
        with self._lock:
            held = sum(c.mem.held_bytes for c in self._chunks)
            return {
                "held_bytes": held,
                # those the driver registered: a refused registration leaves a chunk pageable
                "pinned_bytes": sum(c.mem.held_bytes for c in self._chunks if c.mem.pinned),
                "used_bytes": self.used_bytes,
                "chunks": len(self._chunks),
                "hits": self.hits,
                "misses": self.misses,
            }


class SizePool:
    """Buffers reused by exact size: ``acquire(n)`` pops an idle one of ``n`` bytes or makes one
    (outside the lock); ``release`` returns it; ``clear`` drops the idle ones. Subclasses say
    how a buffer is made, measured and dropped."""

    def __init__(self):
        self._free: dict[int, list] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.held_bytes = 0
        self.pinned_bytes = 0  # of ``held_bytes``, those the driver registered (``_pinned``)

    def _make(self, nbytes: int):
        raise NotImplementedError

    def _size(self, buf) -> int:
        raise NotImplementedError

    def _held(self, buf) -> int:
        return self._size(buf)

    def _pinned(self, buf) -> int:
        return 0

    def _drop(self, buf) -> None:
        pass

    def acquire(self, nbytes: int):
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                self.hits += 1
                return bucket.pop()
            self.misses += 1
        buf = self._make(nbytes)
        with self._lock:
            self.held_bytes += self._held(buf)
            self.pinned_bytes += self._pinned(buf)
        return buf

    def release(self, buf) -> None:
        with self._lock:
            self._free.setdefault(self._size(buf), []).append(buf)

    def clear(self) -> None:
        """Drop every idle buffer (buffers still acquired stay counted until released)."""
        with self._lock:
            # each buffer leaves its list before it is counted out and dropped: should a drop
            # raise (a wait for its last use, an interrupt), those dropped so far are neither
            # handed out again nor counted out twice by the next clear
            for size in list(self._free):
                bucket = self._free[size]
                while bucket:
                    buf = bucket.pop()
                    self.held_bytes -= self._held(buf)
                    self.pinned_bytes -= self._pinned(buf)
                    self._drop(buf)
                del self._free[size]

    def stats(self) -> dict:
        with self._lock:
            return {"held_bytes": self.held_bytes, "hits": self.hits, "misses": self.misses}


class PinnedBufferPool(SizePool):
    """Exact-size host buffers (:class:`HostMemory`, pinned where possible): the pipeline's
    staging. (The hooks' plain copies are carved from chunks instead, ``offload._copy_arena``:
    exact sizes pinned a buffer for every new sequence length.)"""

    def __init__(self, pin: bool):
        super().__init__()
        self.pin = pin

    def _make(self, nbytes: int) -> HostMemory:
        return HostMemory(nbytes, self.pin)

    def _size(self, mem: HostMemory) -> int:
        return mem.nbytes

    def _held(self, mem: HostMemory) -> int:
        return mem.held_bytes

    def _pinned(self, mem: HostMemory) -> int:
        # a refused registration leaves a buffer pageable (``HostMemory`` warns and goes on)
        return mem.held_bytes if mem.pinned else 0

    def _drop(self, mem: HostMemory) -> None:
        if mem.last_use is not None:  # a copy still queued on it: unpinned after it
            mem.last_use.synchronize()
        mem.release()

    def stats(self) -> dict:
        out = super().stats()
        out["pinned_bytes"] = self.pinned_bytes
        return out


class DeviceBufferPool(SizePool):
    """``uint8`` buffers on one device reused by size.

    A miss allocates on the *current* stream: call ``acquire`` with the stream that first
    writes the buffer current (the caching allocator orders a reused block only for the
    stream that freed it)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def _make(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _size(self, buf: torch.Tensor) -> int:
        return buf.numel()


class InflightLimiter:
    """A budget of ``limit`` bytes in flight. ``acquire(n)`` blocks while the bytes do not fit
    (one request larger than the whole budget is admitted alone, when nothing else is in
    flight). ``waits`` counts acquisitions that had to wait; ``max_seen`` the peak in flight.

    :meth:`stop` makes every waiting and later ``acquire`` raise the error it is given: once
    the pipeline behind the budget is closed or broken, nothing would ever release bytes, so a
    producer must not wait for them.
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self.in_flight = 0
        self.max_seen = 0
        self.waits = 0
        self._stopped: BaseException | None = None
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            if self._stopped is None and not self._fits(nbytes):
                self.waits += 1
                self._cond.wait_for(lambda: self._stopped is not None or self._fits(nbytes))
            if self._stopped is not None:
                # a copy per refusal: the stored error raised itself kept each refusal's
                # traceback, and with it the refused callers' frames (their tensors) for as
                # long as the limiter lived
                raise copy.copy(self._stopped)
            self.in_flight += nbytes
            self.max_seen = max(self.max_seen, self.in_flight)

    def _fits(self, nbytes: int) -> bool:
        return self.limit is None or self.in_flight == 0 or self.in_flight + nbytes <= self.limit

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_flight -= nbytes
            self._cond.notify_all()

    def stop(self, error: BaseException) -> None:
        """Refuse every acquisition from now on with ``error`` (waiting ones included)."""
        with self._cond:
            if self._stopped is None:
                self._stopped = error
            self._cond.notify_all()

    def reset_lock_after_fork(self) -> None:
        """In a forked child: a fresh condition (a parent's thread may have held the old one
        at the fork, and that thread does not exist here)."""
        self._cond = threading.Condition()


class CpuOutputPool:
    """The CPU codec's large outputs (``uint8``), reused once every tensor on them has died.

    The first write to newly mapped memory takes a page fault per 4 KiB page; on a batch of
    tens of MiB the faults cost several times the codec's own work, and the faults of several
    threads in one process do not run in parallel, so a codec that writes new memory on every
    call cannot scale over cores (``bench/results/cpu2_*``). A buffer handed out by
    :meth:`empty` comes back here when the last tensor or view on it dies (a finalizer on the
    numpy array behind it); up to ``max_idle_bytes`` stay idle for the next call of the same
    size (the oldest are dropped beyond it), and :meth:`clear` drops them all. The bytes of a
    reused buffer are whatever was written there before: callers write every byte.
    """

    MIN_BYTES = 1 << 20  # smaller outputs come from torch.empty (malloc reuses those itself)

    def __init__(self, max_idle_bytes: int = 512 << 20):
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[np.ndarray] = []  # oldest first
        self._idle_bytes = 0
        self._lock = threading.Lock()
        # buffers whose last tensor died, not yet idle: a lease's finalizer runs wherever the
        # GC collects it (a lease in a reference cycle), on a thread that may hold ``_lock``
        # (on Python 3.12+ the GC runs at any loop or call of the code under it): waiting for
        # the lock there hung that thread for good, so it only appends here (a deque's append
        # takes no lock) and whoever holds the lock next makes them idle (:meth:`_settle`)
        self._returned: collections.deque[np.ndarray] = collections.deque()
        self.hits = self.misses = 0

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``uint8`` CPU tensor of ``shape`` (contents undefined)."""
        nbytes = math.prod(shape)
        if nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=torch.uint8)
        base = None
        with self._lock:
            self._settle()
            for k in range(len(self._idle) - 1, -1, -1):
                if self._idle[k].nbytes == nbytes:
                    base = self._idle.pop(k)
                    self._idle_bytes -= nbytes
                    self.hits += 1
                    break
            else:
                self.misses += 1
        if base is None:
            base = np.empty(nbytes, dtype=np.uint8)
        lease = base[:]  # its own array object: dies with the last tensor that holds it
        weakref.finalize(lease, self._put, base).atexit = False
        return torch.from_numpy(lease).view(shape)

    def _put(self, base: np.ndarray) -> None:
        """A lease's finalizer: ``base`` is free (see ``_returned``; never waits)."""
        self._returned.append(base)
        if self._lock.acquire(blocking=False):  # (else its holder, or the next, settles it)
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self) -> None:
        """Under ``_lock``: the returned buffers become idle, the oldest idle dropped beyond
        ``max_idle_bytes``."""
        while self._returned:
            base = self._returned.popleft()
            self._idle.append(base)
            self._idle_bytes += base.nbytes
        while self._idle_bytes > self.max_idle_bytes:
            self._idle_bytes -= self._idle.pop(0).nbytes

    def clear(self) -> None:
        """Drop every idle buffer (returns their memory to the system)."""
        with self._lock:
            self._returned.clear()
            self._idle.clear()
            self._idle_bytes = 0

    def reset_lock_after_fork(self) -> None:
        """In a forked child: a fresh lock (a parent thread may have held the old one at the
        fork, and that thread does not exist here)."""
        self._lock = threading.Lock()

    def stats(self) -> dict:
        with self._lock:
            self._settle()
            return {"idle_bytes": self._idle_bytes, "idle_buffers": len(self._idle),
                    "hits": self.hits, "misses": self.misses}
