"""CPU codec on the ``lz4`` package: the format of ``torch_pagecomp.format``.

It serves CPU tensors, and CUDA tensors when no GPU path is usable (copy to host, compress,
copy back). ``decode_block`` is a readable pure-Python LZ4 block decoder that classifies
errors with the same status codes as the GPU decoder.

Speed: a batch is one call of the C loops of ``_native`` each way, whose threads take range
after range from a counter they share, with the GIL released throughout (#25): compression
finds FILL pages, compresses through the liblz4 that python-lz4 carries (as
``lz4.block.compress`` does: the same blocks), stores RAW pages and writes the kinds; decoding
decodes, unshuffles and zeroes failed rows (the bit-shuffle in C on x86-64,
``shuffle.bitshuffle_np``, else numpy). A batch of at least ``MIN_THREADED_PAGES`` pages runs
on :func:`cpu_threads` threads (set with :func:`set_cpu_threads` or the
``PAGECOMP_CPU_THREADS`` environment variable, read at each call; default ``min(8, the CPUs
the process may run on)``): the C call starts the others and joins them before it returns.
Without the extension (python-lz4 page by page, ranges of at most ``MAX_RANGE_BYTES``), or
where it cannot start threads, the ranges run on a shared pool of Python threads, shut down at
interpreter exit. Large outputs come from a pool that reuses their memory
(``pools.CpuOutputPool``): first writes to new memory fault page by page, and those faults
do not run in parallel.

Decode rules (the same on every backend; ``triton_kernels/lz4_decompress.py``): per page, in
this order, ``STATUS_BAD_KIND`` for an unknown kind or a shuffle on a non-LZ4 page;
``STATUS_BAD_SIZE`` for an offset or size outside the payload, a RAW page whose size is not
``P``, a FILL page whose size is not 1, an LZ4 page whose size is outside
``1..format.lz4_bound(P)``, or (packed containers, when ``offsets`` has ``N + 1`` entries)
``offsets[i + 1] - offsets[i] != sizes[i]`` or ``offsets[0] != 0``; then the LZ4 block's own
status (``decode_block``). A failed page's row is zero-filled.

Pages are decoded by the C decoder ``_native.decode_pages`` (those rules, the metadata's
included, range after range with the GIL released, so the pool's threads decode in parallel
and nothing walks the batch before they start), built by ``setup.py`` where a C
compiler is found. Without it the metadata rules run in numpy (``_page_checks``) and
python-lz4 decodes: one call per page (holding the GIL between calls), and since liblz4 lets a
match offset of 0 through (copying zeros), the pages it decodes with four zero bytes in a row
are checked for one (``zero_offsets.zero_offset_blocks``). Both give the same pages and statuses.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import lz4.block
import numpy as np
import torch

from . import format as fmt
from .pools import CpuOutputPool
from .shuffle import C_SHUFFLE, bitshuffle_np, bitunshuffle_np
from .zero_offsets import zero_offset_blocks

try:  # the C page loops (setup.py builds them where a C compiler is found)
    from . import _native
except ImportError:  # python-lz4, a call per page, instead: slower, the same bytes and statuses
    _native = None
# The C loops take ranges themselves from a counter shared by the batch's threads (#25); an
# older build of _native takes one range a call.
_SHARED_RANGES = bool(getattr(_native, "SHARED_RANGES", 0))
# ... and start the batch's other threads themselves, for the call (pthreads): Python threads
# each took the GIL to enter their C call and to leave it, one after the other (#25)
_C_THREADS = _SHARED_RANGES and bool(getattr(_native, "THREADS", 0))


@functools.cache
def _liblz4_calls() -> tuple[int, int, int] | None:
    """The addresses of ``LZ4_resetStream``, ``LZ4_compress_fast_continue`` and
    ``LZ4_sizeofState`` in the liblz4 that python-lz4 carries, for ``_native.compress_pages``
    (which calls them as ``lz4.block.compress`` does: the same blocks); None where that
    library does not export them (then python-lz4 compresses page by page)."""
    import ctypes

    import lz4.block._block as block

    try:
        lib = ctypes.CDLL(block.__file__)
        calls = (lib.LZ4_resetStream, lib.LZ4_compress_fast_continue, lib.LZ4_sizeofState)
    except (OSError, AttributeError):
        return None
    return tuple(ctypes.cast(fn, ctypes.c_void_p).value for fn in calls)


THREADS_ENV = "PAGECOMP_CPU_THREADS"
MAX_DEFAULT_THREADS = 8
# Batches below this many pages run on the calling thread: the hand-off to the pool costs more
# than a few dozen lz4 calls. Every range of a split batch has at least half this many pages.
MIN_THREADED_PAGES = 64
RANGES_PER_THREAD = 4
MAX_RANGE_BYTES = 2 << 20  # a range's pages (and its scratch, without the C bit-shuffle)
# The C loops draw a range with one atomic add and no GIL, so their ranges can be small: the
# last range a thread takes ends the batch for all, and with a few 1-2 MiB ranges per thread
# the threads idled behind the slowest one for up to a range's time (#25).
C_RANGE_BYTES = 64 << 10
# Large outputs come from a pool that reuses their memory (see ``pools.CpuOutputPool``).
_outputs = CpuOutputPool()


def empty_cpu_cache() -> None:
    """Return the idle memory of the CPU codec's output pool to the system (outputs still in
    use are not touched; they go back to the pool when they die)."""
    _outputs.clear()

_threads: int | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def set_cpu_threads(n: int | None) -> None:
    """Use ``n`` threads (>= 1) for large CPU batches; ``None``: back to the environment
    variable ``PAGECOMP_CPU_THREADS``, else ``min(8, usable_cpus())``."""
    global _threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise fmt.PageCompError(f"CPU threads must be an int >= 1 or None, got {n!r}")
    _threads = n


def cpu_threads() -> int:
    """Threads the CPU codec uses for a large batch now (see :func:`set_cpu_threads`)."""
    if _threads is not None:
        return _threads
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise fmt.PageCompError(f"{THREADS_ENV} must be an integer >= 1, got {env!r}")
        return n
    return max(1, min(MAX_DEFAULT_THREADS, usable_cpus()))


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (a container's
    cpuset, ``taskset``, a scheduler's allotment: a job given 2 cores of a 64-core host gets 2
    threads, not 8 that would share them), else ``os.cpu_count()``. Read at each call (0.5 us;
    a process may change its mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this OS (macOS, Windows)
        return os.cpu_count() or 1


def _submit(fn, count: int) -> list:
    """``count`` calls of ``fn`` submitted to the shared pool (grown to ``count`` workers
    first): their futures. Submitted under the pool's lock: another thread's larger batch (which
    grows the pool, shutting the old one down) or :func:`shutdown_pool` between getting the pool
    and submitting to it made this batch fail with "cannot schedule new futures after
    shutdown". (A replaced pool still runs what it was given.)"""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < count:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(count, thread_name_prefix="pagecomp-cpu")
            _pool_size = count
        return [_pool.submit(fn) for _ in range(count)]


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, say) has none of the parent's pool threads, and a
    lock a parent thread held at the fork stays held: it starts a pool and locks of its own."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()
    _outputs.reset_lock_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def shutdown_pool() -> None:
    """Stop the CPU codec's worker threads (registered with ``atexit``; a later large batch
    starts a new pool)."""
    global _pool, _pool_size
    with _pool_lock:
        pool, _pool, _pool_size = _pool, None, 0
    if pool is not None:
        pool.shutdown(wait=True)


