"""Where offloaded activation storages go: pinned host buffers, compressed pages, CPU copies.

Every store turns the bytes of one storage (``uint8 [n]``) into a *stored* object and back:

* :class:`PinnedStore`: a plain copy into an exact-size pinned host buffer (pooled), issued on
  the caller's current stream (the offloader runs it on its side stream).
* :class:`CompressedStore`: :class:`torch_pagecomp.module.PageCompressor` pages, held packed in
  host memory (host bytes shrink with the ratio).
* :class:`CpuStore`: CPU tensors when there is no GPU: compressed with the lz4 codec, or copied.

:class:`ClassPolicy` samples the first tensors of each ``(dtype, shape)`` class and sends the
class to the pinned store when compression does not pay.
"""

from __future__ import annotations

import queue
import threading

import torch

from .pools import HostMemory, SizePool


def element_size_for(dtype: torch.dtype) -> int:
    """Bit-shuffle width for ``dtype``: 2 for bf16/fp16, 4 for fp32/int32 (and 8-byte types)."""
    size = torch.empty((), dtype=dtype).element_size()
    return {1: 1, 2: 2, 4: 4, 8: 4}.get(size, 1)


# --------------------------------------------------------------------------- pinned memory
class HostBuffer:
    """One exact-size pinned buffer: ``tensor`` is ``uint8 [nbytes]``; ``last_use`` the event
    after which the GPU no longer touches it (reuse waits on it)."""

    __slots__ = ("tensor", "nbytes", "held", "last_use", "memory")

    def __init__(self, tensor: torch.Tensor, held: int, memory: object = None):
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.held = held
        self.last_use: torch.cuda.Event | None = None
        self.memory = memory  # a pools.HostMemory (exact, registered) or None


def _pinned_exact(nbytes: int) -> HostBuffer | None:
    """Page-aligned host memory registered with the driver (no power-of-two rounding)."""
    try:
        mem = HostMemory(nbytes, pin=True)
    except Exception:  # noqa: BLE001 - fall back to torch's pinned allocator
        return None
    return HostBuffer(mem.tensor, mem.held_bytes, mem)


class PinnedPool(SizePool):
    """Pinned host buffers kept by exact size and reused (no allocation on the hot path after the
    first step). ``exact=True`` registers page-aligned memory (held = size rounded to 4 KiB);
    otherwise (or if that fails) torch's pinned allocator is used. ``clear()`` unpins and drops
    the idle buffers (call after synchronising)."""

    def __init__(self, max_bytes: int | None = None, exact: bool = True):
        super().__init__()
        self.max_bytes = max_bytes
        self.exact = exact
        self.in_use_bytes = 0

    def _make(self, nbytes: int) -> HostBuffer:
        buf = _pinned_exact(nbytes) if self.exact else None
        if buf is None:
            self.exact = False
            buf = HostBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes)
        return buf

    def _size(self, buf: HostBuffer) -> int:
        return buf.nbytes

    def _held(self, buf: HostBuffer) -> int:
        return buf.held

    def _drop(self, buf: HostBuffer) -> None:
        if buf.memory is not None:
            buf.memory.release()

    def get(self, nbytes: int) -> HostBuffer | None:
        """A buffer of exactly ``nbytes`` or None when ``max_bytes`` would be passed."""
        with self._lock:
            full = self.max_bytes is not None and self.held_bytes + nbytes > self.max_bytes
            if full and not self._free.get(nbytes):
                return None
        buf = self.acquire(nbytes)
        with self._lock:
            self.in_use_bytes += buf.held
        return buf

    def put(self, buf: HostBuffer) -> None:
        with self._lock:
            self.in_use_bytes -= buf.held
        self.release(buf)


# --------------------------------------------------------------------------------- stores
class RawStored:
    """A storage copied into a pinned buffer; ``event`` marks the end of the copy."""

    kind = "raw"

    def __init__(self, buf: HostBuffer, event: torch.cuda.Event | None):
        self.buf = buf
        self.event = event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait_on(self, stream: torch.cuda.Stream | None) -> None:
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    def host_nbytes(self) -> int:
        return self.buf.held


