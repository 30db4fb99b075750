"""nvCOMP batched LZ4 through its low-level C API (ctypes), one chunk per page.

An optional dependency: :func:`load` returns ``(None, reason)`` when ``libnvcomp.so.6`` cannot be
found (looked up in ``$NVCOMP_LIB``, the ``nvidia-libnvcomp-cu13`` wheel, then the system).
Signatures, enum values and the 64-byte options structs follow ``nvcomp/lz4.h`` and
``nvcomp/shared_types.h`` of nvCOMP 6.0 (the wheel ``nvidia-libnvcomp-cu13==6.0.0.12``).
Output is RAW LZ4: one standard LZ4 block per chunk, no header.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

# nvcompType_t: bitshuffle needs an integer type of the element width (FLOAT16 is refused).
_TYPE_FOR_WIDTH = {1: 0, 2: 3, 4: 5}  # CHAR, USHORT, UINT
BITSHUFFLE_NONE, BITSHUFFLE_MSB_FIRST, BITSHUFFLE_LSB_FIRST = 0, 1, 2
BACKEND_DEFAULT = 0
SUCCESS = 0

_size_t = ctypes.c_size_t
_p = ctypes.c_void_p
_psize = ctypes.POINTER(ctypes.c_size_t)


class CompressOpts(ctypes.Structure):
    _fields_ = [("data_type", ctypes.c_int), ("bitshuffle_mode", ctypes.c_int),
                ("reserved", ctypes.c_char * 56)]


class DecompressOpts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("sort_before_hw_decompress", ctypes.c_int),
                ("data_type", ctypes.c_int), ("bitshuffle_mode", ctypes.c_int),
                ("reserved", ctypes.c_char * 48)]


class _Props(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


assert ctypes.sizeof(CompressOpts) == 64 and ctypes.sizeof(DecompressOpts) == 64

_SIGNATURES = {
    "nvcompGetProperties": [ctypes.POINTER(_Props)],
    "nvcompBatchedLZ4CompressGetTempSize": [_size_t, _size_t, CompressOpts, _psize, _size_t, _p],
    "nvcompBatchedLZ4CompressGetMaxOutputChunkSize": [_size_t, CompressOpts, _psize],
    "nvcompBatchedLZ4CompressAsync": [
        _p, _p, _size_t, _size_t, _p, _size_t, _p, _p, CompressOpts, _p, _p
    ],
    "nvcompBatchedLZ4DecompressGetTempSize": [
        _size_t, _size_t, DecompressOpts, _psize, _size_t, _p
    ],
    "nvcompBatchedLZ4DecompressAsync": [
        _p, _p, _p, _p, _size_t, _p, _size_t, _p, DecompressOpts, _p, _p
    ],
}


def _candidates() -> list[str]:
    paths = []
    if os.environ.get("NVCOMP_LIB"):
        paths.append(os.environ["NVCOMP_LIB"])
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            paths.append(os.path.join(d, "lib64", "libnvcomp.so.6"))
    for d in sys.path:  # a wheel under a path where "nvidia" is not a namespace package
        paths.append(os.path.join(d or ".", "nvidia", "libnvcomp", "lib64", "libnvcomp.so.6"))
    paths.append("libnvcomp.so.6")
    return list(dict.fromkeys(paths))


class NvcompLib:
    """The loaded library with typed entry points; ``version`` like ``"6.0.0"``."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib = lib
        self.path = path
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        props = _Props()
        self.check(lib.nvcompGetProperties(ctypes.byref(props)), "nvcompGetProperties")
        v = props.version
        self.version = f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
        self.cudart_version = props.cudart_version

    def check(self, status: int, what: str) -> None:
        if status != SUCCESS:
            raise RuntimeError(f"{what} failed with nvcompStatus_t {status}")


def load() -> tuple[NvcompLib | None, str]:
    """``(library, "")`` or ``(None, why not)``."""
    errors = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            continue
        try:
            return NvcompLib(ctypes.CDLL(path, ctypes.RTLD_LOCAL), path), ""
        except (OSError, AttributeError, RuntimeError) as exc:
            errors.append(f"{path}: {exc}")
    detail = "; ".join(errors) if errors else "not installed"
    return None, ("nvCOMP not found (pip install nvidia-libnvcomp-cu13, or set NVCOMP_LIB): "
                  + detail)


def _ptrs(base: torch.Tensor, n: int, stride: int) -> torch.Tensor:
    """``int64 [n]`` device array of ``base.data_ptr() + i * stride``."""
    idx = torch.arange(n, device=base.device, dtype=torch.int64)
    return idx * stride + base.data_ptr()


