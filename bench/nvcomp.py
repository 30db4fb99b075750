"""nvCOMP's batched low-level C API through ctypes: LZ4 one chunk per page, and the typed
codecs (ANS, Bitcomp) the bf16 corpora are measured with (issue #23).

An optional dependency: :func:`load` returns ``(None, reason)`` when ``libnvcomp.so.6`` cannot be
found (looked up in ``$NVCOMP_LIB``, the ``nvidia-libnvcomp-cu13`` wheel, then the system).
Signatures, enum values and the 64-byte options structs follow ``nvcomp/lz4.h``, ``ans.h``,
``bitcomp.h`` and ``shared_types.h`` of nvCOMP 6.0 (the wheel ``nvidia-libnvcomp-cu13==6.0.0.12``).
LZ4 output is RAW LZ4: one standard LZ4 block per chunk, no header. ANS and Bitcomp chunks are
nvCOMP's own self-describing streams.

Every algorithm has the same five batched entry points (``nvcompBatched<Algo>CompressGetTempSize``,
``...CompressGetMaxOutputChunkSize``, ``...CompressAsync``, ``...DecompressGetTempSize``,
``...DecompressAsync``), so one :class:`ChunkPlan` drives them all; only the options structs
differ. A symbol this library lacks, or options its host-side size queries refuse, raise
:class:`Unavailable` (the harness records the reason and goes on).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

# nvcompType_t (shared_types.h)
TYPE_CHAR, TYPE_UCHAR, TYPE_SHORT, TYPE_USHORT, TYPE_INT, TYPE_UINT = 0, 1, 2, 3, 4, 5
TYPE_FLOAT16, TYPE_FLOAT32, TYPE_BITS = 10, 11, 0xFF
TYPE_NAMES = {0: "CHAR", 1: "UCHAR", 2: "SHORT", 3: "USHORT", 4: "INT", 5: "UINT",
              6: "LONGLONG", 7: "ULONGLONG", 9: "FLOAT8_E4M3", 10: "FLOAT16", 11: "FLOAT32",
              12: "FLOAT64", 0xFF: "BITS"}
# bitshuffle needs an integer type of the element width (FLOAT16 is refused).
_TYPE_FOR_WIDTH = {1: TYPE_CHAR, 2: TYPE_USHORT, 4: TYPE_UINT}
BITSHUFFLE_NONE, BITSHUFFLE_MSB_FIRST, BITSHUFFLE_LSB_FIRST = 0, 1, 2
BACKEND_DEFAULT = 0
SUCCESS = 0
ANS_RANS = 0  # nvcompANSType_t
BITCOMP_DEFAULT_ALGO, BITCOMP_LOSSLESS = 0, 0
# nvcompStatus_t; statuses a host-side query answers for options this build does not take
STATUS_NAMES = {0: "nvcompSuccess", 10: "nvcompErrorInvalidValue",
                11: "nvcompErrorNotSupported", 12: "nvcompErrorCannotDecompress",
                13: "nvcompErrorBadChecksum", 14: "nvcompErrorCannotVerifyChecksums",
                15: "nvcompErrorOutputBufferTooSmall", 16: "nvcompErrorWrongHeaderLength",
                17: "nvcompErrorAlignment", 18: "nvcompErrorChunkSizeTooLarge",
                19: "nvcompErrorCannotCompress", 20: "nvcompErrorWrongInputLength",
                21: "nvcompErrorBatchSizeTooLarge", 22: "nvcompErrorSubChunkCountTooLarge",
                23: "nvcompErrorSubChunkCountTooSmall",
                24: "nvcompErrorOutputBufferAlignmentTooSmall", 1000: "nvcompErrorCudaError",
                10000: "nvcompErrorInternal"}
_REFUSED = (10, 11, 18, 21)


class Unavailable(RuntimeError):
    """This nvCOMP cannot run the requested algorithm or options (missing symbol, or a
    host-side query refused them): a reason to record, not a failed round trip."""


def status_name(status: int) -> str:
    return f"{STATUS_NAMES.get(status, 'unknown')} ({status})"

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


class ANSCompressOpts(ctypes.Structure):  # nvcompBatchedANSCompressOpts_t
    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int),
                ("max_sub_chunk_count", ctypes.c_uint8), ("states_per_lane", ctypes.c_uint8),
                ("histogram_reduction_log2", ctypes.c_uint8), ("reserved", ctypes.c_char * 53)]


class ANSDecompressOpts(ctypes.Structure):  # nvcompBatchedANSDecompressOpts_t
    _fields_ = [("backend", ctypes.c_int), ("data_type", ctypes.c_int),
                ("max_sub_chunk_count", ctypes.c_uint8), ("states_per_lane", ctypes.c_uint8),
                ("skip_validate", ctypes.c_uint8), ("reserved", ctypes.c_char * 53)]


class BitcompCompressOpts(ctypes.Structure):  # nvcompBatchedBitcompCompressOpts_t
    _fields_ = [("algorithm", ctypes.c_int), ("data_type", ctypes.c_int),
                ("delta", ctypes.c_double), ("mode", ctypes.c_int),
                ("reserved", ctypes.c_char * 44)]


class BitcompDecompressOpts(ctypes.Structure):  # nvcompBatchedBitcompDecompressOpts_t
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class Alignments(ctypes.Structure):  # nvcompAlignmentRequirements_t
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t),
                ("temp", ctypes.c_size_t)]


class _Props(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


# the options structs of each algorithm: (compress, decompress), 64 bytes each
OPTIONS = {
    "LZ4": (CompressOpts, DecompressOpts),
    "ANS": (ANSCompressOpts, ANSDecompressOpts),
    "Bitcomp": (BitcompCompressOpts, BitcompDecompressOpts),
}
assert all(ctypes.sizeof(t) == 64 for pair in OPTIONS.values() for t in pair)

_SIGNATURES = {
    "nvcompGetProperties": [ctypes.POINTER(_Props)],
}


def algorithm_signatures(algo: str) -> dict[str, list]:
    """The batched entry points of ``algo`` (a key of :data:`OPTIONS`) and their argtypes;
    the two ``GetRequiredAlignments`` are optional (queried where present)."""
    c, d = OPTIONS[algo]
    pre = f"nvcompBatched{algo}"
    return {
        pre + "CompressGetTempSize": [_size_t, _size_t, c, _psize, _size_t, _p],
        pre + "CompressGetMaxOutputChunkSize": [_size_t, c, _psize],
        pre + "CompressAsync": [_p, _p, _size_t, _size_t, _p, _size_t, _p, _p, c, _p, _p],
        pre + "DecompressGetTempSize": [_size_t, _size_t, d, _psize, _size_t, _p],
        pre + "DecompressAsync": [_p, _p, _p, _p, _size_t, _p, _size_t, _p, d, _p, _p],
        pre + "CompressGetRequiredAlignments": [c, ctypes.POINTER(Alignments)],
        pre + "DecompressGetRequiredAlignments": [d, ctypes.POINTER(Alignments)],
    }


_OPTIONAL_SUFFIXES = ("GetRequiredAlignments",)


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
        self.bind("LZ4")  # required: a library without it is not loaded

    def check(self, status: int, what: str) -> None:
        if status != SUCCESS:
            raise RuntimeError(f"{what} failed with nvcompStatus_t {status_name(status)}")

    def bind(self, algo: str) -> dict:
        """``{entry point: function or None}`` of ``algo``, typed; :class:`Unavailable` if
        this library lacks a required one (an older nvCOMP, or a build without it)."""
        cache = self.__dict__.setdefault("_bound", {})
        if algo in cache:
            return cache[algo]
        if algo not in OPTIONS:
            raise Unavailable(f"no options structs for nvCOMP algorithm {algo!r} here")
        fns: dict = {}
        for name, argtypes in algorithm_signatures(algo).items():
            try:
                fn = getattr(self.lib, name)
            except AttributeError:
                if name.endswith(_OPTIONAL_SUFFIXES):
                    fns[name] = None
                    continue
                raise Unavailable(f"{name} is not in {self.path} (nvCOMP {self.version})") \
                    from None
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            fns[name] = fn
        cache[algo] = fns
        return fns


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


class ChunkPlan:
    """Buffers for compressing ``pages`` (``uint8 [N, P]``, contiguous, CUDA) with one nvCOMP
    algorithm in chunks of ``chunk_bytes`` of the flat buffer (the last one shorter where the
    pages do not fill it), and back; the same batched calls for every algorithm.

    After :meth:`compress`, ``out[i, :sizes[i]]`` is chunk ``i``; after :meth:`decompress`,
    ``result`` holds the pages again. Building a plan only runs host-side queries (sizes,
    alignments), so options are checked before anything is launched; :class:`Unavailable`
    says why a plan cannot be made.
    """

    algo = "LZ4"

    def _setup(self, nv: NvcompLib, pages: torch.Tensor, algo: str, copts, dopts,
               chunk_bytes: int) -> None:
        if pages.dim() != 2 or not pages.is_contiguous() or pages.dtype != torch.uint8:
            raise ValueError("pages must be a contiguous uint8 [N, P] tensor")
        self.nv, self.pages, self.algo = nv, pages, algo
        self.copts, self.dopts = copts, dopts
        fns = nv.bind(algo)
        pre = f"nvcompBatched{algo}"
        self._compress_fn = fns[pre + "CompressAsync"]
        self._decompress_fn = fns[pre + "DecompressAsync"]
        n_pages, p = pages.shape
        total = n_pages * p
        n = -(-total // chunk_bytes)
        dev = pages.device
        self.n, self.page_size, self.chunk_bytes, self.total_bytes = n, p, chunk_bytes, total

        def query(name: str, *args) -> None:
            status = fns[pre + name](*args)
            if status in _REFUSED:
                raise Unavailable(f"nvCOMP {nv.version} {algo} refused {self.options_text()} "
                                  f"at {chunk_bytes}-byte chunks: {pre}{name} returned "
                                  f"{status_name(status)}")
            nv.check(status, pre + name)

        max_out = _size_t()
        query("CompressGetMaxOutputChunkSize", chunk_bytes, copts, ctypes.byref(max_out))
        align_in, align_out = 1, 16
        if fns[pre + "CompressGetRequiredAlignments"] is not None:
            al = Alignments()
            query("CompressGetRequiredAlignments", copts, ctypes.byref(al))
            align_in, align_out = al.input, max(16, al.output)
        if chunk_bytes % max(1, align_in) or pages.data_ptr() % max(1, align_in):
            raise Unavailable(f"{algo} needs {align_in}-byte aligned input chunks; "
                              f"{chunk_bytes}-byte chunks do not keep that")
        self.stride = -(-max_out.value // align_out) * align_out
        ctemp, dtemp = _size_t(), _size_t()
        query("CompressGetTempSize", n, chunk_bytes, copts, ctypes.byref(ctemp), total, None)
        query("DecompressGetTempSize", n, chunk_bytes, dopts, ctypes.byref(dtemp), total, None)
        self.ctemp = torch.empty(max(1, ctemp.value), dtype=torch.uint8, device=dev)
        self.dtemp = torch.empty(max(1, dtemp.value), dtype=torch.uint8, device=dev)
        self.in_ptrs = _ptrs(pages, n, chunk_bytes)
        self.in_bytes = torch.full((n,), chunk_bytes, dtype=torch.int64, device=dev)
        self.in_bytes[-1] = total - (n - 1) * chunk_bytes
        self.out = torch.zeros((n, self.stride), dtype=torch.uint8, device=dev)
        self.out_ptrs = _ptrs(self.out, n, self.stride)
        self.sizes = torch.zeros(n, dtype=torch.int64, device=dev)
        self.cstatus = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.result = torch.empty_like(pages)
        self.result_ptrs = _ptrs(self.result, n, chunk_bytes)
        self.result_bytes = torch.zeros(n, dtype=torch.int64, device=dev)
        self.dstatus = torch.full((n,), -1, dtype=torch.int32, device=dev)

    def options_text(self) -> str:
        """The options that matter, as ``name=value`` (enums by name)."""
        parts = []
        for name, _ in self.copts._fields_:
            if name == "reserved":
                continue
            v = getattr(self.copts, name)
            parts.append(f"{name}={TYPE_NAMES.get(v, v) if name == 'data_type' else v}")
        return ", ".join(parts)

    def describe(self) -> dict:
        """What the report records of this plan."""
        return {"algorithm": self.algo, "chunk_bytes": self.chunk_bytes, "chunks": self.n,
                "data_type": TYPE_NAMES.get(self.copts.data_type, self.copts.data_type),
                "options": self.options_text()}

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.pages.device).cuda_stream

    def compress(self) -> None:
        """Enqueue compression of every chunk on the current stream."""
        self.nv.check(self._compress_fn(
            self.in_ptrs.data_ptr(), self.in_bytes.data_ptr(), self.chunk_bytes, self.n,
            self.ctemp.data_ptr(), self.ctemp.numel(), self.out_ptrs.data_ptr(),
            self.sizes.data_ptr(), self.copts, self.cstatus.data_ptr(), self._stream(),
        ), f"nvcompBatched{self.algo}CompressAsync")

    def decompress(self, src_ptrs: torch.Tensor | None = None) -> None:
        """Enqueue decompression of ``out`` into ``result`` on the current stream.

        ``src_ptrs``: an ``int64 [n]`` device array of where each chunk (``sizes[i]`` bytes)
        lies instead, e.g. in a packed copy of ``out``; kept alive by the caller until done.
        """
        src = self.out_ptrs if src_ptrs is None else src_ptrs
        self.nv.check(self._decompress_fn(
            src.data_ptr(), self.sizes.data_ptr(), self.in_bytes.data_ptr(),
            self.result_bytes.data_ptr(), self.n, self.dtemp.data_ptr(), self.dtemp.numel(),
            self.result_ptrs.data_ptr(), self.dopts, self.dstatus.data_ptr(), self._stream(),
        ), f"nvcompBatched{self.algo}DecompressAsync")

    def stored_bytes(self) -> int:
        return int(self.sizes.sum())

    def compress_ok(self) -> bool:
        return bool((self.cstatus == SUCCESS).all())

    def roundtrip_ok(self) -> bool:
        """Every chunk decoded with success status to its full length, equal to the input."""
        return bool(
            (self.dstatus == SUCCESS).all()
            and torch.equal(self.result_bytes, self.in_bytes)
            and torch.equal(self.result, self.pages)
        )


@dataclass
class LZ4Plan(ChunkPlan):
    """LZ4 chunk-per-page: ``bitshuffle_width`` 1 means plain LZ4; 2 or 4 selects nvCOMP's
    LSB-first bit-shuffle with an unsigned integer type of that width."""

    nv: NvcompLib
    pages: torch.Tensor
    bitshuffle_width: int = 1

    def __post_init__(self):
        width = self.bitshuffle_width
        mode = BITSHUFFLE_NONE if width == 1 else BITSHUFFLE_LSB_FIRST
        dtype = _TYPE_FOR_WIDTH[width]
        self._setup(self.nv, self.pages, "LZ4", CompressOpts(dtype, mode),
                    DecompressOpts(BACKEND_DEFAULT, 0, dtype, mode), self.pages.shape[1])


# ------------------------------------------------------------- typed codecs (issue #23)
@dataclass(frozen=True)
class Variant:
    """One typed nvCOMP configuration: a row ``{"codec": "nvcomp", "variant": name}``."""

    name: str
    algo: str
    chunk_bytes: int
    data_type: int
    about: str

    def options(self):
        """``(compress options, decompress options)`` for this variant."""
        if self.algo == "ANS":
            # decompress names the type too: it must match the stream, and lets nvCOMP pick
            # the typed kernel; everything else at its default (0: auto / read the stream)
            return (ANSCompressOpts(ANS_RANS, self.data_type),
                    ANSDecompressOpts(BACKEND_DEFAULT, self.data_type))
        if self.algo == "Bitcomp":
            return (BitcompCompressOpts(BITCOMP_DEFAULT_ALGO, self.data_type, 0.0,
                                        BITCOMP_LOSSLESS),
                    BitcompDecompressOpts(BACKEND_DEFAULT))
        raise Unavailable(f"no typed variant of {self.algo}")


def kib(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n}b"


def typed_variants(element_size: int, page_size: int = 4096) -> list[Variant]:
    """The typed nvCOMP rows of a corpus of ``element_size``-byte values: on bf16 (2 bytes)
    ANS in its 16-bit float mode (``FLOAT16``, "applicable to all half-precision data
    formats") one chunk per page and in 64 KiB chunks (the size nvCOMP recommends), and
    lossless Bitcomp (default algorithm) per page on 16-bit unsigned integers (its lossless
    mode "views any data type as an integral type")."""
    if element_size != 2:
        return []
    big = max(65536, page_size)
    return [
        Variant(f"ans-fp16-{kib(page_size)}", "ANS", page_size, TYPE_FLOAT16,
                "ANS (rANS), data_type FLOAT16, one chunk per page"),
        Variant(f"ans-fp16-{kib(big)}", "ANS", big, TYPE_FLOAT16,
                f"ANS (rANS), data_type FLOAT16, {kib(big)} chunks of consecutive pages"),
        Variant(f"bitcomp-{kib(page_size)}", "Bitcomp", page_size, TYPE_USHORT,
                "Bitcomp lossless, default algorithm, data_type USHORT, one chunk per page"),
    ]


def make_plan(nv: NvcompLib, pages: torch.Tensor, variant: Variant) -> ChunkPlan:
    """A :class:`ChunkPlan` of ``variant`` over ``pages``; :class:`Unavailable` if this nvCOMP
    cannot run it."""
    plan = ChunkPlan()
    copts, dopts = variant.options()
    plan._setup(nv, pages, variant.algo, copts, dopts, variant.chunk_bytes)
    return plan
