"""Host-to-device copies of page-locked arena bytes by address, for the restores' hot path.

A restore copies each run of arena bytes into its staging buffer. Through ``Tensor.copy_`` a
piece costs three tensor operations (a view of the chunk, a view of the staging buffer, the
copy's dispatch) before ``cudaMemcpyAsync``; here the CUDA driver's ``cuMemcpyHtoDAsync`` is
called with the two addresses on the current stream, which orders it exactly as the copy was
(the staging buffer was allocated on that stream; the arena's chunk reuse waits for the
restore stream as before). Where the driver call is not available or fails (no
``libcuda.so.1``, or a context the thread has not made current), the copy goes through
``Tensor.copy_`` from then on.
"""

from __future__ import annotations

import ctypes

import torch

# the driver's cuMemcpyHtoDAsync_v2 and cuMemcpyDtoHAsync_v2, each None where it cannot be
# used (looked up on first use)
_DRIVER: dict = {}


def _driver_copy(name: str):
    if name not in _DRIVER:
        fn = None
        try:
            fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
            # (destination, source, bytes, stream): device pointers are integers
            fn.argtypes = ([ctypes.c_uint64, ctypes.c_void_p] if "HtoD" in name
                           else [ctypes.c_void_p, ctypes.c_uint64]) + [ctypes.c_size_t,
                                                                       ctypes.c_void_p]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _DRIVER[name] = fn
    return _DRIVER[name]


def _memcpy_htod():
    return _driver_copy("cuMemcpyHtoDAsync_v2")


def host_bytes(addr: int, nbytes: int) -> torch.Tensor:
    """The host memory at ``addr`` as ``uint8 [nbytes]`` (a view, nothing copied): a CPU
    output's row, a span of the arena."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def copy_spans(dst: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
    """Copy host bytes into ``dst`` (``uint8``, CUDA or CPU) on the current stream: each span
    ``(offset in dst, host address, bytes)`` (``VirtualArena.spans``: page-locked, so
    non-blocking on CUDA)."""
    fn = _memcpy_htod() if dst.is_cuda else None
    if fn is not None:
        base = dst.data_ptr()
        stream = torch._C._cuda_getCurrentRawStream(dst.device.index)
    for at, addr, n in spans:
        if fn is not None:
            if fn(base + at, addr, n, stream) == 0:
                continue
            _DRIVER["cuMemcpyHtoDAsync_v2"] = fn = None  # e.g. no current context:
        dst[at:at + n].copy_(host_bytes(addr, n), non_blocking=dst.is_cuda)  # copy_ from now on


def copy_to_host(src: torch.Tensor, spans: list[tuple[int, int, int]], stream) -> None:
    """Copy bytes of ``src`` (``uint8``, CUDA or CPU) into page-locked host memory on
    ``stream`` (a ``torch.cuda.Stream``; None on the CPU, where the copy is done at once):
    each span ``(offset in src, host address, bytes)``, as :func:`copy_spans` takes them the
    other way. The caller keeps ``src`` until the copies are done (an event after them)."""
    fn = _driver_copy("cuMemcpyDtoHAsync_v2") if src.is_cuda else None
    base = src.data_ptr()
    for at, addr, n in spans:
        if fn is not None:
            if fn(addr, base + at, n, stream.cuda_stream) == 0:
                continue
            _DRIVER["cuMemcpyDtoHAsync_v2"] = fn = None  # Tensor.copy_ from now on
        if src.is_cuda:
            with torch.cuda.stream(stream):
                host_bytes(addr, n).copy_(src[at:at + n], non_blocking=True)
        else:
            host_bytes(addr, n).copy_(src[at:at + n])