@dataclass
class LZ4Plan:
    """Buffers for compressing ``pages`` (``uint8 [N, P]``, CUDA) chunk-per-page, and back.

    ``bitshuffle_width`` 1 means plain LZ4; 2 or 4 selects nvCOMP's LSB-first bit-shuffle with
    an unsigned integer type of that width. After :meth:`compress`, ``out[i, :sizes[i]]`` is
    page ``i``'s LZ4 block; after :meth:`decompress`, ``result`` holds the pages again.
    """

    nv: NvcompLib
    pages: torch.Tensor
    bitshuffle_width: int = 1

    def __post_init__(self):
        nv, pages = self.nv, self.pages
        n, p = pages.shape
        dev = pages.device
        self.n, self.page_size = n, p
        width = self.bitshuffle_width
        mode = BITSHUFFLE_NONE if width == 1 else BITSHUFFLE_LSB_FIRST
        dtype = _TYPE_FOR_WIDTH[width]
        self.copts = CompressOpts(dtype, mode)
        self.dopts = DecompressOpts(BACKEND_DEFAULT, 0, dtype, mode)
        max_out = _size_t()
        nv.check(nv.lib.nvcompBatchedLZ4CompressGetMaxOutputChunkSize(
            p, self.copts, ctypes.byref(max_out)), "GetMaxOutputChunkSize")
        self.stride = -(-max_out.value // 16) * 16
        ctemp, dtemp = _size_t(), _size_t()
        nv.check(nv.lib.nvcompBatchedLZ4CompressGetTempSize(
            n, p, self.copts, ctypes.byref(ctemp), n * p, None), "CompressGetTempSize")
        nv.check(nv.lib.nvcompBatchedLZ4DecompressGetTempSize(
            n, p, self.dopts, ctypes.byref(dtemp), n * p, None), "DecompressGetTempSize")
        self.ctemp = torch.empty(max(1, ctemp.value), dtype=torch.uint8, device=dev)
        self.dtemp = torch.empty(max(1, dtemp.value), dtype=torch.uint8, device=dev)
        self.in_ptrs = _ptrs(pages, n, p)
        self.in_bytes = torch.full((n,), p, dtype=torch.int64, device=dev)
        self.out = torch.zeros((n, self.stride), dtype=torch.uint8, device=dev)
        self.out_ptrs = _ptrs(self.out, n, self.stride)
        self.sizes = torch.zeros(n, dtype=torch.int64, device=dev)
        self.cstatus = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.result = torch.empty_like(pages)
        self.result_ptrs = _ptrs(self.result, n, p)
        self.result_bytes = torch.zeros(n, dtype=torch.int64, device=dev)
        self.dstatus = torch.full((n,), -1, dtype=torch.int32, device=dev)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.pages.device).cuda_stream

    def compress(self) -> None:
        """Enqueue compression of every page on the current stream."""
        self.nv.check(self.nv.lib.nvcompBatchedLZ4CompressAsync(
            self.in_ptrs.data_ptr(), self.in_bytes.data_ptr(), self.page_size, self.n,
            self.ctemp.data_ptr(), self.ctemp.numel(), self.out_ptrs.data_ptr(),
            self.sizes.data_ptr(), self.copts, self.cstatus.data_ptr(), self._stream(),
        ), "nvcompBatchedLZ4CompressAsync")

    def decompress(self, src_ptrs: torch.Tensor | None = None) -> None:
        """Enqueue decompression of ``out`` into ``result`` on the current stream.

        ``src_ptrs``: an ``int64 [n]`` device array of where each chunk (``sizes[i]`` bytes)
        lies instead, e.g. in a packed copy of ``out``; kept alive by the caller until done.
        """
        src = self.out_ptrs if src_ptrs is None else src_ptrs
        self.nv.check(self.nv.lib.nvcompBatchedLZ4DecompressAsync(
            src.data_ptr(), self.sizes.data_ptr(), self.in_bytes.data_ptr(),
            self.result_bytes.data_ptr(), self.n, self.dtemp.data_ptr(), self.dtemp.numel(),
            self.result_ptrs.data_ptr(), self.dopts, self.dstatus.data_ptr(), self._stream(),
        ), "nvcompBatchedLZ4DecompressAsync")

    def stored_bytes(self) -> int:
        return int(self.sizes.sum())

    def compress_ok(self) -> bool:
        return bool((self.cstatus == SUCCESS).all())

    def roundtrip_ok(self) -> bool:
        """Every chunk decoded with success status to exactly ``P`` bytes equal to the input."""
        return bool(
            (self.dstatus == SUCCESS).all()
            and (self.result_bytes == self.page_size).all()
            and torch.equal(self.result, self.pages)
        )
