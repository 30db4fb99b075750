"""The host path of one small ``compress`` / ``decompress`` call (#26).

With few pages a call is host work: the public function checks its arguments and asks
``backend.route``, the kernel's launcher checks them again and picks its settings, and the
launch goes through the direct path's per-argument scan (``kernels.launch``): 50-60 us of host
time per call on an H200's host, of which Triton's C launcher is a few.

Here an eager call skips what an earlier call already settled:

- ``compress``: a :class:`CompressPlan` per signature (the input's shape, dtype and device,
  ``page_size``, ``element_size``, ``codec``, ``backend``, whether ``out`` is given) is made by
  ``api.compress`` after a call of that signature passed every check and ran the kernels
  itself (route ``KERNELS``, or ``INTERPRET`` on the CPU). A later call of the signature checks
  only what the signature does not fix (the tensor's type, contiguity and alignment, no
  tracing or dispatch mode, the interpreter as it was) and launches with the plan's settings,
  by address on a GPU, as ``compress_pages`` / ``compress_exp_pages`` would.
- ``decompress``: a fixed-stride container without checksums on a usable GPU, checked by
  ``format.plainly_valid``, makes the launches ``decompress_into`` /
  ``decompress_exp_into`` make, without their checks.
- Both keep the compiled kernels they launch (:class:`_Kept`) and call Triton's launcher
  directly once their arguments' classes are known; an LZ4 compress takes its scratch as a
  raw block of PyTorch's caching allocator. A planned call is its allocations and one or two
  launches: 22-28 us on an H200's host (``bench/results/h200x2_c2301fe_session54``).

Anything else (other arguments, the first call of a signature, ``torch.compile``, a tensor
subclass, checksums, packed containers) takes the full path, which gives the same bytes.
"""

from __future__ import annotations

import torch

from . import backend
from .format import CompressedPages, plainly_valid
from .kernels import launch as _launch
from .kernels.launch import interpreting

_PLAN_LIMIT = 256  # signatures remembered (all forgotten past it: a program that keeps changing
# shapes pays the full path, never unbounded memory)


def _eager(interpret: bool, *tensors: torch.Tensor) -> bool:
    """The direct launch's conditions (``backend.direct_launch_ok``, or the interpreter's on the
    CPU) that a plan's signature does not fix."""
    return interpreting() == interpret and backend.eager_call_ok(tensors)


class _Kept:
    """The launches of one plan (fixed kernels, settings and grid on device ``index``), over
    arguments whose classes repeat call after call: each call's first goes through
    ``launch.launch_known`` (which compiles and caches); once every address was 16-byte
    aligned, the compiled kernels are kept and a later call with aligned addresses calls
    them directly (``launch.launch_entry``), skipping the per-argument classes and the cache
    lookups (a few microseconds a launch)."""

    __slots__ = ("index", "grid", "launches", "entries")

    def __init__(self, index: int, grid: tuple, launches: tuple):
        self.index, self.grid, self.launches = index, grid, launches
        self.entries = None

    def __call__(self, addrs: tuple, tail: tuple, args) -> None:
        """Launch with the tensors at ``addrs`` (None: an absent optional tensor), then the
        kernels' other arguments ``tail``; ``args``: a function that makes the tensors and
        ``tail``, for the usual way."""
        bits = 0
        for a in addrs:
            if a is not None:
                bits |= a
        aligned = not bits & 15
        entries, index = self.entries, self.index
        if entries is not None and aligned and _launch.entries_usable(index):
            self.launch_entries((*addrs, *tail), torch._C._cuda_getCurrentRawStream(index))
            return
        made = args()
        classes = _launch.known_args(made)[0]
        for kernel, meta in self.launches:
            _launch.launch_known(kernel, self.grid, index, meta, classes, (*addrs, *tail), made)
        if entries is None and aligned:
            kept = tuple(_launch.kept_entry(k, index, m, classes) for k, m in self.launches)
            if None not in kept:
                self.entries = kept

    def launch_entries(self, values: tuple, stream: int) -> None:
        """Launch the kept entries with the launcher's ``values`` on CUDA stream ``stream``
        (the caller checked ``launch.entries_usable`` and the addresses' alignment)."""
        for entry in self.entries:
            _launch.launch_entry(entry, self.grid, self.index, values, stream)


# the caching allocator's raw blocks (PyTorch's own, behind torch.cuda.caching_allocator_alloc,
# without its Python stream lookup): absent from a build without CUDA
_RAW_ALLOC = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_RAW_DELETE = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)


# --------------------------------------------------------------------------- compress
def _compress_key(data, page_size, element_size, codec, backend_name, out) -> tuple | None:
    """The signature of a ``compress`` call, or None for arguments a plan never serves (a
    tensor subclass, non-int sizes: their full checks differ by value, not by signature; a
    meta tensor, whose ``get_device()`` is a CPU tensor's; a codec or backend that is not a
    string, which may not hash: the full path names them)."""
    if type(data) is not torch.Tensor or data.is_meta:
        return None
    if type(codec) is not str or type(backend_name) is not str:
        return None
    if not (page_size is None or type(page_size) is int):
        return None
    if not (element_size is None or type(element_size) is int):
        return None
    return (data.shape, data.dtype, data.get_device(), page_size, element_size, codec,
            backend_name, out is None)