def _run_ranges(fn, n: int, page_size: int, c_loop=None) -> None:
    """``fn(start, stop)`` over contiguous ranges covering ``0..n`` in order of ``start``, on up
    to :func:`cpu_threads` threads (the caller is one of them; small batches: the caller
    alone). A batch of ``page_size``-byte pages is cut into ranges of at most
    ``MAX_RANGE_BYTES`` (and at least ``MIN_THREADED_PAGES // 2`` pages), and into at least
    a few per thread, each thread taking the next range as it finishes one: pages differ in
    cost (a page of zeros against one of text), so equal shares fixed up front would leave
    threads idle behind the slowest, and a bounded range keeps its temporaries (the
    bit-shuffled pages) in one reused buffer per thread (:func:`_scratch`).

    ``c_loop(counter, parts, threads)``, where given, replaces ``fn`` (which may then be
    None): a C loop of ``_native`` that takes ranges itself, smaller ones (at most
    ``C_RANGE_BYTES``, a page at least), ``k`` after ``k`` from ``counter`` (``int64 [1]``,
    shared by every thread, drawn with an atomic add) until ``parts``, range ``k`` being
    ``n * k // parts .. n * (k + 1) // parts``, the GIL released throughout, where ``fn``
    returns to the GIL between ranges (which bounded decoding to 0.65-0.77x linear at 8
    threads, #25). The loop starts the batch's other ``threads - 1`` threads itself and joins
    them before it returns: one call on the caller's thread, no pool. Python threads calling
    it once each (an older build, or no pthreads) took the GIL in turn to enter and to leave
    their calls: the last of 8 entered 440-470 us into a call and they left over another
    370-430 us, on a 16-core host (bench/results/h200_a1601c8_session29). An exception a call
    raises comes out here as one from ``fn`` does (page failures are statuses, not
    exceptions)."""
    least = MIN_THREADED_PAGES // 2  # pages in a range, at least
    threads = min(cpu_threads(), n // least) if n >= MIN_THREADED_PAGES else 1
    most = max(least, MAX_RANGE_BYTES // page_size)
    parts = max(-(-n // most), min(RANGES_PER_THREAD * threads, n // least), 1)
    if c_loop is not None:
        parts = max(parts, min(n, -(-n * page_size // C_RANGE_BYTES)))
        counter = np.zeros(1, dtype=np.int64)
        if _C_THREADS:  # (more threads than the C loops start: as many as they do)
            c_loop(counter, parts, min(threads, _native.MAX_THREADS))
            return

        def worker() -> None:
            c_loop(counter, parts, 1)
    else:
        bounds = [n * k // parts for k in range(parts + 1)]
        taken = itertools.count()  # next() of a count is atomic under the GIL

        def worker() -> None:
            while (k := next(taken)) < parts:
                fn(bounds[k], bounds[k + 1])

    if threads <= 1:
        worker()
        return
    futures = _submit(worker, threads - 1)
    try:
        worker()
    finally:
        for f in futures:
            f.result()


_local = threading.local()


def _scratch(shape: tuple[int, int]) -> np.ndarray:
    """``uint8`` scratch of ``shape`` (a range's pages at most) reused by the calling thread:
    memory written again on every call instead of new memory that faults on each page."""
    need = shape[0] * shape[1]
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.shape[0] < need:
        buf = _local.scratch = np.empty(need, dtype=np.uint8)
    return buf[:need].reshape(shape)


def compressed_empty(n: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New fixed-stride outputs ``(payload uint8 [n, page_size], sizes int32 [n], kinds uint8
    [n])`` on the CPU, the payload from the output pool (contents undefined)."""
    return (_outputs.empty((n, page_size)), torch.empty(n, dtype=torch.int32),
            torch.empty(n, dtype=torch.uint8))


def stride_offsets(n: int, page_size: int) -> torch.Tensor:
    """``int64 [n]`` (CPU): page ``i`` of a fixed-stride payload starts at ``i * page_size``
    (numpy's arange: a fifth of torch's host time, which was ~10% of a 16-page decode)."""
    return torch.from_numpy(np.arange(0, n * page_size, page_size, dtype=np.int64))


def pages_empty(n: int, page_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` if given, else a new ``uint8 [n, page_size]`` CPU tensor from the output pool
    (contents undefined): where a decoder writes its pages."""
    return out if out is not None else _outputs.empty((n, page_size))


def page_rows(data: torch.Tensor, page_size: int) -> torch.Tensor:
    """``uint8 [ceil(n / P), P]``: CPU bytes ``data`` (``uint8 [n]``) as rows of pages to
    compress, a view where they are whole pages, else a copy with the last page zero-padded,
    in the output pool's reused memory (padding a 32 MiB tensor in new memory, which faults on
    each page, made a CPU store's offload 26 ms against 12.6:
    bench/results/cpu2_d8fb22a_cpustore)."""
    n = data.numel()
    count = -(-n // page_size)
    if n == count * page_size:
        return data.contiguous().view(count, page_size)
    rows = pages_empty(count, page_size)
    flat = rows.view(-1)
    flat[:n] = data
    flat[n:] = 0
    return rows


def fill_rows(pages: np.ndarray) -> np.ndarray:
    """``bool [N]``: which rows of ``uint8 [N, P]`` have every byte equal."""
    first = pages[:, 0].astype(np.uint64) * np.uint64(0x0101010101010101)
    return (pages.view(np.uint64) == first[:, None]).all(axis=1)


def compress_cpu(pages: torch.Tensor, element_size: int = 1, out: tuple | None = None):
    """``uint8 [N, P]`` (CPU) -> fixed-stride ``(payload [N, P], sizes int32 [N], kinds [N])``,
    written into ``out`` (those three tensors, contiguous CPU ones) when given."""
    element_size = fmt.check_element_size(element_size)
    n, page_size = pages.shape
    # every row is written in the (threaded) ranges below, the bytes past a block zeroed there
    payload, sizes, kinds = out if out is not None else compressed_empty(n, page_size)
    if n == 0:
        return payload, sizes, kinds
    raw = np.ascontiguousarray(pages.detach().numpy())
    out, size_np, kind_np = payload.numpy(), sizes.numpy(), kinds.numpy()
    limit = fmt.lz4_keep_limit(page_size)
    lz4_kind = fmt.KIND_LZ4 | (fmt.element_shift(element_size) << 4)
    out_mv = memoryview(out.reshape(-1))

    native = _native is not None and _liblz4_calls() is not None
    c_shuffle = native and C_SHUFFLE and element_size > 1 and page_size % (64 * element_size) == 0
    c_loop = None
    if native and _SHARED_RANGES and (element_size == 1 or c_shuffle):
        flat = raw.reshape(-1)

        def c_loop(counter: np.ndarray, parts: int, threads: int) -> None:  # in C, no GIL
            _native.compress_pages(flat, flat, out.reshape(-1), size_np, kind_np, page_size,
                                   limit, lz4_kind, element_size if c_shuffle else 0,
                                   _liblz4_calls(), counter, parts, threads)

    def work(start: int, stop: int) -> None:
        rows = raw[start:stop]
        src = rows
        if element_size > 1 and not c_shuffle:
            src = bitshuffle_np(rows, element_size, out=_scratch(rows.shape))
        p = page_size
        if native:  # every page of the range, kinds and RAW copies included, without the GIL
            # (and with the C bit-shuffle, each page shuffled there, in cache, just before)
            _native.compress_pages(rows.reshape(-1), src.reshape(-1), out[start:stop].reshape(-1),
                                   size_np[start:stop], kind_np[start:stop], p, limit, lz4_kind,
                                   element_size if c_shuffle else 0, _liblz4_calls())
            return
        # a few Python steps per page on memoryviews, holding the GIL between calls
        fill = fill_rows(rows)
        out[start:stop] = 0
        src_mv = memoryview(src.reshape(-1))
        compress = lz4.block.compress
        got = []
        base = start * p
        for k, is_fill in enumerate(fill.tolist()):
            if is_fill:
                got.append(1)
                continue
            block = compress(src_mv[k * p : k * p + p], store_size=False)
            size = len(block)
            if size <= limit:
                out_mv[base + k * p : base + k * p + size] = block
            else:
                size = p
            got.append(size)
        got = np.array(got, dtype=np.int32)
        size_np[start:stop] = got
        stored = np.where(got == p, fmt.KIND_RAW, lz4_kind)
        kind_np[start:stop] = np.where(fill, fmt.KIND_FILL, stored)
        out[start:stop][fill, 0] = rows[fill, 0]
        stored_raw = np.flatnonzero(got == p) + start
        out[stored_raw] = raw[stored_raw]

    _run_ranges(work, n, page_size, c_loop)
    return payload, sizes, kinds


def decode_block(block: bytes, page_size: int) -> tuple[bytes | None, int]:
    """Decode one LZ4 block into exactly ``page_size`` bytes, or say why not.

    Returns ``(data, STATUS_OK)`` or ``(None, status)``. Reads nothing past ``block``, writes
    nothing past ``page_size`` and ends: every step consumes at least one input byte.
    """
    out = bytearray()
    ip, end = 0, len(block)
    while True:
        if ip >= end:
            return None, fmt.STATUS_TRUNCATED
        token = block[ip]
        ip += 1
        lit = token >> 4
        if lit == 15:
            while True:
                if ip >= end:
                    return None, fmt.STATUS_TRUNCATED
                b = block[ip]
                ip += 1
                lit += b
                if b != 255:
                    break
        if ip + lit > end:
            return None, fmt.STATUS_TRUNCATED
        if len(out) + lit > page_size:
            return None, fmt.STATUS_OVERFLOW
        out += block[ip : ip + lit]
        ip += lit
        if ip == end:  # the last sequence holds literals only
            break
        if ip + 2 > end:
            return None, fmt.STATUS_TRUNCATED
        offset = block[ip] | (block[ip + 1] << 8)
        ip += 2
        if offset == 0 or offset > len(out):
            return None, fmt.STATUS_BAD_OFFSET
        mlen = (token & 15) + 4
        if token & 15 == 15:
            while True:
                if ip >= end:
                    return None, fmt.STATUS_TRUNCATED
                b = block[ip]
                ip += 1
                mlen += b
                if b != 255:
                    break
        if len(out) + mlen > page_size:
            return None, fmt.STATUS_OVERFLOW
        start = len(out) - offset
        for k in range(mlen):  # byte by byte: overlapping copies repeat the pattern
            out.append(out[start + k])
    if len(out) != page_size:
        return None, fmt.STATUS_SHORT
    return bytes(out), fmt.STATUS_OK


# liblz4 (1.9 and later) writes zeros for a match of offset 0 (``LZ4_write32(op, 0)``, "silence
# an msan warning when offset==0", then copies those): a page it decoded with such a match holds
# four zero bytes in a row. Pages without them are not walked.
_LZ4_ZEROES_OFFSET_0 = lz4.library_version_number() >= 10900


def _page_checks(offsets, sizes, kinds, page_size: int, total: int, n: int) -> np.ndarray:
    """``int32 [N]`` statuses that the metadata alone decides (BAD_KIND, BAD_SIZE), else 0: the
    python-lz4 path's checks, and the reference for the C decoder's own (``check_page``)."""
    off = offsets[:n].astype(np.int64)
    size = sizes.astype(np.int64)
    codec, shift = kinds & 15, kinds >> 4
    bad_kind = (codec > 2) | (shift > 2) | ((shift != 0) & (codec != fmt.KIND_LZ4))
    bad_size = (off < 0) | (size < 1) | (size > total - off)
    bad_size |= (codec == fmt.KIND_RAW) & (size != page_size)
    bad_size |= (codec == fmt.KIND_FILL) & (size != 1)
    bad_size |= (codec == fmt.KIND_LZ4) & (size > fmt.lz4_bound(page_size))
    if offsets.shape[0] == n + 1:  # packed: page i is offsets[i]:offsets[i + 1]
        bad_size |= offsets[1:].astype(np.int64) - off != size
        if n:
            bad_size[0] |= off[0] != 0
    status = np.where(bad_kind, fmt.STATUS_BAD_KIND, np.where(bad_size, fmt.STATUS_BAD_SIZE, 0))
    return status.astype(np.int32)


def _decode_lz4_python(buf, off_np, size_np, rows, out_flat, st, page_size: int) -> None:
    """The LZ4 pages ``rows`` of a batch through python-lz4 (where ``_native`` is not built):
    liblz4 decodes, ``decode_block`` decides the pages it refuses or decodes short, and the
    pages it decoded with four zero bytes in a row are walked for a match offset of 0."""
    mv, out_mv = memoryview(buf), memoryview(out_flat)
    decompress = lz4.block.decompress
    walk = []  # pages liblz4 decoded that may hold a match offset of 0
    for i, o, s in zip(rows.tolist(), off_np[rows].tolist(), size_np[rows].tolist()):
        try:
            data = decompress(mv[o : o + s], uncompressed_size=page_size)
        except Exception:  # lz4 says only "corrupt": the reference decides (as the GPU)
            data, st[i] = decode_block(mv[o : o + s].tobytes(), page_size)
        else:
            if len(data) == page_size:
                # memchr first: most pages without four zeros hold no zero byte at all
                if not _LZ4_ZEROES_OFFSET_0 or (b"\0" in data and b"\0\0\0\0" in data):
                    walk.append(i)
            else:  # short: the reference decides (an offset of 0 may come first)
                data, st[i] = decode_block(mv[o : o + s].tobytes(), page_size)
        if data is not None:
            out_mv[i * page_size : (i + 1) * page_size] = data
    if walk:
        w = np.array(walk, dtype=np.int64)
        starts = off_np[w]
        for i in w[zero_offset_blocks(buf, starts, starts + size_np[w])].tolist():
            # exact for blocks liblz4 took; the reference names the status all the same
            st[i] = decode_block(mv[off_np[i] : off_np[i] + size_np[i]].tobytes(), page_size)[1]


def decompress_cpu(payload, offsets, sizes, kinds, page_size: int,
                   out: torch.Tensor | None = None):
    """Decode pages on the CPU.

    Args:
        payload: ``uint8 [T]`` (a fixed-stride payload viewed 1-D, or a packed one).
        offsets: ``int64 [N]`` start of each page in ``payload``; or ``int64 [N + 1]``, a packed
            container's offsets, which must then agree with ``sizes`` (else BAD_SIZE); or
            None, a fixed-stride payload (page ``i`` at ``i * P``).
        sizes: ``int32 [N]``; kinds: ``uint8 [N]``.
        out: ``uint8 [N, P]`` (contiguous, CPU, overlapping no input) to decode into, or None.
    Returns:
        ``(pages uint8 [N, P], status int32 [N])``, ``pages`` being ``out`` when given; a
        failed page's row is zero-filled.
    """
    n = sizes.shape[0]
    if offsets is None:
        offsets = stride_offsets(n, page_size)
    # every row and status is written below (a failed row with zeros): no zero-fill of the batch
    pages = pages_empty(n, page_size, out)
    status = torch.empty(n, dtype=torch.int32)
    if n == 0:
        return pages, status
    # views of the metadata as it comes (copies only of a non-contiguous or other-typed tensor):
    # nothing here walks the batch before the threads start, which would be serial (#25)
    buf = np.ascontiguousarray(payload.detach().numpy()).reshape(-1)
    off_np = np.ascontiguousarray(offsets.numpy(), dtype=np.int64)
    size_np = np.ascontiguousarray(sizes.numpy(), dtype=np.int32)
    kind_np = np.ascontiguousarray(kinds.numpy(), dtype=np.uint8)
    out, st = pages.numpy(), status.numpy()
    out_flat = out.reshape(-1)
    if _native is None:  # python-lz4: the metadata checks of the whole batch in numpy, first
        st[:] = _page_checks(off_np, size_np, kind_np, page_size, buf.shape[0], n)
    c_loop = None
    if _native is not None and _SHARED_RANGES and C_SHUFFLE:

        def c_loop(counter: np.ndarray, parts: int, threads: int) -> None:  # in C, no GIL
            _native.decode_pages(buf, off_np, size_np, kind_np, out_flat, st, page_size, 0, n,
                                 counter, parts, threads)

    def work(start: int, stop: int) -> None:
        rng = slice(start, stop)
        if _native is not None:  # every page of the range without the GIL: its metadata
            # checked (page by page, as _page_checks), decoded, failed rows zeroed and, with
            # the C bit-shuffle, bit-shuffled pages unshuffled
            _native.decode_pages(buf, off_np, size_np, kind_np, out_flat, st, page_size, start,
                                 stop)
            if C_SHUFFLE:
                return
        else:
            ok = st[rng] == 0
            codec = kind_np[rng] & 15
            fill = np.flatnonzero(ok & (codec == fmt.KIND_FILL)) + start
            out[fill] = buf[off_np[fill]][:, None]
            for i in (np.flatnonzero(ok & (codec == fmt.KIND_RAW)) + start).tolist():
                out[i] = buf[off_np[i] : off_np[i] + page_size]
            lz = (np.flatnonzero(ok & (codec == fmt.KIND_LZ4)) + start).astype(np.int64)
            _decode_lz4_python(buf, off_np, size_np, lz, out_flat, st, page_size)
        codec, shift = kind_np[rng] & 15, kind_np[rng] >> 4
        for sh in (1, 2):
            rows = np.flatnonzero((st[rng] == 0) & (codec == fmt.KIND_LZ4) & (shift == sh)) + start
            if rows.shape[0] == stop - start:  # a typed batch: whole range, in place
                bitunshuffle_np(out[rng], 1 << sh, out=out[rng])
            elif rows.shape[0]:
                out[rows] = bitunshuffle_np(out[rows], 1 << sh)
        failed = np.flatnonzero(st[rng] != 0) + start
        out[failed] = 0

    _run_ranges(work, n, page_size, c_loop)
    return pages, status


def page_checksums_cpu(pages: torch.Tensor) -> torch.Tensor:
    """The format's checksum (xxHash32, seed 0) of each page of ``pages`` (``uint8 [N, P]`` on
    the CPU): ``int32 [N]``. numpy, all pages' lanes a step at a time (uint32 arithmetic wraps
    as the hash's)."""
    arr = pages.contiguous().numpy()
    n, p = arr.shape
    lanes = arr.view("<u4").reshape(n, p // 16, 4)
    p1, p2, p3 = (np.uint32(x) for x in (fmt.XXH_PRIME1, fmt.XXH_PRIME2, fmt.XXH_PRIME3))
    v = np.empty((n, 4), dtype=np.uint32)
    v[:] = np.array([(fmt.XXH_PRIME1 + fmt.XXH_PRIME2) & 0xFFFFFFFF, fmt.XXH_PRIME2, 0,
                     -fmt.XXH_PRIME1 & 0xFFFFFFFF], dtype=np.uint32)
    for s in range(p // 16):
        v += lanes[:, s] * p2
        v = (v << np.uint32(13)) | (v >> np.uint32(19))
        v *= p1
    rot = np.array([1, 7, 12, 18], dtype=np.uint32)
    h = ((v << rot) | (v >> (np.uint32(32) - rot))).sum(axis=1, dtype=np.uint64)
    h = ((h + p) & 0xFFFFFFFF).astype(np.uint32)
    h ^= h >> np.uint32(15)
    h *= p2
    h ^= h >> np.uint32(13)
    h *= p3
    h ^= h >> np.uint32(16)
    return torch.from_numpy(h.view(np.int32))


def pack_cpu(payload: torch.Tensor, sizes: torch.Tensor):
    """Fixed-stride ``payload [N, P]`` -> ``(packed uint8 [N * P], offsets int64 [N + 1])``.

    Sizes are clamped to ``[0, P]``. The length is the upper bound (so that the GPU version
    needs no host synchronisation); bytes past ``offsets[N]`` are zero.
    """
    n, page_size = payload.shape
    offsets = packed_offsets(sizes, page_size)
    packed = _outputs.empty((n * page_size,))
    pack_into(payload, offsets, packed)
    return packed, torch.from_numpy(offsets)


def packed_offsets(sizes: torch.Tensor, page_size: int) -> np.ndarray:
    """``int64 [N + 1]``: where each page of a fixed-stride container of ``sizes`` (``int32
    [N]``, CPU; clamped to ``[0, page_size]``) starts once packed, then the packed length. In
    numpy: a small batch's packing spent most of its time in a handful of torch calls."""
    offsets = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.clip(sizes.numpy(), 0, page_size), out=offsets[1:])
    return offsets


def pack_into(payload: torch.Tensor, offsets: np.ndarray, packed: torch.Tensor) -> None:
    """Page ``i`` of ``payload`` (``uint8 [N, P]``, CPU) written to ``packed`` (``uint8``, CPU,
    contiguous, at least ``offsets[N]`` bytes: the bound ``N * P``, or the exact size) at
    ``offsets[i]`` (:func:`packed_offsets`), its first ``offsets[i + 1] - offsets[i]`` bytes;
    ``packed``'s bytes past ``offsets[N]`` zeroed."""
    n, page_size = payload.shape
    dst = packed.numpy().reshape(-1)
    if getattr(_native, "pack_pages", None) is not None:  # one C loop, the GIL released
        _native.pack_pages(payload.contiguous().reshape(-1).numpy(), offsets, dst, page_size)
        return
    # without the C loops: numpy page by page, holding the GIL (bench/results/cpu2_3bd8150_dispatch)
    src = payload.numpy()
    for i, (o, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        dst[o:e] = src[i, :e - o]
    dst[offsets[n]:] = 0