class PinnedStore:
    """Uncompressed offload: copy into pooled pinned memory on the current stream."""

    kind = "raw"

    def __init__(self, pool: PinnedPool):
        self.pool = pool

    def offload(self, src: torch.Tensor, element_size: int) -> RawStored | None:
        buf = self.pool.get(src.numel())
        if buf is None:
            return None
        stream = torch.cuda.current_stream(src.device)
        if buf.last_use is not None:
            stream.wait_event(buf.last_use)
        buf.tensor.copy_(src, non_blocking=True)
        ev = stream.record_event()
        buf.last_use = ev
        return RawStored(buf, ev)

    def restore(self, stored: RawStored, out: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(out.device)
        stored.wait_on(stream)
        out.copy_(stored.buf.tensor, non_blocking=True)
        stored.buf.last_use = stream.record_event()

    def free(self, stored: RawStored) -> None:
        self.pool.put(stored.buf)


class CompressedStored:
    kind = "compressed"

    def __init__(self, handle, nbytes: int):
        self.handle = handle
        self.nbytes = nbytes
        self.freed = False
        self._stored: int | None = None
        self._kernel: tuple[int, int] = (0, 0)

    def ready(self) -> bool:
        return self._stored is not None or (not self.freed and self.handle.ready())

    def failed(self) -> bool:
        return not self.freed and self.handle.state == "failed"

    def wait_on(self, stream: torch.cuda.Stream | None) -> None:
        """Until the offload is stored (a host wait: the handle offers no event)."""
        self.handle.wait()

    def host_nbytes(self) -> int | None:
        """Stored bytes once the offload finished, else None."""
        if self._stored is None and not self.freed and self.handle.ready():
            self._stored = int(self.handle.stored_nbytes)
            self._kernel = self.handle.kernel_bytes()
        return self._stored

    def kernel_bytes(self) -> tuple[int, int] | None:
        """``(page bytes, stored bytes)`` of the batches the kernel compressed, once finished
        (None before; ``(0, 0)`` when the pipeline stored every batch raw without trying)."""
        return self._kernel if self.host_nbytes() is not None else None


class CompressedStore:
    """Offload through a :class:`PageCompressor` (its own side streams; ordered after ours)."""

    kind = "compressed"

    def __init__(self, compressor):
        self.compressor = compressor

    def offload(self, src: torch.Tensor, element_size: int) -> CompressedStored:
        handle = self.compressor.offload(src, element_size=element_size)
        return CompressedStored(handle, src.numel())

    def restore(self, stored: CompressedStored, out: torch.Tensor) -> None:
        self.compressor.restore(stored.handle, device=out.device, out=out)

    def free(self, stored: CompressedStored) -> None:
        stored.host_nbytes()  # keep the measured size for the policy
        stored.freed = True
        stored.handle.free()


class CpuStored:
    def __init__(self, kind: str, data, nbytes: int, host: int):
        self.kind, self.data, self.nbytes, self._host = kind, data, nbytes, host

    def ready(self) -> bool:
        return True

    def wait_on(self, stream) -> None:
        pass

    def host_nbytes(self) -> int:
        return self._host


class CpuStore:
    """CPU tensors (no GPU): lz4 pages packed exactly (``compress=True``) or a plain copy."""

    kind = "cpu"

    def __init__(self, compress: bool, page_size: int = 4096):
        self.compress = compress
        self.page_size = page_size

    def offload(self, src: torch.Tensor, element_size: int) -> CpuStored:
        from . import api

        n = src.numel()
        if not self.compress:
            return CpuStored("raw", src.clone(), n, n)
        pages = -(-n // self.page_size)
        padded = torch.zeros(pages * self.page_size, dtype=torch.uint8)
        padded[:n] = src
        packed = api.pack(api.compress(padded, self.page_size, element_size, backend="cpu"))
        host = packed.payload.numel() + packed.sizes.numel() * 13
        return CpuStored("compressed", packed, n, host)

    def restore(self, stored: CpuStored, out: torch.Tensor) -> None:
        from . import api

        if stored.kind == "raw":
            out.copy_(stored.data)
        else:
            out.copy_(api.decompress(stored.data, backend="cpu").view(-1)[: stored.nbytes])

    def free(self, stored: CpuStored) -> None:
        stored.data = None


# --------------------------------------------------------------------------------- policy
class ClassPolicy:
    """Per ``(dtype, shape)`` class: compress the first ``samples`` tensors, measure the ratio
    (uncompressed / stored bytes) once they are done, then keep compressing only when the
    ratio reaches ``min_ratio``; otherwise the class takes the uncompressed pinned path.

    The ratio counts only the batches the kernel compressed: batches the compressor stored
    raw to keep its copy engine busy (a ``PageCompressor`` passed in with ``max_raw_share``)
    say nothing about the data. Counting them (cf21ca7, H200) measured bf16 activations that
    compress 1.22-1.27x at 1.05-1.10 and sent most classes to the uncompressed path. A sample
    whose every batch went raw is dropped and the next tensor of the class sampled instead."""

    def __init__(self, samples: int = 2, min_ratio: float = 1.1):
        self.samples = samples
        self.min_ratio = min_ratio
        self.decided: dict[tuple, bool] = {}
        self.ratios: dict[tuple, float] = {}
        self._pending: dict[tuple, list[CompressedStored]] = {}
        self._measured: dict[tuple, list[tuple[int, int]]] = {}

    def compress(self, key: tuple) -> bool:
        if key in self.decided:
            return self.decided[key]
        self.poll(key)
        return self.decided.get(key, True)

    def sample(self, key: tuple, stored: CompressedStored) -> None:
        if key not in self.decided:
            pending = self._pending.setdefault(key, [])
            if len(pending) + len(self._measured.get(key, ())) < self.samples:
                pending.append(stored)

    def poll(self, key: tuple | None = None) -> None:
        for k in [key] if key is not None else list(self._pending):
            pending = self._pending.get(k, [])
            for s in [s for s in pending if s.ready() or s.freed]:
                measured = s.kernel_bytes()
                if measured is not None and measured[0] > 0:
                    self._measured.setdefault(k, []).append(measured)
                pending.remove(s)
            done = self._measured.get(k, [])
            if len(done) >= self.samples and k not in self.decided:
                ratio = sum(a for a, _ in done) / max(1, sum(b for _, b in done))
                self.ratios[k] = ratio
                self.decided[k] = ratio >= self.min_ratio
                self._pending.pop(k, None)

    def summary(self) -> dict:
        return {
            f"{k[0]}{list(k[1])}": {"ratio": round(r, 4), "compress": self.decided[k]}
            for k, r in self.ratios.items()
        }


# --------------------------------------------------------------------------------- worker
class Worker:
    """A daemon thread that runs submitted jobs in order. ``PageCompressor.offload/restore``
    block on their ring's back-pressure; run here, they never block the autograd hooks."""

    def __init__(self, name: str = "pagecomp-offload"):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._name = name
        self._lock = threading.Lock()

    def submit(self, job) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
        self._q.put(job)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job()  # jobs report their own errors
            del job  # drop its references before blocking on the next one

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