class CompressPlan:
    """How ``compress`` runs a call of one signature: ``n`` pages of ``page`` bytes on
    ``device``, by the exponent codec (``fp16`` set) or LZ4 (``element_size``); ``interpret``:
    the launchers under ``TRITON_INTERPRET=1`` (CPU tensors), else addresses on a GPU."""

    __slots__ = ("n", "page", "device", "index", "codec", "fp16", "element_size", "interpret",
                 "cfg", "programs", "metas", "kernels", "kept", "int32", "scratch")

    def __init__(self, pages: torch.Tensor, element_size: int, float_format: str | None,
                 interpret: bool):
        from .kernels import exp_codec, lz4_compress

        self.kernels = (exp_codec, lz4_compress)  # (looked up once: an import costs a call)
        self.n, self.page = pages.shape
        self.device = pages.device
        self.index = pages.get_device()
        self.codec = "lz4" if float_format is None else "exp"
        self.fp16 = None if float_format is None else float_format == "fp16"
        self.element_size = element_size
        self.interpret = interpret
        self.int32 = torch.empty(0, dtype=torch.int32, device=self.device)  # (sizes' dtype)
        self.cfg = lz4_compress.compress_config(self.page, element_size)
        programs, self.metas = lz4_compress.known_settings(self.device, self.cfg)
        self.programs = min(self.n, programs)  # the launch's grid, as compress_pages picks it
        # pages at a 16-byte aligned address: the 8-byte (wide) loads' settings
        if self.fp16 is not None:
            self.kept = _Kept(self.index, (self.n,),
                              (exp_codec.encode_launch(self.page, self.fp16),))
        else:
            self.kept = _Kept(self.index, (self.programs,),
                              (lz4_compress.compress_launch(self.cfg, True),))
        self.scratch = None  # LZ4 on a GPU: (bytes, argument position, the other's address)
        if self.fp16 is None and not interpret and _RAW_ALLOC and _RAW_DELETE:
            self.scratch = lz4_compress.scratch_need(self.device, self.cfg, self.programs)

    def pages(self, data: torch.Tensor) -> torch.Tensor:
        """``data`` (the call's input) as ``uint8 [n, page]``."""
        return data if data.dim() == 2 else data.view(self.n, self.page)

    def run(self, data: torch.Tensor, out: CompressedPages | None) -> CompressedPages:
        """Compress ``data`` (checked: :func:`compress_plan`) into new tensors or ``out``'s
        (checked by the caller)."""
        n, p = self.n, self.page
        if out is None:  # (new_empty of a tensor of the dtype: fewer arguments to parse)
            payload = data.new_empty((n, p))
            sizes = self.int32.new_empty((n,))
            kinds = data.new_empty((n,))
        else:
            payload, sizes, kinds = out.payload, out.sizes, out.kinds
        if self.interpret:
            self._launchers(self.pages(data), (payload, sizes, kinds))
        else:
            self.launch_at(data, payload, sizes, kinds)
        return CompressedPages(payload, sizes, kinds, p, codec=self.codec)

    def _launchers(self, pages: torch.Tensor, outs: tuple) -> None:
        """The kernels' own launchers (the interpreter's path)."""
        exp, lz4 = self.kernels
        if self.fp16 is not None:
            exp.compress_exp_pages(pages, self.fp16, traced=False, out=outs)
        else:
            lz4.compress_pages(pages, self.element_size, traced=False, out=outs)

    def launch_at(self, data: torch.Tensor, payload: torch.Tensor, sizes: torch.Tensor,
                  kinds: torch.Tensor) -> None:
        """The launch ``compress_pages`` / ``compress_exp_pages`` makes, by address: its
        settings (grid, load width by the pages' storage offset) and scratch as it picks
        them, on the current stream of the plan's device."""
        n, index = self.n, self.index
        src, out = data.data_ptr(), (payload.data_ptr(), sizes.data_ptr(), kinds.data_ptr())
        if self.fp16 is not None:  # (its settings do not depend on the pages' alignment)
            self.kept((src, *out), (), lambda: (self.pages(data), payload, sizes, kinds))
            return
        aligned = src % 16 == 0  # the kept settings: 8-byte (wide) loads
        if (aligned and self.scratch is not None and self.kept.entries is not None
                and _launch.entries_usable(index)):
            self._launch_raw_scratch(src, out)
            return
        lz4 = self.kernels[1]
        tabs, shuf = lz4.compress_scratch(self.device, self.cfg, self.programs, kept_unused=True)
        addrs = (src, *out, tabs.data_ptr(), shuf.data_ptr())
        args = lambda: (self.pages(data), payload, sizes, kinds, tabs, shuf, n)  # noqa: E731
        if aligned:
            self.kept(addrs, (n,), args)
        else:
            lz4.compress_at(index, self.programs, n, self.metas[data.storage_offset() % 8 == 0],
                            addrs, args)

    def _launch_raw_scratch(self, src: int, out: tuple) -> None:
        """The kept LZ4 launch with its scratch a raw block of the caching allocator on the
        launch's stream, returned to it right after the launch (as a scratch tensor freed at
        the end of the call is: the stream's later work is ordered after this kernel): a
        tensor costs the host several microseconds more, a tenth of a small call (#26)."""
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        nbytes, position, other = self.scratch
        block = _RAW_ALLOC(nbytes, stream)
        try:
            tabs, shuf = (block, other) if position == 4 else (other, block)
            self.kept.launch_entries((src, *out, tabs, shuf, self.n), stream)
        finally:
            _RAW_DELETE(block)


_COMPRESS: dict[tuple, CompressPlan] = {}


def compress_plan(data, page_size, element_size, codec, backend_name, checksum, out
                  ) -> CompressPlan | None:
    """The plan that runs this ``compress`` call, or None (the full path): see the module
    docstring. ``data`` is contiguous, its pages where the kernels read them in place."""
    if checksum is not False or torch.compiler.is_compiling():  # (traced: the ops, always)
        return None
    key = _compress_key(data, page_size, element_size, codec, backend_name, out)
    plan = _COMPRESS.get(key) if key is not None else None
    if plan is None or not data.is_contiguous() or not _eager(plan.interpret, data):
        return None
    if not plan.interpret:  # read in place from a storage base PyTorch aligned (see
        offset = data.storage_offset()  # compress_pages; the full path copies the others)
        if offset % 4 or (data.data_ptr() - offset) % 16:
            return None
    return plan


def learn_compress(data, page_size, element_size, codec, backend_name, out, pages: torch.Tensor,
                   lz4_element_size: int, float_format: str | None, where: str) -> None:
    """Remember a plan for the signature of a ``compress`` call that passed every check and
    ran the kernels itself (route ``where``; ``pages``, ``lz4_element_size`` and
    ``float_format`` as the full path resolved them)."""
    if where not in (backend.KERNELS, backend.INTERPRET) or pages.shape[0] == 0:
        return
    key = _compress_key(data, page_size, element_size, codec, backend_name, out)
    if key is None or key in _COMPRESS:
        return
    if len(_COMPRESS) >= _PLAN_LIMIT:
        _COMPRESS.clear()
    _COMPRESS[key] = CompressPlan(pages, lz4_element_size, float_format,
                                  where == backend.INTERPRET)


# ------------------------------------------------------------------------- decompress
def direct_decoder(c: object, codec: object, backend_name: object) -> str | None:
    """``"lz4"`` or ``"exp"``: the decoder that runs this ``decompress`` call through its
    known-classes launcher (a valid fixed-stride container without checksums, of at least
    one page, on a usable GPU, called eagerly); None: the full path."""
    if (torch.compiler.is_compiling() or type(c) is not CompressedPages
            or c.offsets is not None or c.checksums is not None):
        return None
    decoder = c.codec if codec is None else codec
    if (decoder != "lz4" and decoder != "exp") or (backend_name != "auto"
                                                   and backend_name != "triton"):
        return None
    if not plainly_valid(c) or not c.payload.is_cuda or c.sizes.shape[0] == 0:
        return None
    if not backend.gpu_status().usable or not _eager(False):
        return None
    return decoder


def decode(decoder: str, c: CompressedPages, out: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, status)`` of ``c`` by ``decoder`` (:func:`direct_decoder`), into ``out`` (checked
    by the caller) or new pages, on the current stream of ``c``'s device: the launches
    ``decompress_into`` / ``decompress_exp_into`` make, their compiled kernels kept per
    ``(decoder, pages, page size, device)``."""
    payload, sizes, kinds = c.payload, c.sizes, c.kinds
    n, p = sizes.shape[0], c.page_size
    index = payload.get_device()
    # (new_empty of a tensor of the dtype: fewer arguments to parse than torch.empty's)
    pages = out if out is not None else payload.new_empty((n, p))
    status = sizes.new_empty((n,))
    key = (decoder, n, p, index)
    kept = _DECODES.get(key) or _decode_plan(key)
    kept((payload.data_ptr(), None, sizes.data_ptr(), kinds.data_ptr(), pages.data_ptr(),
          status.data_ptr()), (n * p,),
         lambda: (payload, None, sizes, kinds, pages, status, n * p))
    return pages, status


_DECODES: dict[tuple, _Kept] = {}  # (decoder, pages, page size, device) -> its launches


def _decode_plan(key: tuple) -> _Kept:
    """The launches of ``key``'s decoder (its module imported once: Triton loads on use)."""
    decoder, n, p, index = key
    if decoder == "lz4":
        from .kernels.lz4_decompress import into_launches
    else:
        from .kernels.exp_codec import into_launches
    if len(_DECODES) >= _PLAN_LIMIT:
        _DECODES.clear()
    return _DECODES.setdefault(key, _Kept(index, (n,), into_launches(p)))
